"""Differentiable ensemble: a trained model as a pytree of arrays, after training.

``leaf_parameters(model)`` turns the trees into ``EnsembleParameters``: the leaf values, the raw
split thresholds (the bin edges the splits use) and the starting value as JAX arrays, with the
tree shapes (split features, threshold bins, default directions, leaf flags) held as static
data. From it:

* ``predict_raw`` / ``predict_raw_binned``: hard routing, exactly ``Model.predict_raw``; linear
  in the leaf values, so ``jax.grad`` gives each leaf the sum of its rows' output gradients.
* ``soft_predict_raw``: every split ``x < threshold`` relaxed to
  ``sigmoid((threshold - x) / temperature)``; smooth in ``X``, thresholds and leaf values.
* ``fine_tune_leaves``: gradient descent with any optax optimizer on the leaf values, for any
  differentiable objective of the whole dataset's raw predictions.
* ``to_model``: fine-tuned leaf values back into an ordinary ``Model``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .model import Model
from .predictor import leaf_index
from .tree import Tree
from .validation import check_features

__all__ = ["EnsembleParameters", "TreeStructure", "feature_spread", "fine_tune_leaves", "leaf_parameters",
           "pairwise_auc_loss", "predict_raw", "predict_raw_binned", "soft_predict_raw", "to_model"]


class TreeStructure:
    """The shape of every tree, held fixed while leaf values (and thresholds) are differentiated.

    Static data of the ``EnsembleParameters`` pytree: hashed by content, so that ``jax.jit``
    compiles once per ensemble shape, not once per ``leaf_parameters`` call.

    Attributes:
      feature, threshold_bin, default_left, is_leaf: NumPy arrays ``(rounds, K, nodes)`` as in
        ``Tree``.
      missing_bin: the bin code of a missing value.
      n_features: the number of input features.
      rounds: ``(start, stop)``: the model rounds these trees are.
    """

    def __init__(self, feature, threshold_bin, default_left, is_leaf, missing_bin: int, n_features: int,
                 rounds: tuple[int, int]):
        self.feature = np.asarray(feature, np.int32)
        self.threshold_bin = np.asarray(threshold_bin, np.int32)
        self.default_left = np.asarray(default_left, bool)
        self.is_leaf = np.asarray(is_leaf, bool)
        self.missing_bin = int(missing_bin)
        self.n_features = int(n_features)
        self.rounds = (int(rounds[0]), int(rounds[1]))
        for array in (self.feature, self.threshold_bin, self.default_left, self.is_leaf):
            array.setflags(write=False)
        digest = hashlib.sha256()
        for array in (self.feature, self.threshold_bin, self.default_left, self.is_leaf):
            digest.update(str(array.shape).encode())
            digest.update(array.tobytes())
        digest.update(repr((self.missing_bin, self.n_features, self.rounds)).encode())
        self._digest = digest.hexdigest()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(rounds, K, nodes)``."""
        return self.feature.shape

    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, TreeStructure) and self._digest == other._digest

    def __repr__(self) -> str:
        return f"TreeStructure(shape={self.shape}, rounds={self.rounds}, n_features={self.n_features})"


@dataclasses.dataclass(frozen=True)
class EnsembleParameters:
    """A trained ensemble as a JAX pytree: its array fields are leaves, ``structure`` is static.

    Attributes:
      leaf_values: float32 ``(rounds, K, nodes)``: each node's value (learning rate included);
        only leaf entries affect predictions, so gradients are zero elsewhere.
      thresholds: float32 ``(rounds, K, nodes)``: the raw value each split compares with
        (``x < threshold`` goes left): the bin edge of the split; ``+inf`` for a split on a
        padded edge (every non-missing value goes left); 0 for leaves and unused slots.
      base_score: float32 ``(K,)``: the starting raw prediction.
      structure: the fixed tree shapes (``TreeStructure``).
    """

    leaf_values: jax.Array
    thresholds: jax.Array
    base_score: jax.Array
    structure: TreeStructure

    @property
    def num_outputs(self) -> int:
        return self.structure.shape[1]


