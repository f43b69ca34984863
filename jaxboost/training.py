"""Training: ``jb.train``, a thin host loop around the compiled boosting round.

The host validates input, bins it once, pads rows to a bucket size (zero-weight rows), places
the data on the devices, finds the starting value and then calls the compiled round once per
round. Per round only a few scalars come back: the eval metrics and the loss's health counts,
so a custom loss that returns non-finite gradients or negative Hessians stops training at that
round with an error naming it.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .boosting import RoundParams, RoundShape, compiled_round, loss_derivatives, starting_value
from .dataset import Dataset
from .devices import replicated, row_mesh, row_sharding
from .grower import GrowthParams, empty_tree
from .model import Model, padded_size
from .objective import ResolvedLoss, higher_is_better, resolve_loss, resolve_metrics
from .regularizer import Regularization
from .tree import num_heap_nodes
from .validation import check_base_margin

MAX_DEPTH_LIMIT = 12


def _check_range(name, value, low, high, low_open=False, high_open=False):
    if not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}; got {value}")


def _check_params(num_rounds, max_depth, learning_rate, reg_lambda, reg_alpha, gamma, min_child_weight, subsample,
                  colsample_bytree, colsample_bylevel, colsample_bynode, max_delta_step, scale_pos_weight):
    if not isinstance(num_rounds, numbers.Integral) or num_rounds < 0:
        raise ValueError(f"num_rounds must be a non-negative integer; got {num_rounds!r}")
    if not isinstance(max_depth, numbers.Integral) or not 1 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth must be an integer in [1, {MAX_DEPTH_LIMIT}]; got {max_depth!r}")
    _check_range("learning_rate", learning_rate, 0, np.inf, low_open=True, high_open=True)
    for name, value in [("reg_lambda", reg_lambda), ("reg_alpha", reg_alpha), ("gamma", gamma),
                        ("min_child_weight", min_child_weight), ("max_delta_step", max_delta_step)]:
        _check_range(name, value, 0, np.inf, high_open=True)
    _check_range("scale_pos_weight", scale_pos_weight, 0, np.inf, low_open=True, high_open=True)
    for name, value in [("subsample", subsample), ("colsample_bytree", colsample_bytree),
                        ("colsample_bylevel", colsample_bylevel), ("colsample_bynode", colsample_bynode)]:
        _check_range(name, value, 0, 1, low_open=True)


def _pad_rows(array: np.ndarray, size: int, fill) -> np.ndarray:
    padded = np.full((size,) + array.shape[1:], fill, dtype=array.dtype)
    padded[: array.shape[0]] = array
    return padded


class _DeviceRows:
    """One dataset's rows padded to a bucket size and placed on the mesh."""

    def __init__(self, dataset: Dataset, resolved: ResolvedLoss, mesh, shard: bool, margin: np.ndarray | None,
                 base_score: np.ndarray | None, sample_weight: np.ndarray | None = None):
        if dataset.y is None:
            raise ValueError("a Dataset used for training or evaluation needs labels y")
        resolved.check_labels(dataset.y)
        self.n_rows = dataset.n_rows
        size = padded_size(dataset.n_rows, mesh.size if shard else 1)
        labels = dataset.y.astype(resolved.label_dtype)
        # Padding rows repeat a real label (so the loss stays finite there) with weight 0.
        self.y = _pad_rows(labels, size, labels[0])
        self.sample_weight = _pad_rows(dataset.sample_weight if sample_weight is None else sample_weight.astype(np.float32),
                                       size, 0.0)
        self.margin = None if margin is None else _pad_rows(margin, size, 0.0)
        put_rows = (lambda a: jax.device_put(a, row_sharding(mesh, a.ndim))) if shard else jnp.asarray
        self.put_rows = put_rows
        self.X_binned = _pad_rows(dataset.X_binned, size, 0)
        self.X_binned_T_device = (jax.device_put(np.ascontiguousarray(self.X_binned.T), row_sharding(mesh, 2, row_axis=1))
                                  if shard else None)
        self.X_binned_device = None if shard else jnp.asarray(self.X_binned)
        self.y_device = put_rows(self.y)
        self.sample_weight_device = put_rows(self.sample_weight)
        if base_score is not None:
            self.initial_raw_prediction(base_score)

    def initial_raw_prediction(self, base_score: np.ndarray):
        start = (np.broadcast_to(base_score, (self.y.shape[0], base_score.shape[0])) if self.margin is None
                 else self.margin)
        self.raw_prediction = self.put_rows(np.ascontiguousarray(start, dtype=np.float32))


