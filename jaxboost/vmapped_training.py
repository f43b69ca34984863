"""Many models in one program: ``jb.train_many``, the boosting round batched over models.

M models that differ in continuous hyperparameters (learning rate, lambda, alpha, gamma,
min_child_weight, sampling rates, loss parameters), in seeds, or in sample weights (e.g.
cross-validation folds as 0/1 weights) share the binned data and the labels, and every round of
all M is one compiled call (``boosting.compiled_many_rounds``: a loop over the models on CPU,
``vmap`` elsewhere), traced once. On a CPU of several cores where the rows train on one device
(small data), the models are split over the cores, each core's device looping over its share
(``devices.many_models_meshes``). The bin edges are built once, from the unweighted data (or
taken from a given ``Dataset``), so model ``k`` equals the model ``jb.train`` grows alone with
the same settings and the same edges (on CPU, with a loss of several outputs, up to the last
bit of leaf values: the round's code is compiled inside the loop there).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .boosting import (HESSIAN_MODES, RoundParams, RoundShape, compiled_many_rounds, histogram_buffer,
                       round_tree_template, seed_key_data, starting_value, stored_many_rounds)
from .dataset import Dataset
from .devices import (float32_jax, kernel_row_ranges, kernel_threads, many_models_meshes, model_split, replicated,
                      replicated_in_place, row_sharding, solve_threads)
from .grower import GrowthParams, prunes_splits, tree_feature_slots
from .host_memory import collection_paused
from .model import Model
from .objective import _check_loss_parameters, resolve_loss, resolve_metrics
from .program_store import ready
from .regularizer import Regularization, check_regularization
from .training import (RoundTrees, _as_dataset, _check_params, _DeviceRows, _leaf_refit_needed, _raise_if_unhealthy,
                       _without_curvature, check_flag, closed_form_starting_value, distinct_labels,
                       found_while_compiling, grows_vector_leaves, interaction_groups, monotone_array,
                       positives_weighted, release_memory_now_and_then, vector_leaves)

# Hyperparameters that may differ between the models, with jb.train's defaults.
BATCHABLE = dict(learning_rate=0.1, reg_lambda=1.0, reg_alpha=0.0, gamma=0.0, min_child_weight=1.0, subsample=1.0,
                 colsample_bytree=1.0, colsample_bylevel=1.0, colsample_bynode=1.0, max_delta_step=0.0)


def _number_of_models(batch: dict, seeds, sample_weights) -> int:
    sizes = {name: len(np.atleast_1d(values)) for name, values in batch.items()}
    if seeds is not None:
        sizes["seeds"] = len(np.atleast_1d(seeds))
    if sample_weights is not None:
        sizes["sample_weights"] = np.asarray(sample_weights).shape[0]
    if not sizes:
        raise ValueError("train_many needs something that differs between models: batch=, seeds= or sample_weights=")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch, seeds and sample_weights must all give the same number of models; got {sizes}")
    return next(iter(sizes.values()))


def many_feature_slots(colsample_bytree: list, n_features: int) -> int | None:
    """The feature slots of the models' trees (``grower.tree_feature_slots``): the most that one
    model's column sample keeps (None when one keeps every feature)."""
    slots = [tree_feature_slots(fraction, n_features) for fraction in colsample_bytree]
    return None if None in slots else max(slots)