jax.tree_util.register_dataclass(EnsembleParameters, data_fields=["leaf_values", "thresholds", "base_score"],
                                 meta_fields=["structure"])


def _split_thresholds(model: Model, rounds: tuple[int, int]) -> np.ndarray:
    """The raw threshold of every split node: ``edges[feature, threshold_bin]`` (+inf if padded)."""
    start, stop = rounds
    trees = model.trees
    feature = np.asarray(trees.feature[start:stop])
    threshold_bin = np.asarray(trees.threshold_bin[start:stop])
    is_leaf = np.asarray(trees.is_leaf[start:stop])
    edges = model.bin_edges.edges
    in_range = threshold_bin < edges.shape[1]
    thresholds = np.where(in_range, edges[feature, np.minimum(threshold_bin, edges.shape[1] - 1)], np.inf)
    return np.where(is_leaf, 0.0, thresholds).astype(np.float32)


def leaf_parameters(model: Model, *, iteration_range: tuple[int, int] | None = None) -> EnsembleParameters:
    """The model's trees as a differentiable pytree (``EnsembleParameters``).

    Args:
      model: a trained ``Model``.
      iteration_range: rounds ``(a, b)`` to take, as in ``Model.predict_raw``; default: the
        rounds ``Model.predict_raw`` uses (up to ``best_iteration`` after early stopping).
    """
    if not isinstance(model, Model):
        raise TypeError(f"leaf_parameters needs a jaxboost Model; got {type(model).__name__}")
    rounds = model._rounds(iteration_range)
    start, stop = rounds
    trees = model.trees
    structure = TreeStructure(trees.feature[start:stop], trees.threshold_bin[start:stop],
                              trees.default_left[start:stop], trees.is_leaf[start:stop],
                              missing_bin=model.bin_edges.missing_bin, n_features=model.n_features, rounds=rounds)
    return EnsembleParameters(leaf_values=jnp.asarray(trees.value[start:stop], jnp.float32),
                              thresholds=jnp.asarray(_split_thresholds(model, rounds)),
                              base_score=jnp.asarray(model.base_score, jnp.float32), structure=structure)


def _as_parameters(model_or_params) -> EnsembleParameters:
    if isinstance(model_or_params, EnsembleParameters):
        return model_or_params
    if isinstance(model_or_params, Model):
        return leaf_parameters(model_or_params)
    raise TypeError(f"expected a Model or EnsembleParameters; got {type(model_or_params).__name__}")


def _check_parameters(params: EnsembleParameters) -> None:
    if not isinstance(params, EnsembleParameters):
        raise TypeError(f"expected EnsembleParameters (from leaf_parameters); got {type(params).__name__}")
    shape = params.structure.shape
    for name in ("leaf_values", "thresholds"):
        if tuple(jnp.shape(getattr(params, name))) != shape:
            raise ValueError(f"params.{name} has shape {jnp.shape(getattr(params, name))}; the trees need {shape}")
    if tuple(jnp.shape(params.base_score)) != (shape[1],):
        raise ValueError(f"params.base_score has shape {jnp.shape(params.base_score)}; the trees need ({shape[1]},)")


def _check_X(X, params: EnsembleParameters, what: str = "X"):
    """``X`` as a float array (n, d); NumPy input is checked on the host, traced input by shape."""
    n_features = params.structure.n_features
    if isinstance(X, jax.Array):
        if X.ndim != 2 or X.shape[1] != n_features:
            raise ValueError(f"{what} must have shape (n, {n_features}); got {X.shape}")
        return X if jnp.issubdtype(X.dtype, jnp.floating) else X.astype(jnp.float32)
    features, _ = check_features(X, n_features=n_features, what=what)
    return jnp.asarray(features)


def _structure_arrays(structure: TreeStructure):
    return (jnp.asarray(structure.feature), jnp.asarray(structure.threshold_bin),
            jnp.asarray(structure.default_left), jnp.asarray(structure.is_leaf))