def _as_dataset(data, y, sample_weight, max_bin, base_margin, reference=None) -> Dataset:
    if isinstance(data, Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("pass labels and weights inside the Dataset, not beside it")
        if reference is not None and data.bin_edges is not reference.bin_edges:
            # An eval Dataset binned on other edges would route rows differently from training.
            raise ValueError("eval Dataset must be built with reference=<the training Dataset>")
        return data
    return Dataset(data, y, sample_weight, max_bin=max_bin, reference=reference, base_margin=base_margin)


def _leaf_refit_needed(resolved: ResolvedLoss, rows: _DeviceRows) -> bool:
    """Custom losses: refit leaves when some weighted row has an exactly zero Hessian at the start."""
    _, _, h = jax.jit(loss_derivatives, static_argnums=0)(resolved.objective, rows.raw_prediction, rows.y_device)
    counted = np.asarray(rows.sample_weight) > 0
    return bool((np.asarray(h)[counted] == 0).any())


def _raise_if_unhealthy(health, loss_name: str, round_index: int):
    non_finite, negative = int(health.non_finite), int(health.negative_hessian)
    if non_finite:
        raise FloatingPointError(f"loss {loss_name!r} produced non-finite values, gradients or Hessians for {non_finite} "
                                 f"row(s) at round {round_index}; check the loss for overflow, log(0) or 0/0 at "
                                 "the raw predictions reached")
    if negative:
        raise ValueError(f"loss {loss_name!r} produced negative Hessians for {negative} row(s) at round "
                         f"{round_index}; a loss must be convex in the raw prediction (zero Hessians are fine)")


def train(data, y=None, *, loss="squared_error", num_rounds: int = 100, max_depth: int = 6,
          learning_rate: float = 0.1, reg_lambda: float = 1.0, reg_alpha: float = 0.0, gamma: float = 0.0,
          min_child_weight: float = 1.0, max_bin: int = 256, subsample: float = 1.0,
          colsample_bytree: float = 1.0, colsample_bylevel: float = 1.0, colsample_bynode: float = 1.0,
          sample_weight=None, base_margin=None, scale_pos_weight: float = 1.0, max_delta_step: float = 0.0,
          link=None, num_outputs: int | None = None, leaf_refit: bool | None = None, eval_set=None,
          eval_metric=None, early_stopping_rounds: int | None = None, verbose: bool | int = False,
          seed: int = 0) -> Model:
    """Train a gradient-boosted tree ensemble.

    Args:
      data: features ``X`` (n, d) (NumPy array or DataFrame; NaN = missing), or a ``Dataset``.
      y: labels (n,) when ``data`` is not a Dataset.
      loss: a built-in name (``jaxboost.losses.BUILTINS``), a built-in function with bound
        parameters (``functools.partial(jb.losses.quantile, tau=0.9)``), or any JAX function
        ``loss(raw_prediction, y) -> scalar`` for one example (e.g. an optax loss).
      num_rounds, max_depth, learning_rate, reg_lambda, reg_alpha, gamma, min_child_weight,
      max_bin, subsample, colsample_bytree, colsample_bylevel, colsample_bynode,
      scale_pos_weight, max_delta_step: as XGBoost's parameters of the same names (``gamma``
        is ``min_split_loss``).
      sample_weight: per-row non-negative weights.
      base_margin: per-row offsets of the raw prediction; the starting value is then 0 (as
        XGBoost), and ``predict`` needs the same offsets.
      link: inverse link for ``predict`` of a custom loss: ``"identity"``, ``"sigmoid"``,
        ``"softmax"``, ``"exp"`` or a JAX function.
      num_outputs: K raw outputs per row for a custom loss taking a length-K vector.
      leaf_refit: set leaves by exact 1-D minimisation of the loss; default: the built-in's
        choice, and for custom losses whether any Hessian is exactly zero at the start.
      eval_set: list of ``(X, y)`` pairs or Datasets (binned with the training edges).
      eval_metric: metric name(s) (``rmse``, ``mae``, ``logloss``, ``auc``, ``error``,
        ``mlogloss``, ``merror``, ``loss``) or JAX callables ``f(y, y_pred, weight)``.
      early_stopping_rounds: stop when the last metric on the last eval set has not improved
        for this many rounds; ``predict`` then uses rounds up to ``best_iteration``.
      verbose: print the eval metrics every round (True) or every N rounds.
      seed: seeds row and column sampling; round ``r`` uses a key derived from (seed, r).

    Returns:
      The trained ``Model``.
    """
    _check_params(num_rounds, max_depth, learning_rate, reg_lambda, reg_alpha, gamma, min_child_weight, subsample,
                  colsample_bytree, colsample_bylevel, colsample_bynode, max_delta_step, scale_pos_weight)
    dataset = _as_dataset(data, y, sample_weight, max_bin, base_margin)
    if dataset.y is None:
        raise ValueError("training needs labels: pass y, or a Dataset built with y")
    resolved = resolve_loss(loss, dataset.y, num_outputs, link)
    objective = resolved.objective
    K = objective.num_outputs
    weights = np.where(dataset.y == 1, dataset.sample_weight * np.float32(scale_pos_weight), dataset.sample_weight)

    mesh = row_mesh(dataset.n_rows)
    margin = check_base_margin(dataset.base_margin, dataset.n_rows, K)
    train_rows = _DeviceRows(dataset, resolved, mesh, shard=True, margin=margin, base_score=None,
                             sample_weight=weights)
    if margin is None:
        zeros = train_rows.put_rows(np.zeros((train_rows.y.shape[0], K), np.float32))
        base_score = np.asarray(starting_value(objective, zeros, train_rows.y_device, train_rows.sample_weight_device))
    else:
        base_score = np.zeros(K, np.float32)
    train_rows.initial_raw_prediction(base_score)
    if leaf_refit is None:
        leaf_refit = resolved.leaf_refit if resolved.leaf_refit is not None else _leaf_refit_needed(resolved, train_rows)

    eval_rows = []
    for entry in eval_set or []:
        X_eval, y_eval = (entry, None) if isinstance(entry, Dataset) else entry
        eval_dataset = _as_dataset(X_eval, y_eval, None, max_bin, None, reference=dataset)
        eval_margin = check_base_margin(eval_dataset.base_margin, eval_dataset.n_rows, K)
        if (eval_margin is None) != (margin is None):
            raise ValueError("eval sets need a base_margin exactly when the training data has one")
        eval_rows.append(_DeviceRows(eval_dataset, resolved, mesh, shard=False, margin=eval_margin,
                                     base_score=base_score))
    metrics = resolve_metrics(eval_metric, resolved)
    if early_stopping_rounds is not None and not eval_rows:
        raise ValueError("early_stopping_rounds needs an eval_set")

    shape = RoundShape(objective=objective, max_depth=int(max_depth), max_bin=dataset.max_bin,
                       leaf_refit=bool(leaf_refit),
                       sample_columns=min(colsample_bytree, colsample_bylevel, colsample_bynode) < 1,
                       sample_rows=subsample < 1, metrics=(metrics,) * len(eval_rows), mesh=mesh)
    boosting_round = compiled_round(shape)
    f32 = jnp.float32
    params = RoundParams(
        growth=GrowthParams(reg=Regularization(f32(reg_lambda), f32(reg_alpha), f32(max_delta_step)),
                            learning_rate=f32(learning_rate), gamma=f32(gamma),
                            min_child_weight=f32(min_child_weight), colsample_bylevel=f32(colsample_bylevel),
                            colsample_bynode=f32(colsample_bynode)),
        subsample=f32(subsample), colsample_bytree=f32(colsample_bytree))
    params = jax.device_put(params, replicated(mesh))
    seed_key = jax.device_put(jax.random.key_data(jax.random.PRNGKey(seed)), replicated(mesh))

    eval_names = [f"validation_{i}" for i in range(len(eval_rows))]
    history = {name: {metric.name: [] for metric in metrics} for name in eval_names}
    watched = metrics[-1] if metrics else None
    best_value, best_iteration = None, None
    raw_prediction = train_rows.raw_prediction
    eval_raw = tuple(rows.raw_prediction for rows in eval_rows)
    round_trees = []
    for round_index in range(num_rounds):
        eval_data = tuple((rows.X_binned_device, rows.y_device, rows.sample_weight_device, raw)
                          for rows, raw in zip(eval_rows, eval_raw))
        raw_prediction, trees, health, eval_raw, metric_values = boosting_round(
            params, train_rows.X_binned_T_device, train_rows.y_device, train_rows.sample_weight_device,
            raw_prediction, seed_key, jnp.int32(round_index), eval_data)
        _raise_if_unhealthy(health, resolved.name, round_index)
        round_trees.append(trees)
        if not eval_rows:
            continue
        values = [np.asarray(v) for v in metric_values]
        for name, set_values in zip(eval_names, values):
            for metric, value in zip(metrics, set_values):
                history[name][metric.name].append(float(value))
        if verbose and (verbose is True or round_index % int(verbose) == 0 or round_index == num_rounds - 1):
            print(f"[{round_index}]\t" + "\t".join(f"{name}-{metric.name}:{history[name][metric.name][-1]:.6f}"
                                                  for name in eval_names for metric in metrics))
        current = float(values[-1][-1])
        improved = best_value is None or (current > best_value if higher_is_better(watched) else current < best_value)
        if improved:
            best_value, best_iteration = current, round_index
        if early_stopping_rounds is not None and round_index - best_iteration >= early_stopping_rounds:
            break

    stacked = jax.tree_util.tree_map(lambda *fields: np.stack([np.asarray(f) for f in fields]), *round_trees) \
        if round_trees else jax.tree_util.tree_map(lambda a: np.zeros((0, K) + a.shape, a.dtype),
                                                   empty_tree(num_heap_nodes(max_depth)))
    return Model(trees=stacked, bin_edges=dataset.bin_edges, base_score=base_score, link=objective.link,
                 loss_name=resolved.name, best_iteration=best_iteration if early_stopping_rounds is not None else None,
                 evals_result=history,
                 params=dict(loss=resolved.name, num_rounds=num_rounds, max_depth=max_depth,
                             learning_rate=learning_rate, reg_lambda=reg_lambda, reg_alpha=reg_alpha, gamma=gamma,
                             min_child_weight=min_child_weight, max_bin=dataset.max_bin, subsample=subsample,
                             colsample_bytree=colsample_bytree, colsample_bylevel=colsample_bylevel,
                             colsample_bynode=colsample_bynode, max_delta_step=max_delta_step,
                             scale_pos_weight=scale_pos_weight, leaf_refit=bool(leaf_refit), seed=seed),
                 feature_names=dataset.feature_names)