@float32_jax
def train_many(data, y=None, *, batch: dict | None = None, seeds=None, sample_weights=None, loss="squared_error",
               loss_params: dict | None = None, num_rounds: int = 100, max_depth: int = 6, max_bin: int = 256,
               scale_pos_weight: float = 1.0, hessian: str = "exact", hessian_floor: float = 1e-3,
               monotone_constraints=None, interaction_constraints=None, multi_strategy: str = "one_output_per_tree",
               multi_output_hessian: str = "full", link=None, num_outputs: int | None = None,
               leaf_refit: bool | None = None, eval_set=None, eval_metric=None, deterministic_histogram: bool = False,
               **settings) -> list[Model]:
    """Train M models in one compiled program and return them as a list of ordinary Models.

    Args:
      data, y: as ``jb.train`` (a Dataset keeps its bin edges; raw ``X`` is binned once
        without weights).
      batch: ``{name: array of M values}`` for any of ``learning_rate, reg_lambda, reg_alpha,
        gamma, min_child_weight, subsample, colsample_bytree, colsample_bylevel,
        colsample_bynode, max_delta_step`` or a loss parameter (e.g. ``"tau"``).
      seeds: M integer seeds (row and column sampling).
      sample_weights: (M, n) per-model row weights (multiplied with the Dataset's weights);
        0/1 weights give cross-validation folds.
      settings: the hyperparameters shared by all models (any name of ``batch``); everything
        else is as ``jb.train``. Early stopping and learning-rate schedules are not supported
        here; eval sets are, with one history per model.
    """
    batch = dict(batch or {})
    M = _number_of_models(batch, seeds, sample_weights)
    unknown = sorted(set(settings) - set(BATCHABLE))
    if unknown:
        raise TypeError(f"train_many got unexpected settings {unknown}; shared hyperparameters are {sorted(BATCHABLE)}")
    if hessian not in HESSIAN_MODES:
        raise ValueError(f"hessian must be one of {HESSIAN_MODES}; got {hessian!r}")
    check_flag("deterministic_histogram", deterministic_histogram)
    dataset = _as_dataset(data, y, None, max_bin, None)
    if dataset.y is None:
        raise ValueError("training needs labels: pass y, or a Dataset built with y")
    loss_names = [name for name in batch if name not in BATCHABLE]
    per_model = []
    for k in range(M):
        values = {name: float(np.atleast_1d(batch[name])[k]) if name in batch else settings.get(name, default)
                  for name, default in BATCHABLE.items()}
        _check_params(num_rounds, max_depth, values["learning_rate"], values["reg_lambda"], values["reg_alpha"],
                      values["gamma"], values["min_child_weight"], values["subsample"], values["colsample_bytree"],
                      values["colsample_bylevel"], values["colsample_bynode"], values["max_delta_step"],
                      scale_pos_weight)
        per_model.append(values)
    model_loss_params = [{**(loss_params or {}), **{name: float(np.atleast_1d(batch[name])[k]) for name in loss_names}}
                         for k in range(M)]
    resolved = resolve_loss(loss, dataset.y, num_outputs, link, model_loss_params[0])
    objective = resolved.objective
    K = objective.num_outputs
    mesh, split = many_models_meshes(dataset.n_rows, dataset.n_features, dataset.max_bin, M,
                                     rows_in_ranges=not grows_vector_leaves(multi_strategy, K))
    # Split over cores, the models run in equal shares: the last is filled up with copies of the
    # first model, whose results are dropped.
    M_run = M if split is None else -(-M // split.devices.shape[0]) * split.devices.shape[0]
    per_model += [per_model[0]] * (M_run - M)
    model_loss_params += [model_loss_params[0]] * (M_run - M)
    for values in model_loss_params[1:]:
        _check_loss_parameters(objective.loss, values, objective.vector_output, K, dataset.y[:1].astype(resolved.label_dtype)[0])
    stacked_loss_params = {name: jnp.asarray([values[name] for values in model_loss_params], jnp.float32)
                           for name in resolved.loss_params}

    weights = positives_weighted(dataset, scale_pos_weight)
    if sample_weights is None:
        model_weights = np.broadcast_to(weights, (M, dataset.n_rows))
    else:
        given = np.asarray(sample_weights, np.float32)
        if given.shape != (M, dataset.n_rows):
            raise ValueError(f"sample_weights must have shape (models, rows) = ({M}, {dataset.n_rows}); got {given.shape}")
        if not np.all(np.isfinite(given)) or np.any(given < 0):
            raise ValueError("sample_weights must be finite and >= 0")
        if np.any(given.sum(axis=1) <= 0):
            raise ValueError("every model needs some positive sample weight")
        model_weights = given * weights
    model_seeds = np.zeros(M, np.int64) if seeds is None else np.asarray(seeds).astype(np.int64)
    model_weights = np.concatenate([model_weights, np.broadcast_to(model_weights[:1], (M_run - M, dataset.n_rows))])
    model_seeds = np.concatenate([model_seeds, np.broadcast_to(model_seeds[:1], (M_run - M,))])

    monotone = monotone_array(monotone_constraints, dataset.feature_names, dataset.n_features)
    groups = interaction_groups(interaction_constraints, dataset.feature_names, dataset.n_features)
    def model_sharding(ndim):
        """Arrays ``(models, rows, ...)``: the rows sharded as the mesh's, or the models split."""
        return row_sharding(mesh, ndim, row_axis=1) if split is None else model_split(split)
    rows = _DeviceRows(dataset, resolved, mesh, margin=None, base_score=None)
    padded = rows.y.shape[0]
    padded_weights = np.ascontiguousarray(rows.pad(model_weights.T.astype(np.float32), 0.0).T)
    weights_device = jax.device_put(padded_weights, model_sharding(2))
    def find_base_scores() -> np.ndarray:  # (M_run, K)
        if resolved.optimal_constant is not None:
            return np.stack([closed_form_starting_value(resolved, rows.y, weights,
                                                        {name: value[model] for name, value in
                                                         stacked_loss_params.items()})
                             for model, weights in enumerate(padded_weights)])
        # On one device, by the sweeps' program (jb.train's custom losses find theirs with their
        # compiled round instead, train_many's round being one program): train's up to the float32
        # rounding of the sums over the rows (a mean of labels near 0: 1e-8 apart on labels of
        # scale 1), bit for bit where the minimiser is a label (a pinball loss's).
        y, weights = distinct_labels(rows.y, padded_weights) or (rows.y, padded_weights)
        zeros, y_one, weights_one = jax.device_put([np.zeros((y.shape[0], K), np.float32), y, weights],
                                                   mesh.devices.flat[0])
        no_curvature = _without_curvature(resolved, rows)
        return np.asarray(jax.vmap(lambda w, params: starting_value(objective, zeros, y_one, w, params,
                                                                   no_curvature))(weights_one, stacked_loss_params))

    base_scores = None  # found below, while the rounds compile
    if leaf_refit is None and resolved.leaf_refit is None:
        # A custom loss: whether leaves are refit depends on its Hessians at the start.
        with collection_paused():
            base_scores = find_base_scores()
        rows.initial_raw_prediction(base_scores[0])
        resolved_first = resolved._replace(loss_params={name: v[0] for name, v in stacked_loss_params.items()})
        leaf_refit = _leaf_refit_needed(resolved_first, rows)
    elif leaf_refit is None:
        leaf_refit = resolved.leaf_refit

    eval_rows = []
    for entry in eval_set or []:
        X_eval, y_eval = (entry, None) if isinstance(entry, Dataset) else entry
        eval_rows.append(_DeviceRows(_as_dataset(X_eval, y_eval, None, max_bin, None, reference=dataset), resolved,
                                     mesh, margin=None, base_score=None, evaluation=True))
    metrics = resolve_metrics(eval_metric, resolved, [rows.y.shape for rows in eval_rows])

    regularizers = []
    for values in per_model:
        reg = Regularization(np.float32(values["reg_lambda"]), np.float32(values["reg_alpha"]),
                             np.float32(values["max_delta_step"]), np.float32(0.0))
        check_regularization(reg, dataset.n_features)
        leaves = vector_leaves(multi_strategy, multi_output_hessian, K, reg, monotone)
        regularizers.append(reg)
    if leaves is not None:
        # Split over the cores, a model's solve keeps to its own core.
        leaves = dataclasses.replace(leaves, solve_threads=solve_threads(mesh) if split is None else 1)
    # Models stacked into one program share its static fields: the scores' form is fixed only
    # when every model's max_delta_step is on the same side of 0.
    bounded = {float(values["max_delta_step"]) > 0 for values in per_model}
    if len(bounded) == 1:
        (bounds_leaves,) = bounded
        regularizers = [reg.replace(bounds_leaves=bounds_leaves) for reg in regularizers]
    f32 = np.float32

    def model_params(k):
        values = per_model[k]
        return RoundParams(
            growth=GrowthParams(reg=regularizers[k], learning_rate=f32(values["learning_rate"]),
                                gamma=f32(values["gamma"]), min_child_weight=f32(values["min_child_weight"]),
                                colsample_bylevel=f32(values["colsample_bylevel"]),
                                colsample_bynode=f32(values["colsample_bynode"]),
                                monotone=None if monotone is None else monotone,
                                interaction_groups=None if groups is None else groups),
            subsample=f32(values["subsample"]), colsample_bytree=f32(values["colsample_bytree"]),
            loss_params={name: stacked_loss_params[name][k] for name in stacked_loss_params},
            hessian_floor=f32(hessian_floor))

    every_model = [model_params(k) for k in range(M_run)]

    def stack_if_different(*leaves):
        values = [np.asarray(leaf) for leaf in leaves]
        return np.stack(values) if any(not np.array_equal(v, values[0]) for v in values) else values[0]

    params = jax.tree_util.tree_map(stack_if_different, *every_model)
    # Hashable description of which parameters differ between models (the vmap axes).
    shared_leaves, treedef = jax.tree_util.tree_flatten(every_model[0])
    params_axes = (treedef, tuple(0 if np.ndim(leaf) > np.ndim(shared) else None
                                  for shared, leaf in zip(shared_leaves, jax.tree_util.tree_leaves(params))))
    seed_keys = np.stack([seed_key_data(s) for s in model_seeds])
    if split is None:
        params, seed_keys = jax.device_put((params, seed_keys), replicated(mesh))
    else:
        params = jax.device_put(params, jax.tree_util.tree_unflatten(
            params_axes[0], [model_split(split) if axis == 0 else replicated(split) for axis in params_axes[1]]))
        seed_keys = jax.device_put(seed_keys, model_split(split))
    sampled = [min(v["colsample_bytree"], v["colsample_bylevel"], v["colsample_bynode"]) for v in per_model]
    shape = RoundShape(objective=objective, max_depth=int(max_depth), max_bin=dataset.max_bin,
                       leaf_refit=bool(leaf_refit), sample_columns=min(sampled) < 1,
                       sample_rows=min(v["subsample"] for v in per_model) < 1, metrics=(metrics,) * len(eval_rows),
                       mesh=mesh, hessian_mode=hessian, vector_leaves=leaves,
                       missing_values=dataset.has_missing_values, shared_codes=rows.shared_codes,
                       kernel_threads=kernel_threads(mesh, dataset.n_features, dataset.max_bin),
                       kernel_row_ranges=kernel_row_ranges(mesh, dataset.n_features, dataset.max_bin,
                                                           leaves is not None),
                       sample_level_columns=min(min(v["colsample_bylevel"], v["colsample_bynode"])
                                                for v in per_model) < 1,
                       feature_slots=many_feature_slots([v["colsample_bytree"] for v in per_model], dataset.n_features),
                       deterministic_histogram=bool(deterministic_histogram),
                       prune_splits=any(prunes_splits(v["gamma"]) for v in per_model))
    # The data every model reads, on each of the split's devices (small data: a copy each).
    shared = (lambda array: array) if split is None else partial(jax.device_put, device=replicated(split))
    row_offsets, y_device = shared(rows.row_offsets_device), shared(rows.y_device)
    # The Dataset's code table, which the native kernels read in place, is placed the same way.
    X_binned_T = (replicated_in_place(dataset.X_binned_T, split) if split is not None and rows.shared_codes
                  else shared(rows.X_binned_T_device))
    row_index = shared(rows.row_index_device) if shape.sample_rows else None
    eval_inputs = [tuple(shared(a) for a in (r.X_binned_device, r.y_device, r.sample_weight_device))
                   for r in eval_rows]
    histograms = histogram_buffer(shape, dataset.n_features, models=M_run, models_mesh=split)

    def raw_prediction_shape(n_rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((M_run, n_rows, K), np.float32, sharding=model_sharding(3))

    def round_arguments(raw_prediction, eval_raw, round_index, histograms) -> tuple:
        eval_data = tuple(inputs + (raw,) for inputs, raw in zip(eval_inputs, eval_raw))
        return (params, X_binned_T, row_offsets, y_device, weights_device, row_index, raw_prediction, seed_keys,
                np.int32(round_index), eval_data, histograms)

    arguments = round_arguments(raw_prediction_shape(padded), [raw_prediction_shape(r.y.shape[0])
                                                               for r in eval_rows], 0, histograms)
    boosting_rounds = (stored_many_rounds(shape, params_axes, split, arguments)
                       or compiled_many_rounds(shape, params_axes, split))
    if base_scores is None:
        base_scores = found_while_compiling(boosting_rounds if num_rounds else None, arguments, find_base_scores)
    boosting_rounds = ready(boosting_rounds) if num_rounds else None
    raw_prediction = jax.device_put(np.ascontiguousarray(np.broadcast_to(base_scores[:, None, :], (M_run, padded, K))),
                                    model_sharding(3))
    eval_raw = tuple(jax.device_put(np.broadcast_to(base_scores[:, None, :], (M_run, r.y.shape[0], K)).copy(),
                                    model_sharding(3))
                     for r in eval_rows)

    history = [[] for _ in eval_rows]
    round_trees = RoundTrees(mesh, round_tree_template(shape), models=M_run)
    for round_index in range(num_rounds):
        with collection_paused(round_index == 0):  # the rounds compile in their first call
            raw_prediction, trees, health, eval_raw, metric_values, histograms = boosting_rounds(
                *round_arguments(raw_prediction, eval_raw, round_index, histograms))
        _raise_if_unhealthy(health, resolved.name, round_index)
        round_trees.append(trees)
        release_memory_now_and_then(round_index, dataset.n_rows)
        for per_set, values in zip(history, metric_values):
            per_set.append(np.asarray(values))  # (M, metrics)

    all_trees = round_trees.stacked()
    models = []
    for k in range(M):
        evals_result = {f"validation_{i}": {metric.name: [float(v[k, j]) for v in per_set]
                                            for j, metric in enumerate(metrics)}
                        for i, per_set in enumerate(history)}
        values = per_model[k]
        models.append(Model(
            trees=jax.tree_util.tree_map(lambda a: np.ascontiguousarray(a[:, k]), all_trees),
            bin_edges=dataset.bin_edges, base_score=base_scores[k].astype(np.float32), link=objective.link,
            loss_name=resolved.name, evals_result=evals_result,
            params=dict(loss=resolved.name, num_rounds=num_rounds, max_depth=max_depth, max_bin=dataset.max_bin,
                        scale_pos_weight=scale_pos_weight, leaf_refit=bool(leaf_refit), hessian=hessian,
                        deterministic_histogram=bool(deterministic_histogram),
                        seed=int(model_seeds[k]), loss_params=model_loss_params[k], multi_strategy=multi_strategy,
                        multi_output_hessian=None if leaves is None else multi_output_hessian, **values),
            feature_names=dataset.feature_names))
    return models
