"""Model: the trained ensemble (tree arrays, bin edges, starting value, link) and prediction.

Prediction bins raw ``X`` with the training edges, walks all trees in one compiled call
(``predictor.predict_raw_binned``) and applies the loss's inverse link. Rows are padded to a
few bucket sizes so that predicting on many batch sizes compiles only a few programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .binning import BinEdges, apply_bins
from .devices import replicated, row_mesh, row_sharding
from .predictor import predict_leaf_binned, predict_raw_binned
from .tree import Tree
from .validation import check_base_margin, check_features


def padded_size(n_rows: int, multiple: int = 1) -> int:
    """The bucket size for ``n_rows``: ``m * 2^e`` with ``8 <= m <= 16`` (at most 12.5% padding),
    rounded up to a multiple of ``multiple`` (the device count)."""
    if n_rows <= 64:
        bucket = 64
    else:
        exponent = max(int(np.ceil(np.log2(n_rows))) - 4, 0)
        step = 2 ** exponent
        bucket = -(-n_rows // step) * step
    return -(-bucket // multiple) * multiple


@dataclass(frozen=True)
class Model:
    """A trained jaxboost ensemble.

    Attributes:
      trees: node arrays shaped ``(rounds, num_outputs, nodes)`` (NumPy).
      bin_edges: the training data's bin edges.
      base_score: ``(num_outputs,)`` starting raw prediction (0 when trained with base_margin).
      link: inverse link applied by ``predict``.
      loss_name: the built-in loss name, or the custom function's name.
      best_iteration: index of the best round on the last eval set when early stopping ran.
      evals_result: ``{eval_name: {metric_name: [value per round]}}``.
      params: the training parameters.
    """

    trees: Tree
    bin_edges: BinEdges
    base_score: np.ndarray
    link: Callable
    loss_name: str
    best_iteration: int | None = None
    evals_result: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    feature_names: tuple | None = None

    @property
    def num_outputs(self) -> int:
        return int(self.base_score.shape[0])

    @property
    def num_rounds(self) -> int:
        return int(self.trees.feature.shape[0])

    @property
    def n_features(self) -> int:
        return self.bin_edges.n_features

    def _rounds(self, iteration_range) -> tuple[int, int]:
        if iteration_range is None:
            stop = self.num_rounds if self.best_iteration is None else self.best_iteration + 1
            return 0, stop
        start, stop = iteration_range
        if not 0 <= start <= stop <= self.num_rounds:
            raise ValueError(f"iteration_range {iteration_range} is outside the model's {self.num_rounds} rounds")
        return start, stop

    def _binned(self, X) -> np.ndarray:
        features, _ = check_features(X, n_features=self.n_features)
        return apply_bins(features, self.bin_edges)

    def predict_raw(self, X, *, iteration_range: tuple[int, int] | None = None, base_margin=None) -> np.ndarray:
        """Raw predictions (margins): ``(n,)``, or ``(n, K)`` for K outputs.

        Uses rounds ``[0, best_iteration]`` after early stopping unless ``iteration_range``
        (rounds ``a .. b-1``) says otherwise.
        """
        X_binned = self._binned(X)
        n_rows = X_binned.shape[0]
        margin = check_base_margin(base_margin, n_rows, self.num_outputs)
        initial = np.broadcast_to(self.base_score, (n_rows, self.num_outputs)) if margin is None else margin
        start, stop = self._rounds(iteration_range)
        # Rows are sharded over the devices (every core on a CPU) like in training.
        mesh = row_mesh(n_rows)
        size = padded_size(n_rows, mesh.size)
        X_padded = np.zeros((size, X_binned.shape[1]), np.uint8)
        X_padded[:n_rows] = X_binned
        initial_padded = np.zeros((size, self.num_outputs), np.float32)
        initial_padded[:n_rows] = initial
        trees = jax.device_put(jax.tree_util.tree_map(lambda a: a[start:stop], self.trees), replicated(mesh))
        raw = np.asarray(predict_raw_binned(trees, jax.device_put(X_padded, row_sharding(mesh, 2)),
                                            jax.device_put(initial_padded, row_sharding(mesh, 2)),
                                            missing_bin=self.bin_edges.missing_bin, mesh=mesh))[:n_rows]
        return raw[:, 0] if self.num_outputs == 1 else raw

    def predict(self, X, *, iteration_range: tuple[int, int] | None = None, base_margin=None) -> np.ndarray:
        """Predictions after the link: probabilities for logistic, class probabilities for softmax."""
        raw = self.predict_raw(X, iteration_range=iteration_range, base_margin=base_margin)
        return np.asarray(self.link(jnp.asarray(raw)))

    def predict_leaf(self, X, *, iteration_range: tuple[int, int] | None = None) -> np.ndarray:
        """Heap index of the leaf reached per row and tree: ``(n, rounds)`` or ``(n, rounds, K)``."""
        start, stop = self._rounds(iteration_range)
        trees = jax.tree_util.tree_map(lambda a: jnp.asarray(a[start:stop]), self.trees)
        leaves = np.asarray(predict_leaf_binned(trees, jnp.asarray(self._binned(X)),
                                                missing_bin=self.bin_edges.missing_bin))
        return leaves[..., 0] if self.num_outputs == 1 else leaves

    def __repr__(self) -> str:
        return (f"Model(loss={self.loss_name!r}, rounds={self.num_rounds}, outputs={self.num_outputs}, "
                f"features={self.n_features}, best_iteration={self.best_iteration})")
