"""Model: the trained ensemble (tree arrays, bin edges, starting value, link) and prediction.

Prediction walks the raw ``X`` through the trees with the native predictor on the host's cores
(``native.NativeForest``, the splits' bin edges as thresholds), which the model prepares once
per range of rounds and keeps, whatever JAX's default backend (the rows and the result are host
arrays). Without the native predictor (no C++ compiler, ``JAXBOOST_NATIVE=0``) it bins ``X``
with the training edges and walks all trees in one compiled call on the default backend
(``predictor.predict_raw_binned``), rows padded to a few bucket sizes so that many batch sizes
compile few programs. ``predict`` then applies the loss's inverse link (``link.apply_link``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .binning import BinEdges, apply_bins
from .devices import MIN_PREDICT_ROWS_PER_DEVICE, padded_size, predictor_threads, replicated, row_mesh, row_sharding
from .link import apply_link
from .native import NativeForest, feature_predictor_available
from .predictor import packed_nodes, predict_leaf_binned, predict_raw_binned
from .tree import Tree
from .validation import check_base_margin, check_features

# Ranges of rounds a model keeps prepared for the native predictor (``Model._native_forest``).
MAX_PREPARED_FORESTS = 8
_PREPARED_FORESTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Model:
    """A trained jaxboost ensemble.

    A model does not change: its tree and bin-edge arrays are read-only, and ``with_leaf_values``
    or slicing (``model[a:b]``) make new models.

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

    def __post_init__(self):
        # A model does not change once built (``with_leaf_values`` and slicing make new ones), so
        # what prediction prepares from its trees is kept (``_native_forest``). Freezing the NumPy
        # arrays turns an in-place write into an error instead of stale predictions.
        for array in (*self.trees, self.bin_edges.edges):
            if isinstance(array, np.ndarray):
                array.flags.writeable = False
        object.__setattr__(self, "_prepared_forests", {})

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_prepared_forests"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_prepared_forests", {})

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
        features, _ = check_features(X, n_features=self.n_features, expected_names=self.feature_names,
                                     blockwise=True)
        return apply_bins(features, self.bin_edges)

    def predict_raw(self, X, *, iteration_range: tuple[int, int] | None = None, base_margin=None) -> np.ndarray:
        """Raw predictions (margins): ``(n,)``, or ``(n, K)`` for K outputs.

        Uses rounds ``[0, best_iteration]`` after early stopping unless ``iteration_range``
        (rounds ``a .. b-1``) says otherwise.
        """
        features, _ = check_features(X, n_features=self.n_features, expected_names=self.feature_names,
                                     blockwise=True)
        n_rows = features.shape[0]
        margin = check_base_margin(base_margin, n_rows, self.num_outputs)
        initial = np.broadcast_to(self.base_score, (n_rows, self.num_outputs)) if margin is None else margin
        start, stop = self._rounds(iteration_range)
        # Rows are split over the devices (every core on a CPU), from fewer rows a device than
        # training's (no collectives to pay for).
        mesh = row_mesh(n_rows, min_rows=MIN_PREDICT_ROWS_PER_DEVICE)
        if feature_predictor_available():
            # The rows and the result are host arrays: the native predictor on the host's cores
            # beats a round trip to an accelerator (on an H100 machine, 1M x 28 rows x 100 trees:
            # 0.055 s on its 16 cores against 0.365 s on the GPU; one row 0.09 against 3.5 ms).
            raw = np.empty((n_rows, self.num_outputs), np.float32)
            raw[...] = initial
            self._native_forest(start, stop).add_to(features, raw, predictor_threads(mesh, n_rows))
            return raw[:, 0] if self.num_outputs == 1 else raw
        trees = self._checked_trees(start, stop)
        size = padded_size(n_rows, mesh.size)
        initial_padded = np.zeros((size, self.num_outputs), np.float32)
        initial_padded[:n_rows] = initial
        X_padded = np.zeros((size, features.shape[1]), np.uint8)
        X_padded[:n_rows] = apply_bins(features, self.bin_edges)
        raw = np.asarray(predict_raw_binned(jax.device_put(trees, replicated(mesh)),
                                            jax.device_put(X_padded, row_sharding(mesh, 2)),
                                            jax.device_put(initial_padded, row_sharding(mesh, 2)),
                                            missing_bin=self.bin_edges.missing_bin, mesh=mesh))[:n_rows]
        return raw[:, 0] if self.num_outputs == 1 else raw

    def _checked_trees(self, start: int, stop: int) -> Tree:
        """Rounds ``start .. stop-1`` of the trees, after checking that every split's feature exists."""
        trees = jax.tree_util.tree_map(lambda a: np.asarray(a)[start:stop], self.trees)
        split_features = trees.feature[~trees.is_leaf]
        if np.any((split_features < 0) | (split_features >= self.n_features)):
            raise ValueError(f"the model's trees split on feature indices out of range for its {self.n_features} "
                             "features: the model is corrupt")
        return trees

    def _native_forest(self, start: int, stop: int) -> NativeForest:
        """Rounds ``start .. stop-1`` prepared for the native CPU predictor: the splits' bin edges
        become raw thresholds (``x < edge`` goes left, exactly "bin <= threshold"). Prepared once
        per range: on one row, preparing took 70 of a prediction's 120 us."""
        forest = self._prepared_forests.get((start, stop))
        if forest is None:
            trees = self._checked_trees(start, stop)
            edges = self.bin_edges.edges
            thresholds = edges[trees.feature, np.minimum(trees.threshold_bin, edges.shape[1] - 1)]
            forest = NativeForest(np.ascontiguousarray(packed_nodes(trees), np.int32),
                                  np.ascontiguousarray(thresholds, np.float32),
                                  np.ascontiguousarray(trees.value, np.float32), self.n_features)
            # Threads predicting at once check and fill the cache together: unlocked, two could
            # both find room for one more and hold 9 (seen once in the test suite).
            with _PREPARED_FORESTS_LOCK:
                if len(self._prepared_forests) >= MAX_PREPARED_FORESTS:
                    self._prepared_forests.clear()
                self._prepared_forests[(start, stop)] = forest
        return forest

    def predict(self, X, *, iteration_range: tuple[int, int] | None = None, base_margin=None) -> np.ndarray:
        """Predictions after the link: probabilities for logistic, class probabilities for softmax."""
        raw = self.predict_raw(X, iteration_range=iteration_range, base_margin=base_margin)
        return apply_link(self.link, raw)

    def predict_leaf(self, X, *, iteration_range: tuple[int, int] | None = None) -> np.ndarray:
        """Heap index of the leaf reached per row and tree: ``(n, rounds)`` or ``(n, rounds, K)``."""
        start, stop = self._rounds(iteration_range)
        trees = jax.tree_util.tree_map(lambda a: jnp.asarray(a[start:stop]), self.trees)
        leaves = np.asarray(predict_leaf_binned(trees, jnp.asarray(self._binned(X)),
                                                missing_bin=self.bin_edges.missing_bin))
        return leaves[..., 0] if self.num_outputs == 1 else leaves

    def predict_contributions(self, X, *, iteration_range: tuple[int, int] | None = None,
                              base_margin=None) -> np.ndarray:
        """Exact TreeSHAP values of the raw prediction, as XGBoost's ``pred_contribs``:
        ``(n, n_features + 1)``, or ``(n, K, n_features + 1)`` for K outputs; the last column is
        the bias (starting value plus the trees' cover-weighted means). Each row sums to
        ``predict_raw`` (see ``jaxboost.contributions``)."""
        from .contributions import tree_shap

        X_binned = self._binned(X)
        margin = check_base_margin(base_margin, X_binned.shape[0], self.num_outputs)
        initial = np.broadcast_to(self.base_score, (X_binned.shape[0], self.num_outputs)) if margin is None else margin
        start, stop = self._rounds(iteration_range)
        trees = Tree(*(np.asarray(a)[start:stop] for a in self.trees))
        values = tree_shap(trees, X_binned, self.bin_edges.missing_bin, initial)
        return values[:, 0] if self.num_outputs == 1 else values

    def export_xgboost(self, path) -> None:
        """Write all rounds to ``path`` (``.json``) in XGBoost's JSON model format; see
        ``jaxboost.xgboost_export`` for what XGBoost then predicts."""
        from .xgboost_export import export_xgboost

        export_xgboost(self, path)

    def export_treelite(self):
        """All rounds as a ``treelite.Model`` (needs ``pip install treelite``); see
        ``jaxboost.treelite_export``."""
        from .treelite_export import to_treelite

        return to_treelite(self)

    def with_leaf_values(self, values) -> "Model":
        """A copy with new leaf values ``(rounds, num_outputs, nodes)`` (e.g. fine-tuned with
        ``jb.differentiable``); split nodes keep their values, everything else is unchanged."""
        values = np.asarray(values, dtype=np.float32)
        if values.shape != self.trees.value.shape:
            raise ValueError(f"leaf values must have shape {self.trees.value.shape}; got {values.shape}")
        is_leaf = np.asarray(self.trees.is_leaf)
        if not np.isfinite(values[is_leaf]).all():
            raise ValueError("leaf values contain NaN or infinite values")
        new_values = np.where(is_leaf, values, np.asarray(self.trees.value)).astype(np.float32)
        return replace(self, trees=self.trees._replace(value=new_values))

    def save(self, path, format: str | None = None) -> None:
        """Write the model to ``path``: JSON for ``.json``, a compressed NumPy archive for ``.npz``
        (or ``format="json"`` / ``"npz"``). ``jaxboost.load(path)`` reads it back exactly."""
        from .model_io import save_model

        save_model(self, path, format)

    def __getitem__(self, index) -> "Model":
        """Rounds as a model, like XGBoost's Booster slicing: ``model[a:b]`` keeps rounds ``a .. b-1``
        (step 1; negative indices count from the end), ``model[i]`` round ``i`` alone.

        The slice keeps ``base_score``, so ``model[a:b].predict_raw(X)`` equals
        ``model.predict_raw(X, iteration_range=(a, b))``; its ``best_iteration`` is None and its
        ``evals_result`` is the history of rounds ``0 .. b-1`` when ``a == 0``, else empty.
        """
        if isinstance(index, slice):
            if index.step not in (None, 1):
                raise ValueError(f"model slices take step 1; got step {index.step}")
            start, stop, _ = index.indices(self.num_rounds)
            stop = max(start, stop)
        elif isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            start = int(index) + self.num_rounds if index < 0 else int(index)
            if not 0 <= start < self.num_rounds:
                raise IndexError(f"round {index} is outside the model's {self.num_rounds} rounds")
            stop = start + 1
        else:
            raise TypeError(f"a model is indexed by a round or a slice of rounds; got {type(index).__name__}")
        history = {name: {metric: list(values[:stop]) for metric, values in per_set.items()}
                   for name, per_set in self.evals_result.items()} if start == 0 else {}
        return replace(self, trees=Tree(*(np.asarray(a)[start:stop] for a in self.trees)), best_iteration=None,
                       evals_result=history)

    def feature_importance(self, kind: str = "gain", *, iteration_range: tuple[int, int] | None = None) -> dict:
        """``{feature name or "f{i}": score}`` over the features split on, as XGBoost's
        ``get_score(importance_type=kind)``: ``"weight"``, ``"gain"``, ``"total_gain"``, ``"cover"``
        or ``"total_cover"``. Counts the rounds ``predict`` uses (see ``jaxboost.importance``)."""
        from .importance import feature_importance

        return feature_importance(self, kind, iteration_range)

    def __repr__(self) -> str:
        return (f"Model(loss={self.loss_name!r}, rounds={self.num_rounds}, outputs={self.num_outputs}, "
                f"features={self.n_features}, best_iteration={self.best_iteration})")