def _leaf_index_raw(feature, default_left, is_leaf, thresholds, X):
    """Heap index of the leaf each row of raw ``X`` reaches in one tree: ``x < threshold`` goes
    left, a missing value follows the default direction. The same rule as the binned walk."""
    max_depth = (feature.shape[-1] + 1).bit_length() - 2
    row_ids = jnp.arange(X.shape[0])
    node = jnp.zeros(X.shape[0], jnp.int32)
    for _ in range(max_depth):
        value = X[row_ids, feature[node]]
        goes_left = jnp.where(jnp.isnan(value), default_left[node], value < thresholds[node])
        node = jnp.where(is_leaf[node], node, 2 * node + 2 - goes_left.astype(jnp.int32))
    return node


def _sum_rounds(params: EnsembleParameters, n_rows: int, per_tree_leaf: Callable):
    """``base_score`` plus every tree's leaf value, rounds added one by one in order (as the
    compiled predictor does, so the sums agree to the last bit)."""
    feature, threshold_bin, default_left, is_leaf = _structure_arrays(params.structure)
    initial = jnp.broadcast_to(params.base_score.astype(jnp.float32), (n_rows, params.num_outputs))

    def add_round(raw_prediction, round_arrays):
        def one_output(tree_arrays):
            values = tree_arrays[-1]
            return values[per_tree_leaf(*tree_arrays[:-1])]

        return raw_prediction + jax.vmap(one_output, out_axes=1)(round_arrays), None

    raw_prediction, _ = lax.scan(add_round, initial, (feature, threshold_bin, default_left, is_leaf,
                                                      params.thresholds, params.leaf_values))
    return raw_prediction[:, 0] if params.num_outputs == 1 else raw_prediction


def predict_raw(params: EnsembleParameters, X) -> jax.Array:
    """Raw predictions of the ensemble on raw features ``X`` (n, d), NaN = missing.

    Hard routing (``x < threshold`` goes left, as the bin edges route), so the result equals
    ``Model.predict_raw`` exactly; it is linear in ``params.leaf_values`` and ``params.base_score``
    (and constant in ``X`` and the thresholds between splits).

    Returns:
      ``(n,)``, or ``(n, K)`` for K outputs.
    """
    _check_parameters(params)
    return _predict_raw(params, _check_X(X, params))


@jax.jit
def _predict_raw(params: EnsembleParameters, X) -> jax.Array:
    def leaf(feature, threshold_bin, default_left, is_leaf, thresholds):
        return _leaf_index_raw(feature, default_left, is_leaf, thresholds, X)

    return _sum_rounds(params, X.shape[0], leaf)


def predict_raw_binned(params: EnsembleParameters, X_binned) -> jax.Array:
    """Raw predictions on binned features (``Dataset.X_binned`` or ``apply_bins`` with the
    model's edges); equal to ``predict_raw`` on the raw features. Ignores ``params.thresholds``."""
    _check_parameters(params)
    X_binned = jnp.asarray(X_binned)
    if X_binned.ndim != 2 or X_binned.shape[1] != params.structure.n_features:
        raise ValueError(f"X_binned must have shape (n, {params.structure.n_features}); got {X_binned.shape}")
    if not jnp.issubdtype(X_binned.dtype, jnp.integer):
        raise TypeError(f"X_binned must hold integer bin codes; got dtype {X_binned.dtype}")
    return _predict_raw_binned(params, X_binned)


@jax.jit
def _predict_raw_binned(params: EnsembleParameters, X_binned) -> jax.Array:
    missing_bin = params.structure.missing_bin

    def leaf(feature, threshold_bin, default_left, is_leaf, thresholds):
        zeros = jnp.zeros(feature.shape, jnp.float32)
        tree = Tree(feature, threshold_bin, default_left, is_leaf, zeros, zeros, zeros)
        return leaf_index(tree, X_binned, missing_bin)

    return _sum_rounds(params, X_binned.shape[0], leaf)


