"""Boosting round: raw predictions -> g, h by autodiff -> one tree per output -> new raw predictions.

One jitted call per round, traced once per shape: every numeric hyperparameter is a traced
value, and only shapes and structure (depth, bins, outputs, the loss function, the eval sets'
layout) are static. Rows are sharded over the devices of a 1-D mesh with ``shard_map``; the
histograms and every other sum over rows are completed with ``psum`` inside the grower.
Eval-set predictions and metrics are updated on device in the same call, so nothing but a few
scalars (metric values and health flags) comes back to the host per round.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .derivatives import output_gradient, values_gradients_and_hessians
from .devices import ROW_AXIS, all_sum
from .grower import GrowthParams, grow_tree, sample_features
from .line_search import minimise_segment_offsets
from .predictor import predict_round
from .regularizer import Regularization, clip_leaf_value
from .tree import num_heap_nodes

# Hessians below this are reported as negative rather than taken as rounding noise.
NEGATIVE_HESSIAN_TOLERANCE = 1e-6


class RoundParams(NamedTuple):
    """Traced hyperparameters of a round."""

    growth: GrowthParams
    subsample: jax.Array
    colsample_bytree: jax.Array
    loss_params: dict = {}  # keyword arguments of the loss (a pytree of arrays)
    hessian_floor: jax.Array = 0.0  # hessian="floor": Hessians below this are raised to it


class Objective(NamedTuple):
    """The static description of what is fitted (hashable: it keys the compilation cache)."""

    loss: Callable  # loss(raw_prediction, y, **loss_params) -> scalar, one example
    vector_output: bool  # raw_prediction is a length-K vector (else a scalar)
    num_outputs: int
    link: Callable


def bind_loss(objective: Objective, loss_params: dict | None) -> Callable:
    """``loss(raw_prediction, y)`` with the (traced) loss parameters bound."""
    if not loss_params:
        return objective.loss
    return lambda raw_prediction, y: objective.loss(raw_prediction, y, **loss_params)


# How the per-row Hessian used for splits and Newton leaf values is formed (``hessian=``):
# "exact" autodiff's, "floor" raised to at least ``hessian_floor``, "constant" 1 (first-order
# boosting). In every mode a zero Hessian falls back to the row's weight, and ``leaf_refit``
# can set leaves by exact minimisation of the true loss afterwards.
HESSIAN_MODES = ("exact", "floor", "constant")


class RoundShape(NamedTuple):
    """Static structure of a round."""

    objective: Objective
    max_depth: int
    max_bin: int
    leaf_refit: bool
    sample_columns: bool  # any colsample_* below 1 (else sampling is left out of the program)
    sample_rows: bool  # subsample below 1
    metrics: tuple  # per eval set metric functions: metric(y, raw_prediction, weight, loss_params) -> scalar
    mesh: Mesh
    hessian_mode: str = "exact"


class RoundHealth(NamedTuple):
    """Counts of rows whose loss value or derivatives a custom loss got wrong this round."""

    non_finite: jax.Array
    negative_hessian: jax.Array


def loss_derivatives(objective: Objective, raw_prediction: jax.Array, y: jax.Array, loss_params: dict | None = None):
    """Loss values ``(n,)`` and ``(g, h)`` as ``(n, K)`` arrays, whether the loss takes a scalar
    or a vector."""
    loss = bind_loss(objective, loss_params)
    if objective.vector_output:
        return values_gradients_and_hessians(loss, raw_prediction, y)
    values, g, h = values_gradients_and_hessians(loss, raw_prediction[:, 0], y)
    return values, g[:, None], h[:, None]


def minimise_offsets(objective: Objective, raw_prediction: jax.Array, y: jax.Array, weights: jax.Array,
                     segment_ids: jax.Array, num_segments: int, output, reg: Regularization,
                     axis_name: str | None = None, loss_params: dict | None = None) -> jax.Array:
    """Per-segment offsets of output ``output`` minimising the weighted loss plus penalty."""
    selector = jax.nn.one_hot(output, objective.num_outputs, dtype=raw_prediction.dtype)
    loss = bind_loss(objective, loss_params)

    def weighted_derivative(offset_per_row):
        shifted = raw_prediction + offset_per_row[:, None] * selector
        if objective.vector_output:
            derivative = output_gradient(loss, shifted, y, None) @ selector
        else:
            derivative = output_gradient(loss, shifted[:, 0], y, None)
        return jnp.where(weights > 0, weights * derivative, 0.0)

    segment_weights = all_sum(jax.ops.segment_sum(weights, segment_ids, num_segments), axis_name)
    return minimise_segment_offsets(weighted_derivative, segment_ids, num_segments, segment_weights, reg, axis_name)


# Coordinate sweeps for multi-output starting values: outputs interact (softmax), so one
# exact 1-D minimisation per output is repeated until a sweep moves no output by more than this.
SWEEP_TOLERANCE = 1e-5
MAX_SWEEPS = 50


@partial(jax.jit, static_argnames="objective")
def starting_value(objective: Objective, raw_prediction: jax.Array, y: jax.Array, weights: jax.Array,
                   loss_params: dict | None = None) -> jax.Array:
    """The constant per output minimising the weighted loss (coordinate descent over outputs,
    each step an exact 1-D minimisation)."""
    no_penalty = Regularization(jnp.float32(0), jnp.float32(0), jnp.float32(0))
    segment_ids = jnp.zeros(y.shape[0], jnp.int32)

    def solve_output(output, constant):
        offset = minimise_offsets(objective, raw_prediction + constant, y, weights, segment_ids, 1, output,
                                  no_penalty, loss_params=loss_params)
        return constant.at[output].add(offset[0])

    def sweep(state):
        constant, _, sweeps = state
        updated = jax.lax.fori_loop(0, objective.num_outputs, solve_output, constant)
        return updated, jnp.max(jnp.abs(updated - constant)), sweeps + 1

    def unsettled(state):
        _, change, sweeps = state
        return (change > SWEEP_TOLERANCE) & (sweeps < (1 if objective.num_outputs == 1 else MAX_SWEEPS))

    start = jnp.zeros(objective.num_outputs, raw_prediction.dtype)
    constant, _, _ = jax.lax.while_loop(unsettled, sweep, (start, jnp.float32(jnp.inf), 0))
    return constant


def _grow_round_trees(shape: RoundShape, params: RoundParams, X_binned_T, y, row_weight, raw_prediction,
                      feature_allowed, tree_key):
    """Row-local body of a round (inside ``shard_map``): derivatives, K trees, refits, update."""
    objective = shape.objective
    values, g, h = loss_derivatives(objective, raw_prediction, y, params.loss_params)
    counted = (row_weight > 0)[:, None]
    finite = jnp.isfinite(values)[:, None] & jnp.isfinite(g) & jnp.isfinite(h)
    gradients = jnp.where(counted, g * row_weight[:, None], 0.0)
    if shape.hessian_mode == "floor":
        h = jnp.maximum(h, params.hessian_floor)
    elif shape.hessian_mode == "constant":
        h = jnp.ones_like(h)
    health = RoundHealth(
        non_finite=all_sum(jnp.sum(counted & ~finite), ROW_AXIS),
        negative_hessian=all_sum(jnp.sum(counted & (h < -NEGATIVE_HESSIAN_TOLERANCE)), ROW_AXIS),
    )
    # A zero Hessian (absolute error, quantile, hinge, Huber's tails) would make every node
    # weightless: the split search uses the row's sample weight instead, as XGBoost does for
    # absolute error. Leaf values then come from the exact refit below.
    split_hessians = jnp.where(counted, jnp.where(h > 0, h, 1.0) * row_weight[:, None], 0.0)
    num_nodes = num_heap_nodes(shape.max_depth)

    def one_output(output):
        tree, row_leaf, (lower, upper) = grow_tree(
            X_binned_T, gradients[:, output], split_hessians[:, output], feature_allowed,
            jax.random.fold_in(tree_key, output), params.growth, shape.max_depth, shape.max_bin, ROW_AXIS,
            shape.sample_columns)
        if shape.leaf_refit:
            offsets = minimise_offsets(objective, raw_prediction, y, row_weight, row_leaf, num_nodes, output,
                                       params.growth.reg, ROW_AXIS, params.loss_params)
            refit = params.growth.learning_rate * clip_leaf_value(offsets, params.growth.reg, lower, upper)
            tree = tree._replace(value=jnp.where(tree.is_leaf, refit, tree.value))
        return tree, row_leaf

    trees, row_leaves = jax.lax.map(one_output, jnp.arange(objective.num_outputs))
    contribution = jnp.take_along_axis(trees.value, row_leaves, axis=1).T
    return raw_prediction + contribution, trees, health


def round_function(shape: RoundShape) -> Callable:
    """The (unjitted) boosting round for one static shape."""
    rows = PartitionSpec(ROW_AXIS)
    grow = jax.shard_map(
        partial(_grow_round_trees, shape),
        mesh=shape.mesh,
        in_specs=(PartitionSpec(), PartitionSpec(None, ROW_AXIS), rows, rows, PartitionSpec(ROW_AXIS, None),
                  PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(ROW_AXIS, None), PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )

    def boosting_round(params: RoundParams, X_binned_T, y, sample_weight, raw_prediction, seed_key, round_index,
                       eval_sets):
        round_key = jax.random.fold_in(seed_key, round_index)
        row_key, column_key, tree_key = jax.random.split(round_key, 3)
        row_weight = sample_weight
        if shape.sample_rows:
            in_sample = jax.random.uniform(row_key, sample_weight.shape) < params.subsample
            row_weight = jnp.where(in_sample, sample_weight, 0.0)
        feature_allowed = jnp.ones(X_binned_T.shape[0], bool)
        if shape.sample_columns:
            feature_allowed = sample_features(column_key, feature_allowed, params.colsample_bytree)
        raw_prediction, trees, health = grow(params, X_binned_T, y, row_weight, raw_prediction, feature_allowed,
                                             tree_key)

        eval_raw_predictions, metric_values = [], []
        for (X_binned, y_eval, weight_eval, raw_eval), metrics in zip(eval_sets, shape.metrics):
            raw_eval = raw_eval + predict_round(trees, X_binned, shape.max_bin - 1)
            eval_raw_predictions.append(raw_eval)
            metric_values.append(jnp.stack([metric(y_eval, raw_eval, weight_eval, params.loss_params)
                                            for metric in metrics]))
        return raw_prediction, trees, health, tuple(eval_raw_predictions), tuple(metric_values)

    return boosting_round


@lru_cache(maxsize=64)
def compiled_round(shape: RoundShape):
    """The jitted round for one static shape (cached, so a new training run reuses it)."""
    return jax.jit(round_function(shape), donate_argnums=(4,))


@lru_cache(maxsize=16)
def compiled_many_rounds(shape: RoundShape, params_axes: tuple):
    """One round of M models at once: ``vmap`` over their sample weights, raw predictions,
    seeds, eval raw predictions and the parameters marked 0 in ``params_axes`` (``(treedef,
    axes)`` of the RoundParams leaves, 0 or None: parameters shared by all models stay
    unbatched, so e.g. a shared ``max_delta_step`` keeps its cheap branch); the binned data and
    labels are shared."""
    treedef, leaf_axes = params_axes
    params_axes = jax.tree_util.tree_unflatten(treedef, leaf_axes)
    eval_axes = tuple((None, None, None, 0) for _ in shape.metrics)
    batched = jax.vmap(round_function(shape), in_axes=(params_axes, None, None, 0, 0, 0, None, eval_axes))
    return jax.jit(batched, donate_argnums=(4,))