def to_model(model: Model, params: EnsembleParameters) -> Model:
    """An ordinary ``Model`` with the leaf values and base score of ``params``.

    ``params`` must come from ``leaf_parameters(model)`` (same trees); its values go back into
    the rounds they were taken from. Thresholds cannot change: a ``Model`` routes by its bin
    edges, so changed thresholds raise a ValueError.
    """
    if not isinstance(model, Model):
        raise TypeError(f"to_model needs the jaxboost Model the parameters came from; got {type(model).__name__}")
    _check_parameters(params)
    structure = params.structure
    start, stop = structure.rounds
    trees = model.trees
    if (stop > model.num_rounds or structure.missing_bin != model.bin_edges.missing_bin
            or structure.n_features != model.n_features
            or not all(np.array_equal(np.asarray(getattr(trees, name)[start:stop]), getattr(structure, name))
                       for name in ("feature", "threshold_bin", "default_left", "is_leaf"))):
        raise ValueError("params do not match this model's trees; use the model they were taken from")
    thresholds = np.asarray(params.thresholds)
    if not np.array_equal(np.where(structure.is_leaf, 0.0, thresholds),
                          _split_thresholds(model, structure.rounds)):
        raise ValueError("params.thresholds differ from the model's bin edges; a Model routes rows by its bin "
                         "edges, so only leaf values and base_score can be written back")
    values = np.array(trees.value, dtype=np.float32, copy=True)
    values[start:stop] = np.asarray(params.leaf_values, np.float32)
    base_score = np.asarray(params.base_score, np.float32)
    if not np.isfinite(base_score).all():
        raise ValueError("params.base_score contains NaN or infinite values")
    return dataclasses.replace(model.with_leaf_values(values), base_score=base_score)


def feature_spread(model: Model) -> np.ndarray:
    """A per-feature length scale from the bin edges: last real edge minus first (about the
    range of the middle of the data: edges are quantiles). 1.0 for features with fewer than
    two edges (binary or constant features). Multiply a unitless temperature by it."""
    if not isinstance(model, Model):
        raise TypeError(f"feature_spread needs a jaxboost Model; got {type(model).__name__}")
    edges, n_edges = model.bin_edges.edges, model.bin_edges.n_edges
    spread = np.ones(len(n_edges))
    several = n_edges >= 2
    rows = np.flatnonzero(several)
    spread[several] = edges[rows, n_edges[several] - 1].astype(np.float64) - edges[rows, 0]
    return spread.astype(np.float32)


def _soft_tree(feature, default_left, is_leaf, thresholds, values, X_filled, missing, temperature):
    """One tree's soft output per row: sum over leaves of P(reach leaf) * leaf value."""
    nodes = feature.shape[-1]
    max_depth = (nodes + 1).bit_length() - 2
    padded = jnp.isinf(thresholds)
    # The double where keeps inf out of the sigmoid, whose gradient would otherwise be NaN.
    finite_thresholds = jnp.where(padded, 0.0, thresholds)
    x = X_filled[:, feature]
    p_left = jax.nn.sigmoid((finite_thresholds - x) / temperature[feature])
    p_left = jnp.where(padded, 1.0, p_left)
    p_left = jnp.where(missing[:, feature], default_left.astype(p_left.dtype), p_left)
    reach_levels = [jnp.ones((X_filled.shape[0], 1), p_left.dtype)]
    for depth in range(max_depth):
        first, last = 2 ** depth - 1, 2 ** (depth + 1) - 1
        reach = reach_levels[-1] * (~is_leaf[first:last])
        left = reach * p_left[:, first:last]
        children = jnp.stack([left, reach - left], axis=-1)
        reach_levels.append(children.reshape(X_filled.shape[0], 2 * (last - first)))
    reach = jnp.concatenate(reach_levels, axis=1)
    # HIGHEST: on a GPU a float32 product defaults to TF32 (10-bit mantissas).
    return jnp.matmul(reach * is_leaf, values, precision=lax.Precision.HIGHEST)


@jax.jit
def _soft_predict_raw(params: EnsembleParameters, X, temperature):
    feature, _, default_left, is_leaf = _structure_arrays(params.structure)
    missing = jnp.isnan(X)
    X_filled = jnp.where(missing, 0.0, X)
    initial = jnp.broadcast_to(params.base_score, (X.shape[0], params.num_outputs)).astype(X_filled.dtype)

    def add_round(raw_prediction, round_arrays):
        def one_output(tree_arrays):
            return _soft_tree(*tree_arrays, X_filled, missing, temperature)

        return raw_prediction + jax.vmap(one_output, out_axes=1)(round_arrays), None

    raw_prediction, _ = lax.scan(add_round, initial, (feature, default_left, is_leaf, params.thresholds,
                                                      params.leaf_values))
    return raw_prediction[:, 0] if params.num_outputs == 1 else raw_prediction


def soft_predict_raw(model_or_params, X, temperature) -> jax.Array:
    """Soft raw predictions: a smooth relaxation of the trees, differentiable in ``X``, the
    thresholds and the leaf values.

    Each split ``x < threshold`` sends a row left with probability
    ``sigmoid((threshold - x) / temperature)`` (a missing value follows the default direction
    with probability 1; a split on a padded ``+inf`` edge sends every value left); the chance
    of reaching a leaf is the product along its path, and a tree outputs the
    probability-weighted sum of its leaf values. As ``temperature -> 0`` this tends to the hard
    prediction for every row not exactly on a threshold.

    Args:
      model_or_params: a ``Model`` or ``EnsembleParameters``.
      X: raw features (n, d), NaN = missing (NumPy or a JAX array, e.g. under ``jax.grad``).
      temperature: in units of the features: a positive scalar, or one per feature ``(d,)``.
        Features on different scales want different temperatures: pass
        ``t * feature_spread(model)`` (or ``t * np.nanstd(X, axis=0)``) with a unitless ``t``.

    Returns:
      ``(n,)``, or ``(n, K)`` for K outputs.
    """
    params = _as_parameters(model_or_params)
    _check_parameters(params)
    X = _check_X(X, params)
    n_features = params.structure.n_features
    if isinstance(temperature, numbers.Real):
        if not (np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a positive finite number; got {temperature!r}")
    else:
        try:
            values = np.asarray(temperature)
        except jax.errors.TracerArrayConversionError:  # traced (e.g. differentiated): shape only
            values = np.zeros(jnp.shape(temperature)) + 1.0
        if values.shape not in ((), (n_features,)):
            raise ValueError(f"temperature must be a scalar or one value per feature ({n_features},); "
                             f"got shape {values.shape}")
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise ValueError("temperature must be positive and finite for every feature")
    temperature = jnp.broadcast_to(jnp.asarray(temperature, X.dtype), (n_features,))
    return _soft_predict_raw(params, X, temperature)


def pairwise_auc_loss(raw_prediction, y, *, temperature: float = 1.0, num_pairs: int | None = None, key=None):
    """One minus a smooth AUC: the mean over (positive, negative) pairs of
    ``sigmoid((raw_negative - raw_positive) / temperature)``.

    All pairs when ``num_pairs`` is None (``n_pos * n_neg`` terms: small data); otherwise
    ``num_pairs`` pairs drawn with ``key`` (positives and negatives each uniformly). Labels are
    0/1. Not decomposable over rows: use it with ``fine_tune_leaves``, not as a training loss.
    """
    raw_prediction = jnp.asarray(raw_prediction)
    positive = jnp.asarray(y) > 0.5
    if num_pairs is None:
        pair_mask = positive[:, None] & ~positive[None, :]
        terms = jax.nn.sigmoid((raw_prediction[None, :] - raw_prediction[:, None]) / temperature)
        return jnp.sum(jnp.where(pair_mask, terms, 0.0)) / jnp.maximum(jnp.sum(pair_mask), 1)
    if key is None:
        raise ValueError("pairwise_auc_loss with num_pairs needs a PRNG key")
    key_positive, key_negative = jax.random.split(key)
    n_rows = raw_prediction.shape[0]
    positives = jax.random.choice(key_positive, n_rows, (num_pairs,), p=positive / jnp.sum(positive))
    negatives = jax.random.choice(key_negative, n_rows, (num_pairs,), p=~positive / jnp.sum(~positive))
    return jnp.mean(jax.nn.sigmoid((raw_prediction[negatives] - raw_prediction[positives]) / temperature))


def _takes_key(objective: Callable) -> bool:
    try:
        return "key" in inspect.signature(objective).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False


def _gathered_raw(values, base_score, flat_leaf, num_outputs):
    """Raw predictions from precomputed leaf positions: routing does not depend on leaf values,
    so each step is a gather (and its gradient a scatter-add) instead of a tree walk."""
    raw_prediction = base_score + values.reshape(-1)[flat_leaf].sum(axis=1)
    return raw_prediction[:, 0] if num_outputs == 1 else raw_prediction


@jax.jit
def _flat_leaf_positions(params: EnsembleParameters, X) -> jax.Array:
    """For every row, round and output: the index of its leaf in ``leaf_values.reshape(-1)``."""
    n_rounds, num_outputs, nodes = params.structure.shape
    feature, _, default_left, is_leaf = _structure_arrays(params.structure)
    per_tree = jax.vmap(jax.vmap(lambda f, d, l, t: _leaf_index_raw(f, d, l, t, X)))(
        feature, default_left, is_leaf, params.thresholds)  # (rounds, K, n)
    offsets = (jnp.arange(n_rounds)[:, None] * num_outputs + jnp.arange(num_outputs)[None, :]) * nodes
    return jnp.moveaxis(per_tree + offsets[:, :, None], -1, 0)  # (n, rounds, K)


def _objective_at(objective, takes_key, num_outputs, values, base_score, flat_leaf, labels, key):
    raw_prediction = _gathered_raw(values, base_score, flat_leaf, num_outputs)
    return objective(raw_prediction, labels, key=key) if takes_key else objective(raw_prediction, labels)


@functools.lru_cache(maxsize=1)
def _default_optimizer():
    """One shared default, so that repeated calls reuse the compiled program."""
    import optax

    return optax.adam(1e-3)


@functools.lru_cache(maxsize=16)
def _fine_tune_program(objective, optimizer, steps: int, validating: bool, takes_key: bool, num_outputs: int):
    """The compiled optimisation loop; cached so that fine-tuning models of the same shape with the
    same objective and optimizer objects compiles once."""
    import optax

    objective_at = functools.partial(_objective_at, objective, takes_key, num_outputs)

    @jax.jit
    def run(values, *, is_leaf, base_score, flat_leaf, y, flat_leaf_val, y_val, seed):
        base_key = jax.random.key(seed)
        validation_key = jax.random.fold_in(base_key, steps + 2)

        def validation_objective(values):
            if not validating:
                return jnp.float32(0.0)
            return objective_at(values, base_score, flat_leaf_val, y_val, validation_key)

        def step(carry, step_index):
            values, optimizer_state, best_values, best_objective = carry
            train_objective, gradient = jax.value_and_grad(objective_at)(values, base_score, flat_leaf, y,
                                                                          jax.random.fold_in(base_key, step_index))
            held_out = validation_objective(values).astype(jnp.float32)
            improved = held_out < best_objective
            best_values = jnp.where(improved, values, best_values)
            best_objective = jnp.where(improved, held_out, best_objective)
            # Only leaves are reached; inner slots keep their trained values untouched.
            updates, optimizer_state = optimizer.update(jnp.where(is_leaf, gradient, 0.0), optimizer_state, values)
            values = optax.apply_updates(values, updates)
            return (values, optimizer_state, best_values, best_objective), (train_objective, held_out)

        start = (values, optimizer.init(values), values, jnp.float32(jnp.inf))
        (values, _, best_values, best_objective), (train_history, val_history) = lax.scan(
            step, start, jnp.arange(steps))
        final_train = objective_at(values, base_score, flat_leaf, y, jax.random.fold_in(base_key, steps + 1))
        final_val = validation_objective(values).astype(jnp.float32)
        improved = final_val < best_objective
        best_values = jnp.where(improved, values, best_values)
        return (values, best_values, jnp.append(train_history, final_train),
                jnp.append(val_history, final_val))

    return run


def fine_tune_leaves(model: Model, X, y, objective: Callable, *, optimizer=None, steps: int = 200, X_val=None,
                     y_val=None, restore_best: bool = True, seed: int = 0,
                     iteration_range: tuple[int, int] | None = None) -> Model:
    """Fine-tune a model's leaf values by gradient descent on ``objective`` (to minimise).

    The tree shapes stay fixed, so every row keeps its leaves and the raw prediction is linear in
    the leaf values; the objective sees the raw predictions of the whole dataset at once, so it
    need not be a sum over rows (e.g. ``pairwise_auc_loss``). All ``steps`` run in one compiled
    ``lax.scan``.

    Args:
      model: a trained ``Model``.
      X, y: raw features (n, d) and labels (n,) or (n, m), passed to the objective as given.
      objective: a JAX function ``objective(raw_prediction, y) -> scalar``, ``raw_prediction``
        shaped ``(n,)`` (or ``(n, K)``) as ``Model.predict_raw`` returns; if it has a ``key``
        parameter, every step passes a fresh PRNG key (for sampled pairs) and the validation
        objective a fixed one.
      optimizer: an optax ``GradientTransformation``; default ``optax.adam(1e-3)``.
      steps: optimisation steps.
      X_val, y_val: held-out data: the objective is tracked on it every step and, with
        ``restore_best`` (default), the values of the best step (the starting values included)
        are returned; otherwise those after the last step.
      seed: seeds the keys passed to the objective.
      iteration_range: which rounds to tune, as in ``leaf_parameters``.

    Returns:
      The fine-tuned ``Model``. ``evals_result["fine_tune"]`` holds ``"objective"`` (training
      objective before each step and after the last) and, with ``X_val``,
      ``"validation_objective"`` (likewise); the best step is the first minimum of the latter.
    """
    if not callable(objective):
        raise TypeError(f"objective must be a JAX function objective(raw_prediction, y); got {objective!r}")
    if not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be a positive integer; got {steps!r}")
    if optimizer is None:
        optimizer = _default_optimizer()
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError("optimizer must be an optax GradientTransformation (with init and update)")
    if (X_val is None) != (y_val is None):
        raise ValueError("pass X_val and y_val together")
    params = leaf_parameters(model, iteration_range=iteration_range)
    X = _check_X(X, params)
    y = jnp.asarray(y)
    if y.shape[0] != X.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows but X has {X.shape[0]}")
    flat_leaf = _flat_leaf_positions(params, X)
    validating = X_val is not None
    if validating:
        X_val = _check_X(X_val, params, what="X_val")
        y_val = jnp.asarray(y_val)
        if y_val.shape[0] != X_val.shape[0]:
            raise ValueError(f"y_val has {y_val.shape[0]} rows but X_val has {X_val.shape[0]}")
        flat_leaf_val = _flat_leaf_positions(params, X_val)
    takes_key = _takes_key(objective)
    num_outputs = params.num_outputs
    value_shape = jax.eval_shape(functools.partial(_objective_at, objective, takes_key, num_outputs),
                                 params.leaf_values, params.base_score, flat_leaf, y, jax.random.key(0))
    if value_shape.shape != ():
        raise ValueError(f"objective must return a scalar; it returned shape {value_shape.shape}")
    try:
        program = _fine_tune_program(objective, optimizer, steps, validating, takes_key, num_outputs)
    except TypeError:  # an unhashable objective or optimizer: build the program uncached
        program = _fine_tune_program.__wrapped__(objective, optimizer, steps, validating, takes_key, num_outputs)
    if not validating:
        flat_leaf_val, y_val = flat_leaf[:1], y[:1]  # unused placeholders of a fixed small shape
    run = functools.partial(program, is_leaf=jnp.asarray(params.structure.is_leaf), base_score=params.base_score,
                            flat_leaf=flat_leaf, y=y, flat_leaf_val=flat_leaf_val, y_val=y_val,
                            seed=jnp.uint32(seed))
    last_values, best_values, train_history, val_history = run(params.leaf_values)
    chosen = best_values if validating and restore_best else last_values
    if not bool(jnp.isfinite(chosen).all()):
        raise FloatingPointError("fine-tuning produced non-finite leaf values; lower the optimizer's learning rate "
                                 "or check the objective for overflow")
    tuned = to_model(model, dataclasses.replace(params, leaf_values=chosen))
    record = {"objective": np.asarray(train_history).tolist()}
    if validating:
        record["validation_objective"] = np.asarray(val_history).tolist()
    return dataclasses.replace(tuned, evals_result={**model.evals_result, "fine_tune": record})
