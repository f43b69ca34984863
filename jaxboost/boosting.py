"""Boosting round: raw predictions -> g, h by autodiff -> one tree per output -> new raw predictions.

With vector leaves (``multi_strategy="multi_output_tree"``) the round grows one tree for all K
outputs from the gradients and full per-row Hessians, and hands it on as K trees that share
their splits (one per output, holding that output's leaf values), so prediction, model files,
exports and SHAP treat it like any other model.

A round is compiled whole, traced once per shape: every numeric hyperparameter is a traced
value, and only shapes and structure (depth, bins, outputs, the loss function, the eval sets'
layout) are static. It runs as two programs (``SplitRound``): the loss's derivatives, and the
trees grown from them with the eval sets' predictions and metrics, which read no loss (one
program serves every loss of the same shapes, so a new loss compiles its derivatives alone),
a third for eval metrics that are the loss itself, and with a leaf refit, which reads the loss
between a tree's splits and its leaf values, a program for the refit. In ``train_many`` it is
one program (``round_function``). Rows are sharded over the devices of a 1-D mesh with
``shard_map``; the histograms and every other sum over rows are completed with ``psum`` inside
the grower.
Eval-set predictions and metrics are updated on device, so nothing but a few scalars (metric
values and health flags) comes back to the host per round.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .derivatives import output_gradient, values_gradients_and_hessian_matrices, values_gradients_and_hessians
from .devices import (MODEL_AXIS, ROW_AXIS, all_sum, compiler_options, mesh_platform, model_split, replicated,
                      row_sharding)
from .grower import GrowthParams, RowLeaves, empty_tree, grow_tree, histogram_buffer_shape, sample_features
from .histogram import paired_width
from .line_search import SLOPE_ROUNDING, minimise_segment_offsets, segment_sums
from .native import lowering_for, uninitialized
from .predictor import add_position_values, leaf_index, predict_round
from .program_store import ready, serializable_record, store_folder, stored_program
from .regularizer import Regularization, VectorLeaves, clip_leaf_value
from .sampling import derived_keys, uniform_of_counters
from .sums import row_sum, row_sums
from .tree import Tree, num_heap_nodes, pack_fields, unpack_fields

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
    vector_leaves: VectorLeaves | None = None  # one tree with vector leaves per round (else one per output)
    missing_values: bool = True  # some training row has a missing value (else the scan skips that direction)
    # The devices share one code table, each reading it from its row offset (else each holds its rows).
    shared_codes: bool = False
    kernel_threads: int = 1  # threads of the CPU histogram kernel (devices.kernel_threads)
    kernel_row_ranges: int = 1  # ranges of rows the CPU kernels sum apart (devices.kernel_row_ranges)
    # colsample_bylevel or colsample_bynode below 1: the grower samples every level's and node's
    # features (else a tree's sample is every level's: the per-level draws, 0.3-0.5 ms of a
    # 2.5 ms round at 40k rows when they sorted, are left out of the program).
    sample_level_columns: bool = True
    # A tree's column sample keeps at most this many features (``grower.tree_feature_slots``):
    # its histograms hold that many feature slots. None: every feature.
    feature_slots: int | None = None
    # Accelerators sum histograms (and leaf refits) as fixed-point integers: runs repeat bit for bit.
    deterministic_histogram: bool = False
    # Some model's gamma can prune a split (``grower.prunes_splits``; else pruning is left out).
    prune_splits: bool = True
    # A custom loss whose leaf refit is still to be decided: the derivatives' program also tells
    # whether some row of positive weight has an exactly zero Hessian (``RoundHealth.zero_hessian``).
    counts_zero_hessians: bool = False


class RoundHealth(NamedTuple):
    """Whether a custom loss got some counted row's value or derivatives wrong this round (read
    off the sums of the rows' marked gradients and split Hessians: ``_round_health``)."""

    non_finite: jax.Array  # bool: a loss value, gradient or Hessian that is not finite
    negative_hessian: jax.Array  # bool: a Hessian below -NEGATIVE_HESSIAN_TOLERANCE
    # bool: some row of positive sample weight, in the row sample or not, has a Hessian entry
    # exactly zero (looked for where ``RoundShape.counts_zero_hessians``, else False).
    zero_hessian: jax.Array


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
                     axis_name: str | None = None, loss_params: dict | None = None,
                     deterministic: bool = False) -> jax.Array:
    """Per-segment offsets of output ``output`` minimising the weighted loss plus penalty
    (``deterministic``: sums that do not depend on a GPU's order of adds, ``segment_sums``)."""
    selector = jax.nn.one_hot(output, objective.num_outputs, dtype=raw_prediction.dtype)
    loss = bind_loss(objective, loss_params)

    def weighted_derivative(offset_per_row):
        shifted = raw_prediction + offset_per_row[:, None] * selector
        if objective.vector_output:
            derivative = jnp.sum(output_gradient(loss, shifted, y, None) * selector, axis=-1)
        else:
            derivative = output_gradient(loss, shifted[:, 0], y, None)
        return jnp.where(weights > 0, weights * derivative, 0.0)

    segment_weights = all_sum(segment_sums(weights, segment_ids, num_segments, deterministic), axis_name)
    return minimise_segment_offsets(weighted_derivative, segment_ids, num_segments, segment_weights, reg, axis_name,
                                    deterministic)


# Coordinate sweeps for multi-output starting values: outputs interact (softmax), so one
# exact 1-D minimisation per output is repeated until a sweep moves no output by more than this.
SWEEP_TOLERANCE = 1e-5
MAX_SWEEPS = 50

# Newton steps on the whole vector of outputs come first. A smooth loss (softmax, a Gaussian's
# mean and log scale) is solved in a few passes over the rows each; the sweeps alone took 7
# sweeps x K outputs x about 30 passes (3.6 s for 10 classes on 200k rows). Where the steps
# stop short (zero curvature: pinball or absolute error per output) the sweeps go on from there.
MAX_NEWTON_STEPS = 50
MAX_STEP_HALVINGS = 30
# Sufficient decrease of a step (Armijo): this fraction of the decrease its slope promises...
SUFFICIENT_DECREASE = 1e-4
# ... unless the promised decrease is below this fraction of the summed loss, which float32
# sums do not resolve (the decrease of a step near the minimiser came out as +0.002 of 7e4).
LOSS_RESOLUTION = 1e-5
# The steps have converged when a full step moves no output by more than this (times
# ``max(1, |c|)``): Newton's steps shrink quadratically, so the last one lands at float32
# resolution.
STEP_TOLERANCE = 1e-6
# ... and the point is stationary: every output's weighted gradient sum is at most this fraction
# of the weighted sum of its gradients' magnitudes (free of the loss's scale and the rows'
# count). Loose, far above float32 rounding of the sums: it only tells a minimiser from a point
# where the steps cannot go on, a direction without curvature whose slope is not zero.
STATIONARY_TOLERANCE = 1e-4
# Curvature below this fraction of the largest is taken as none and not stepped along: the
# shift of every output together under softmax, or a piecewise-linear loss.
MIN_RELATIVE_CURVATURE = 1e-6


def resolved_gradient(point: jax.Array, gross_gradient: jax.Array, hessian: jax.Array) -> jax.Array:
    """Per output, the size below which a weighted gradient sum at the float32 raw prediction
    ``point (K,)`` is not resolved: its terms' rounding (``SLOPE_ROUNDING`` of ``gross_gradient``,
    the sum of their magnitudes) and the change that moving the point by a float32 step (at
    most ``eps |point|``) makes through ``hessian (K, K)``."""
    step = float(np.finfo(np.float32).eps) * jnp.abs(point)
    return SLOPE_ROUNDING * gross_gradient + jnp.sum(jnp.abs(hessian) * step[None, :], axis=1)


def starting_value(objective: Objective, raw_prediction: jax.Array, y: jax.Array, weights: jax.Array,
                   loss_params: dict | None = None, hessian_vanishes: bool = False) -> jax.Array:
    """The constant per output minimising the weighted loss; compiled for the default backend.

    One output: one exact 1-D minimisation. Several: Newton steps on the whole vector, then,
    unless they end at a stationary point, coordinate sweeps of exact 1-D minimisations (a
    program of their own, compiled only for a loss that needs them). ``hessian_vanishes``: the
    loss's Hessian is zero at every raw prediction (``derivatives.hessian_vanishes``), so the
    sweeps go alone: Newton steps without curvature stop where they start, and their program
    had been the largest compile of such a loss's first fit."""
    platform = jax.default_backend()
    # A host array: jnp.zeros would compile two small programs of its own in a first fit (15-25 ms).
    start = np.zeros(objective.num_outputs, raw_prediction.dtype)

    def run(method: str, *arguments):
        return _starting_value_program(platform, method, objective, arguments)(*arguments)

    if objective.num_outputs == 1 or hessian_vanishes:
        return run("sweeps", raw_prediction, y, weights, loss_params, start)
    constant, converged = run("newton", raw_prediction, y, weights, loss_params)
    if isinstance(converged, jax.core.Tracer):
        # Traced (train_many vmaps this over its models): each model takes its own result.
        return jnp.where(converged, constant, run("sweeps", raw_prediction, y, weights, loss_params, constant))
    if bool(converged):
        return constant
    return run("sweeps", raw_prediction, y, weights, loss_params, constant)


# A starting value over this many rows at most (a loss's distinct labels and their summed
# weights: ``training.distinct_labels``) is compiled for a quick compile rather than a quick run.
STARTING_VALUE_FEW_ROWS = 256


@lru_cache(maxsize=None)
def _compiled_starting_value(platform: str, method: str, few_rows: bool):
    return jax.jit(_STARTING_VALUE_METHODS[method], static_argnames="objective",
                   compiler_options=compiler_options(platform, few_rows))


def _starting_value_program(platform: str, method: str, objective: Objective, arguments: tuple) -> Callable:
    """``starting_value``'s program ``method`` for ``objective``, called on ``arguments``:
    through the program store where it can hold it, else jitted here."""
    few_rows = arguments[0].shape[-2] <= STARTING_VALUE_FEW_ROWS
    options = dict(compiler_options=compiler_options(platform, few_rows))
    stored = stored_program(f"starting_value_{method}", lambda: partial(_STARTING_VALUE_METHODS[method], objective),
                            (objective, method), arguments, platform, options)
    if stored is None:
        return partial(_compiled_starting_value(platform, method, few_rows), objective)
    return ready(stored)


def _coordinate_sweeps(objective: Objective, raw_prediction: jax.Array, y: jax.Array, weights: jax.Array,
                       loss_params: dict | None, start: jax.Array) -> jax.Array:
    """Sweeps over the outputs from ``start``, each output set by an exact 1-D minimisation given
    the others, until a sweep moves none by more than ``SWEEP_TOLERANCE`` (one output: one
    minimisation, no loop)."""
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
        return (change > SWEEP_TOLERANCE) & (sweeps < MAX_SWEEPS)

    if objective.num_outputs == 1:
        return solve_output(0, start)
    return jax.lax.while_loop(unsettled, sweep, (start, jnp.float32(jnp.inf), 0))[0]


def newton_constant(objective: Objective, raw_prediction: jax.Array, y: jax.Array, weights: jax.Array,
                    loss_params: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """Newton steps from 0 on the K-vector ``c`` minimising ``sum_i w_i l(y_i, F_i + c)``.

    The gradient and the K x K Hessian come from autodiff (one Hessian-vector product per
    output, each one pass over the rows). Each step goes along the Hessian's eigen-directions,
    each scaled by the magnitude of its curvature (directions of almost none are left out), and
    is halved until the loss falls enough: summed as per-row differences, which float32 resolves
    near the minimiser where two totals would not, or, below that resolution, until the slope
    along the step has halved. Rows of zero weight are left out.

    Returns:
      ``(c, converged)``: the last ``c``, and whether the steps converged to a stationary point
      (they stop short where no step lowers the loss, as along a direction of zero curvature).
    """
    loss = bind_loss(objective, loss_params)
    counted = weights > 0

    def weighted(per_row):
        w = weights.reshape(weights.shape + (1,) * (per_row.ndim - 1))
        return jnp.where(counted.reshape(w.shape), w * per_row, 0.0)

    def weighted_sum(per_row):
        return row_sum(weighted(per_row))

    # The rows stay the first axis here (``derivatives.over_rows`` makes them the last for the
    # derivatives, which take them in chunks): every pass runs over all the rows, and in that
    # layout XLA stored a softmax's exponentials and more (K, n) values for each, which took the
    # program's peak memory from 500 to 580 MB at 1M rows and 10 classes (its optimised IR 614
    # -> 440 KB, its compile 1.2 -> 1.0 s of CPU).
    def row_losses(constant):
        return jax.vmap(loss)(raw_prediction + constant, y)

    def row_gradients(constant):
        return output_gradient(loss, raw_prediction + constant, y, None)

    def newton_step(state):
        constant, _, _, steps = state

        def derivatives_along(basis):
            # One Hessian column per output, in turn (n x K values at a time rather than
            # n x K x K); the gradient's sums come with each, from the same pass.
            gradients, column = jax.jvp(row_gradients, (constant,), (basis,))
            return row_sums(weighted(gradients), weighted(jnp.abs(gradients)), weighted(column))

        total_gradients, gross_gradients, hessian = jax.lax.map(
            derivatives_along, jnp.eye(objective.num_outputs, dtype=constant.dtype))
        total_gradient, gross_gradient = total_gradients[0], gross_gradients[0]
        stationary = jnp.all(jnp.abs(total_gradient) <= STATIONARY_TOLERANCE * gross_gradient)
        # Gradients within what float32 resolves (``resolved_gradient``) end the steps, their
        # last taken as it is: a Gaussian's mean, whose gradient's rounding was a Newton step of
        # 5e-5 where its scale was 260, never took one below ``STEP_TOLERANCE``, and the sweeps'
        # program was compiled and run after the steps had found the minimiser.
        point = raw_prediction[0] + constant
        resolved = jnp.all(jnp.abs(total_gradient) <= resolved_gradient(point, gross_gradient, hessian))
        curvatures, directions = jnp.linalg.eigh(0.5 * (hessian + hessian.T))
        # Negative curvature (a Gaussian's mean far from the labels, from a unit scale) is
        # stepped along by its magnitude, so every step goes down.
        curvatures = jnp.abs(curvatures)
        usable = curvatures > MIN_RELATIVE_CURVATURE * jnp.max(curvatures)
        # K x K products as sums of element-wise ones: full float32 (a GPU's matrix products
        # default to TF32), and no code of their own to compile on CPU (as products, one was an
        # LLVM module of 34-44 ms).
        along = jnp.sum(directions * total_gradient[:, None], axis=0)
        direction = -jnp.sum(directions * jnp.where(usable, along / jnp.where(usable, curvatures, 1.0), 0.0), axis=1)
        slope = jnp.sum(total_gradient * direction)  # <= 0
        losses_before = row_losses(constant)
        loss_scale = weighted_sum(jnp.abs(losses_before))

        def sufficient(length):
            # False for a NaN loss or step: the steps stop and the sweeps take over.
            losses, slopes = jax.jvp(lambda t: row_losses(constant + t * direction), (length,), (jnp.float32(1),))
            decrease = weighted_sum(losses - losses_before)
            # Near the minimiser float32 cannot resolve the decrease any more, but the slope
            # along the step still shows whether it went most of the way to the line's minimum.
            unresolved = length * jnp.abs(slope) <= LOSS_RESOLUTION * loss_scale
            flatter = jnp.abs(weighted_sum(slopes)) <= 0.5 * jnp.abs(slope)
            return (decrease <= SUFFICIENT_DECREASE * length * slope) | (unresolved & flatter)

        def try_shorter(search):
            length, _, tries = search
            # The loop starts from twice the full step, so that its first try is the full step
            # and sufficient() is traced and compiled once, not twice (the program's compile
            # 0.42 -> 0.38 s with 10 classes).
            length = 0.5 * length
            return length, sufficient(length), tries + 1

        def too_long(search):
            _, accepted, tries = search
            return ~accepted & (tries <= MAX_STEP_HALVINGS)

        # A full step this small is taken as it is: the loss cannot resolve its decrease.
        small = jnp.all(jnp.abs(direction) <= STEP_TOLERANCE * jnp.maximum(1.0, jnp.abs(constant))) | resolved
        length, accepted, _ = jax.lax.while_loop(too_long, try_shorter,
                                                 (jnp.where(small, jnp.float32(1), jnp.float32(2)), small, 0))
        converged = small & (stationary | resolved)
        # A small step at a point that is not stationary: no curvature to go on.
        stalled = ~accepted | (small & ~stationary)
        return jnp.where(accepted, constant + length * direction, constant), converged, stalled, steps + 1

    def unfinished(state):
        _, converged, stalled, steps = state
        return ~converged & ~stalled & (steps < MAX_NEWTON_STEPS)

    start = jnp.zeros(objective.num_outputs, raw_prediction.dtype)
    constant, converged, _, _ = jax.lax.while_loop(unfinished, newton_step,
                                                   (start, jnp.bool_(False), jnp.bool_(False), 0))
    return constant, converged


_STARTING_VALUE_METHODS = {"newton": newton_constant, "sweeps": _coordinate_sweeps}


def _apply_hessian_mode(shape: RoundShape, params: RoundParams, diagonal: jax.Array,
                        off_diagonal: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The curvature used for splits and Newton values: per-row Hessian diagonals ``(n, K)``,
    which the mode floors or replaces, and for vector leaves the rest of each row's packed
    Hessian (``VectorLeaves.pack_hessian``), which "floor" keeps and "constant" zeroes."""
    if shape.hessian_mode == "exact":
        return diagonal, off_diagonal
    if shape.hessian_mode == "floor":
        return jnp.maximum(diagonal, params.hessian_floor), off_diagonal
    return jnp.ones_like(diagonal), None if off_diagonal is None else jnp.zeros_like(off_diagonal)


# The round's health travels in the arrays the tree is grown from, not in per-row flags of its
# own: XLA's CPU reductions do not fuse their inputs, so counting flagged rows held two more
# row-sized buffers per device (at 4M x 28 rows that pushed a round's temporaries past the
# size glibc reuses, and every round paid page faults for them). A counted row whose loss
# value, gradient or Hessian is not finite gets a NaN gradient; one with a negative Hessian a
# -inf split Hessian; the sums over rows then say whether any row went wrong.

def _marked_gradients(counted, values, g, h, row_weight):
    """Weighted gradients ``(n, K)``, zero for rows that do not count; NaN (0 * inf and 0 * NaN
    are NaN) for a counted row whose loss value or Hessian entries are not finite."""
    marks = 0.0 * (values + jnp.sum(h.reshape(h.shape[0], -1), axis=1))
    return jnp.where(counted[:, None], g * row_weight[:, None] + marks[:, None], 0.0)


def _split_hessians(counted, diagonal, row_weight):
    # A zero Hessian (absolute error, quantile, hinge, Huber's tails) would make every node
    # weightless: the split search uses the row's sample weight instead, as XGBoost does for
    # absolute error. Leaf values then come from the exact refit. A negative one is marked -inf.
    curvature = jnp.where(diagonal < -NEGATIVE_HESSIAN_TOLERANCE, -jnp.inf,
                          jnp.where(diagonal > 0, diagonal, 1.0) * row_weight[:, None])
    return jnp.where(counted[:, None], curvature, 0.0)


# Rows per step of ``in_row_chunks``: the loss's intermediate values are held for this many
# rows at a time, not for all of a device's rows.
DERIVATIVE_CHUNK_ROWS = 32768


def in_row_chunks(function: Callable, arrays: tuple, chunk_rows: int | None = None) -> tuple:
    """``function(*arrays)`` for a row-wise ``function`` (row ``i`` of each result depends on
    row ``i`` of the arrays only), computed ``chunk_rows`` rows (default ``DERIVATIVE_CHUNK_ROWS``)
    at a time.

    XLA's CPU fusions have one output each, so the intermediate values that both the gradient
    and the Hessian read (a logistic loss's exponentials) are stored for every row: three more
    row vectors a device. In chunks they take a chunk's rows. The last chunk ends at the last
    row, overlapping the one before; its rows are computed twice, to the same values."""
    chunk_rows = chunk_rows or DERIVATIVE_CHUNK_ROWS
    n_rows = arrays[0].shape[0]
    if n_rows <= chunk_rows:
        return function(*arrays)
    pieces = jax.eval_shape(function, *(a[:chunk_rows] for a in arrays))
    # The chunks write every row.
    results = tuple(uninitialized((n_rows,) + piece.shape[1:], piece.dtype, arrays[0], tag)
                    for tag, piece in enumerate(pieces))

    def one_chunk(chunk, results):
        start = jnp.minimum(chunk * chunk_rows, n_rows - chunk_rows)
        rows = (jax.lax.dynamic_slice_in_dim(a, start, chunk_rows) for a in arrays)
        return tuple(jax.lax.dynamic_update_slice_in_dim(result, piece, start, 0)
                     for result, piece in zip(results, function(*rows)))

    return jax.lax.fori_loop(0, -(-n_rows // chunk_rows), one_chunk, results)


@lru_cache(maxsize=16)
def compiled_zero_hessian_count(objective: Objective, mesh: Mesh) -> Callable:
    """``count(raw_prediction, y, sample_weight, loss_params)``: how many rows of positive
    weight have an exactly zero Hessian entry at ``raw_prediction`` (rows sharded over
    ``mesh``), computed in chunks of rows, so only the count leaves the devices."""
    def local_count(raw_prediction, y, sample_weight, loss_params):
        def zero_rows(raw_prediction, y, sample_weight):
            _, _, h = loss_derivatives(objective, raw_prediction, y, loss_params)
            return (zero_hessian_rows(h, sample_weight, jnp.int32),)

        (zero,) = in_row_chunks(zero_rows, (raw_prediction, y, sample_weight))
        return all_sum(row_sum(zero), ROW_AXIS)

    rows = PartitionSpec(ROW_AXIS)
    count = jax.shard_map(local_count, mesh=mesh, in_specs=(PartitionSpec(ROW_AXIS, None), rows, rows, PartitionSpec()),
                          out_specs=PartitionSpec(), check_vma=False)
    return jax.jit(count, compiler_options=compiler_options(mesh_platform(mesh)))


def zero_hessian_rows(h, sample_weight, dtype=jnp.float32) -> jax.Array:
    """Per row: 1 where the row has positive ``sample_weight`` and some Hessian entry (``h``:
    ``(n, K)``, as the loss gives it) is exactly zero, else 0: the rows for which a custom loss
    refits its leaves (``compiled_zero_hessian_count``, ``RoundHealth.zero_hessian``)."""
    return (jnp.any(h == 0, axis=1) & (sample_weight > 0)).astype(dtype)


def _round_health(gradients, split_hessians, zero_hessians=None) -> RoundHealth:
    """The health marks of ``_marked_gradients`` and ``_split_hessians``, summed over all rows,
    and whether some row is marked in ``zero_hessians`` (``zero_hessian_rows``; None: not
    looked for). Gradients whose sum overflows float32 count as non-finite (so would the
    histograms' sums)."""
    # Summed as the gradients are: XLA's CPU tree of reductions for a max over int8 rows had
    # been 290 of the derivatives' program's 410 KB of LLVM IR.
    sums = row_sums(gradients, split_hessians, *(() if zero_hessians is None else (zero_hessians,)))
    gradient_sum = all_sum(jnp.sum(sums[0]), ROW_AXIS)
    hessian_sum = all_sum(jnp.sum(sums[1]), ROW_AXIS)
    negative = hessian_sum == -jnp.inf
    zero = jnp.bool_(False) if zero_hessians is None else all_sum(sums[2], ROW_AXIS) > 0
    return RoundHealth(non_finite=~jnp.isfinite(gradient_sum) | (~jnp.isfinite(hessian_sum) & ~negative),
                       negative_hessian=negative, zero_hessian=zero)


def _tree_statistics(shape: RoundShape, params: RoundParams, raw_prediction, y, row_weight, sample_weight=None):
    """Row-local: what the round's trees grow from, ``(gradients, hessians)`` (``grow_tree``'s:
    per output, or for vector leaves packed Hessian matrices), and the round's ``RoundHealth``.
    The loss is read here, and in a leaf refit, alone. ``sample_weight``: the rows' weights
    before the row sample, for ``RoundHealth.zero_hessian`` (read where the shape counts zero
    Hessians: a round's derivatives tell a custom loss's first fit whether to refit leaves, in
    place of a program of their own)."""
    objective, leaves = shape.objective, shape.vector_leaves
    counts = shape.counts_zero_hessians
    if counts and sample_weight is None:
        raise ValueError("a shape that counts zero Hessians needs the rows' sample weights")

    def scalar_rows(raw_prediction, y, row_weight, sample_weight=None):
        values, g, h = loss_derivatives(objective, raw_prediction, y, params.loss_params)
        zero = () if sample_weight is None else (zero_hessian_rows(h, sample_weight),)
        counted = row_weight > 0
        h, _ = _apply_hessian_mode(shape, params, h)
        return (_marked_gradients(counted, values, g, h, row_weight), _split_hessians(counted, h, row_weight)) + zero

    def vector_rows(raw_prediction, y, row_weight, sample_weight=None):
        # Each row's Hessian packed as the trees read it (the diagonal first) while the rows are
        # the last axis, so that each packed channel is a row of the matrices' entries. Packed
        # from (n, K, K) matrices, XLA's loop found every element's entry in a table, one
        # element at a time, and computed the entries again for the marks: at 10 classes on
        # 160k rows the derivatives' program took 31.6-41.4 against 18.5-21.6 ms a round (6
        # alternating pairs), its compile 0.26-0.34 against 0.24-0.25 s.
        values, g, packed = values_gradients_and_hessian_matrices(bind_loss(objective, params.loss_params),
                                                                  raw_prediction, y, pack=leaves.pack_hessian)
        K = objective.num_outputs
        diagonal, off_diagonal = packed[:, :K], packed[:, K:]
        zero = () if sample_weight is None else (zero_hessian_rows(diagonal, sample_weight),)
        counted = row_weight > 0
        diagonal, off_diagonal = _apply_hessian_mode(shape, params, diagonal, off_diagonal)
        split_diagonal = _split_hessians(counted, diagonal, row_weight)
        weighted = jnp.where(counted[:, None], off_diagonal * row_weight[:, None], 0.0)
        # Marked by the Hessian entries the tree reads.
        read = jnp.concatenate([diagonal, off_diagonal], axis=1)
        return (_marked_gradients(counted, values, g, read, row_weight), split_diagonal,
                jnp.concatenate([split_diagonal, weighted], axis=1)) + zero

    arrays = (raw_prediction, y, row_weight) + ((sample_weight,) if counts else ())
    if leaves is None:
        gradients, hessians, *zero = in_row_chunks(scalar_rows, arrays)
        return (gradients, hessians), _round_health(gradients, hessians, *zero)
    gradients, split_diagonal, hessians, *zero = in_row_chunks(vector_rows, arrays)
    return (gradients, hessians), _round_health(gradients, split_diagonal, *zero)


# Coordinate sweeps over the outputs when refitting vector leaves on the true loss.
VECTOR_REFIT_SWEEPS = 2


def _leaf_refit(shape: RoundShape, params: RoundParams, raw_prediction, y, row_weight) -> Callable:
    """Row-local: ``offsets(row_leaf, output, others)``, the offsets of output ``output`` per
    leaf that minimise the true loss exactly, the raw predictions moved by ``others`` (``(n, K)``:
    the other outputs' offsets) when given."""
    num_nodes = num_heap_nodes(shape.max_depth)

    def offsets(row_leaf, output, others=None):
        shifted = raw_prediction if others is None else raw_prediction + others
        return minimise_offsets(shape.objective, shifted, y, row_weight, row_leaf, num_nodes, output,
                                params.growth.reg, ROW_AXIS, params.loss_params, shape.deterministic_histogram)
    return offsets


class GrownTrees(NamedTuple):
    """A round's trees as grown, before their leaf values are final: the trees (fields ``(K,
    nodes)``), where the rows end in them (``RowLeaves`` with a leading axis: one per tree, or
    one shared by the K trees of vector leaves) and each node's value bounds from monotone
    constraints (``(lower, upper)``, ``(K, nodes)`` or ``(1, nodes)``), which a leaf refit keeps."""

    trees: Tree
    row_leaves: RowLeaves
    bounds: tuple


# A refit round's trees' program returns these records, which the program store serializes.
for _record in (Tree, RowLeaves, GrownTrees):
    serializable_record(_record)


def _grow_trees(shape: RoundShape, growth: GrowthParams, X_binned_T, row_offsets, statistics, feature_allowed,
                tree_key, histogram_buffer) -> tuple[GrownTrees, jax.Array]:
    """Row-local (inside ``shard_map``): the round's trees grown from ``statistics``
    (``_tree_statistics``), and the histogram buffer. ``row_offsets``: this device's first row
    in a shared code table (``(1,)``; unused when ``X_binned_T`` holds the device's rows only).
    ``histogram_buffer``: this device's part of ``histogram_buffer``'s array, passed from tree to
    tree and returned. The loss is not read here: the trees' program (``round_trees_function``)
    is one for every loss."""
    row_offset = row_offsets[0] if shape.shared_codes else None
    grow = _grow_scalar_trees if shape.vector_leaves is None else _grow_vector_tree
    return grow(shape, growth, X_binned_T, row_offset, statistics, feature_allowed, tree_key, histogram_buffer)


def _grow_vector_tree(shape: RoundShape, growth: GrowthParams, X_binned_T, row_offset, statistics, feature_allowed,
                      tree_key, histogram_buffer):
    """One tree for all K outputs (vector leaves), handed on as K trees sharing its splits."""
    K = shape.objective.num_outputs
    gradients, packed_hessians = statistics
    tree, row_leaves, bounds, histogram_buffer = grow_tree(
        X_binned_T, gradients, packed_hessians, feature_allowed, tree_key, growth, shape.max_depth,
        shape.max_bin, ROW_AXIS, shape.sample_level_columns, shape.vector_leaves, shape.missing_values, row_offset,
        histogram_buffer, kernel_threads=shape.kernel_threads, kernel_row_ranges=shape.kernel_row_ranges,
        feature_slots=shape.feature_slots, deterministic_histogram=shape.deterministic_histogram,
        prune_splits=shape.prune_splits)
    shared = [jnp.broadcast_to(field, (K,) + field.shape) for field in tree]
    trees = Tree(*shared)._replace(value=tree.value.T, sum_hessians=tree.sum_hessians.T)
    leading = partial(jax.tree_util.tree_map, lambda array: array[None])
    return GrownTrees(trees, leading(row_leaves), leading(bounds)), histogram_buffer


def _grow_scalar_trees(shape: RoundShape, growth: GrowthParams, X_binned_T, row_offset, statistics, feature_allowed,
                       tree_key, histogram_buffer):
    """One tree per output, one after the other."""
    gradients, split_hessians = statistics

    def one_output(histogram_buffer, output):
        tree, row_leaves, bounds, histogram_buffer = grow_tree(
            X_binned_T, gradients[:, output], split_hessians[:, output], feature_allowed,
            derived_keys(tree_key, output, 1)[0], growth, shape.max_depth, shape.max_bin, ROW_AXIS,
            shape.sample_level_columns, missing_values=shape.missing_values, row_offset=row_offset,
            histogram_buffer=histogram_buffer, kernel_threads=shape.kernel_threads,
            kernel_row_ranges=shape.kernel_row_ranges, feature_slots=shape.feature_slots,
            deterministic_histogram=shape.deterministic_histogram, prune_splits=shape.prune_splits)
        return histogram_buffer, GrownTrees(tree, row_leaves, bounds)

    # The K trees one after the other, each growing in the buffer the last one left.
    histogram_buffer, grown = jax.lax.scan(one_output, histogram_buffer, jnp.arange(shape.objective.num_outputs))
    return grown, histogram_buffer


def _shared_row_leaf(row_leaves: RowLeaves) -> jax.Array:
    """Each row's leaf (heap index) in the K trees of vector leaves, which share their splits."""
    return RowLeaves(*(array[0] for array in row_leaves)).heap_index()


def _refit_leaves(shape: RoundShape, growth: GrowthParams, grown: GrownTrees, refit: Callable) -> Tree:
    """Row-local: ``grown``'s trees with their leaf values set by ``refit`` (``_leaf_refit``),
    shrunk by the learning rate and kept within the leaves' bounds."""
    trees, row_leaves = grown.trees, grown.row_leaves
    if shape.vector_leaves is not None:
        K = shape.objective.num_outputs
        row_leaf = _shared_row_leaf(row_leaves)

        def refit_output(step, offsets):
            # Coordinate descent: each output's leaf offsets exactly, given the others'.
            output = step % K
            others = offsets.at[:, output].set(0.0)
            return offsets.at[:, output].set(refit(row_leaf, output, others[row_leaf]))

        offsets = jax.lax.fori_loop(0, VECTOR_REFIT_SWEEPS * K, refit_output,
                                    jnp.zeros((num_heap_nodes(shape.max_depth), K)))
        refit_values = growth.learning_rate * clip_leaf_value(offsets, growth.reg)
        return trees._replace(value=jnp.where(trees.is_leaf, refit_values.T, trees.value))

    def one_output(_, tree_of_output):
        output, is_leaf, value, position_leaf, last_position, lower, upper = tree_of_output
        offsets = refit(position_leaf[last_position], output)
        refit_values = growth.learning_rate * clip_leaf_value(offsets, growth.reg, lower, upper)
        return None, jnp.where(is_leaf, refit_values, value)

    _, values = jax.lax.scan(one_output, None, (jnp.arange(shape.objective.num_outputs), trees.is_leaf, trees.value,
                                                *row_leaves, *grown.bounds))
    return trees._replace(value=values)


def _moved(shape: RoundShape, raw_prediction, trees: Tree, row_leaves: RowLeaves):
    """Row-local: the raw predictions moved by the round's trees (``row_leaves``: ``GrownTrees``')."""
    if shape.vector_leaves is not None:
        return raw_prediction + trees.value.T[_shared_row_leaf(row_leaves)]
    position_values = jnp.take_along_axis(trees.value, row_leaves.position_leaf, axis=1)  # (K, 2^max_depth)
    return add_position_values(raw_prediction, position_values, row_leaves.last_position)


def _refit_and_move(shape: RoundShape, params: RoundParams, grown: GrownTrees, raw_prediction, y, row_weight):
    """Row-local: the trees with their leaves refit on the true loss, and the raw predictions
    moved by them."""
    refit = _leaf_refit(shape, params, raw_prediction, y, row_weight)
    trees = _refit_leaves(shape, params.growth, grown, refit)
    return _moved(shape, raw_prediction, trees, grown.row_leaves), trees


def _grow_round_trees(shape: RoundShape, params: RoundParams, X_binned_T, row_offsets, y, row_weight,
                      raw_prediction, feature_allowed, tree_key, histogram_buffer, sample_weight):
    """Row-local body of a whole round in one program (``round_function``): derivatives, trees,
    refits, update."""
    statistics, health = _tree_statistics(shape, params, raw_prediction, y, row_weight, sample_weight)
    grown, histogram_buffer = _grow_trees(shape, params.growth, X_binned_T, row_offsets, statistics,
                                          feature_allowed, tree_key, histogram_buffer)
    if shape.leaf_refit:
        raw_prediction, trees = _refit_and_move(shape, params, grown, raw_prediction, y, row_weight)
    else:
        raw_prediction, trees = _moved(shape, raw_prediction, grown.trees, grown.row_leaves), grown.trees
    return raw_prediction, trees, health, histogram_buffer


def histogram_buffer(shape: RoundShape, n_features: int, models: int | None = None, models_mesh=None) -> jax.Array:
    """The histogram buffer that the compiled rounds take and give back (donated), placed on
    the mesh: each device's widest level loop keeps its histograms in its part, from round to
    round. Held by the caller, its tens of MB (14.7 a device at depth 10 with 28 features on 2
    devices) are not in the scratch memory that XLA allocates for every round, which then stays
    under the 32 MB above which glibc maps a block afresh for every round and the round faults
    its pages in again: a depth-10 tree took 118 -> 95 ms at 800k rows, 54 -> 31 ms at 20k.
    A tree whose first level loop holds every level (on CPU, or up to depth 6) starts it there,
    its slots not zeroed for every tree. ``models``: a leading axis for ``train_many``'s M models,
    split over ``models_mesh`` when given (``compiled_many_rounds``)."""
    devices = shape.mesh.devices.size
    channels = 2
    if shape.vector_leaves is not None:
        channels = paired_width(shape.vector_leaves.num_outputs + shape.vector_leaves.hessian_channels)
    local = histogram_buffer_shape(shape.max_depth, shape.feature_slots or n_features, shape.max_bin, channels,
                                   devices)
    global_shape = (devices * local[0],) + local[1:]
    if models is not None:
        global_shape = (models,) + global_shape
    if models_mesh is not None:
        return jax.device_put(np.zeros(global_shape, np.float32), model_split(models_mesh))
    return jax.device_put(np.zeros(global_shape, np.float32),
                          row_sharding(shape.mesh, len(global_shape), row_axis=0 if models is None else 1))


def seed_key_data(seed: int) -> np.ndarray:
    """The seed's raw key, ``jax.random.key_data(jax.random.PRNGKey(seed))``: the seed's two
    32-bit words, from which ``sampling``'s draws derive the rounds' keys. Made on the host:
    JAX's seeding is one more program to compile in a first fit."""
    return np.array([0, int(seed) % 2 ** 32], np.uint32)


@lru_cache(maxsize=64)
def round_tree_template(shape: RoundShape) -> Tree:
    """The shapes and dtypes (``ShapeDtypeStruct``) of one round's trees, ``(K, nodes)`` a
    field (vector leaves too: their tree as K trees of one structure); the round returns them
    packed (``pack_fields``)."""
    K = shape.objective.num_outputs
    return jax.eval_shape(lambda: jax.tree_util.tree_map(lambda field: jnp.broadcast_to(field, (K,) + field.shape),
                                                         empty_tree(num_heap_nodes(shape.max_depth))))


def _row_map(shape: RoundShape, inside_models_mesh: bool) -> dict:
    """``shard_map``'s mesh arguments for a round's row-local parts: its mesh's, or inside
    ``compiled_many_rounds``' split of the models over a ``models_mesh`` (whose row axis, of one
    device, its maps then take)."""
    return dict(mesh=None, axis_names=frozenset({ROW_AXIS})) if inside_models_mesh else dict(mesh=shape.mesh)


def _eval_predictor(shape: RoundShape, row_map: dict) -> Callable:
    """``predict(trees, X_binned, raw_eval)``: an eval set's raw predictions moved by the
    round's trees.

    Each device predicts its own share of an eval set's rows. Left to the partitioner, each
    level's lookup of codes in row-sharded data became a masked gather summed over the devices
    (two collectives a level): on two CPU devices an eval set cost 0.8-1.0 ms a round whatever
    its size (40k training and 10k eval rows: 2.5 ms a round without it, 3.3-3.5 with it, 2.7-2.8
    now; 800k and 200k rows: +5.2-5.6 ms, now +2.5-3.2)."""
    return jax.shard_map(
        lambda trees, X_binned, raw_eval: raw_eval + predict_round(trees, X_binned, shape.max_bin - 1),
        **row_map,
        in_specs=(PartitionSpec(), PartitionSpec(ROW_AXIS, None), PartitionSpec(ROW_AXIS, None)),
        out_specs=PartitionSpec(ROW_AXIS, None),
        check_vma=False,
    )


def _round_keys(seed_key, round_index) -> tuple:
    """The round's keys for its row sample, its trees' column sample and its trees."""
    return tuple(derived_keys(seed_key, 3 * round_index, 3))


def _row_weight(shape: RoundShape, params: RoundParams, sample_weight, row_index, row_key):
    if not shape.sample_rows:
        return sample_weight
    # Drawn by each row's index in the data: the same sample on any number of devices.
    return jnp.where(uniform_of_counters(row_key, row_index) < params.subsample, sample_weight, 0.0)


def _feature_allowed(shape: RoundShape, colsample_bytree, n_features: int, column_key):
    feature_allowed = jnp.ones(n_features, bool)
    if shape.sample_columns:
        feature_allowed = sample_features(column_key, feature_allowed, colsample_bytree, shape.feature_slots)
    return feature_allowed


def _metric_values(shape: RoundShape, loss_params, eval_labels, eval_raw_predictions) -> tuple:
    """Per eval set, its metrics' values stacked (``eval_labels``: its ``(y, weight)``)."""
    return tuple(jnp.stack([metric(y_eval, raw_eval, weight_eval, loss_params) for metric in metrics])
                 for (y_eval, weight_eval), raw_eval, metrics in zip(eval_labels, eval_raw_predictions, shape.metrics))


def _eval_labels(eval_sets) -> tuple:
    """The ``(y, weight)`` of each eval set ``(X_binned, y, weight, raw_prediction)``."""
    return tuple((y_eval, weight_eval) for _, y_eval, weight_eval, _ in eval_sets)


def _packed(shape: RoundShape, trees: Tree) -> jax.Array:
    template = round_tree_template(shape)
    if [(f.shape, f.dtype) for f in trees] != [(f.shape, f.dtype) for f in template]:
        raise AssertionError(f"the round grew trees of other shapes than round_tree_template's: {trees}")
    return pack_fields(trees)


def round_function(shape: RoundShape, inside_models_mesh: bool = False) -> Callable:
    """The (unjitted) boosting round for one static shape, as one program: ``train_many``'s
    rounds (``jb.train``'s are ``SplitRound``'s programs, which grow the same trees). It
    returns the round's trees packed into one array (``tree.pack_fields``;
    ``round_tree_template`` unpacks them) and its ``RoundHealth`` flags stacked along a last
    axis: the host reads one array of each a round.

    ``inside_models_mesh``: the round runs inside ``compiled_many_rounds``' split of the models
    over a ``models_mesh``."""
    rows = PartitionSpec(ROW_AXIS)
    codes = PartitionSpec() if shape.shared_codes else PartitionSpec(None, ROW_AXIS)
    row_map = _row_map(shape, inside_models_mesh)
    grow = jax.shard_map(
        partial(_grow_round_trees, shape),
        **row_map,
        in_specs=(PartitionSpec(), codes, rows, rows, rows, PartitionSpec(ROW_AXIS, None),
                  PartitionSpec(), PartitionSpec(), rows, rows),
        out_specs=(PartitionSpec(ROW_AXIS, None), PartitionSpec(), PartitionSpec(), rows),
        check_vma=False,
    )
    predict_eval = _eval_predictor(shape, row_map)

    def boosting_round(params: RoundParams, X_binned_T, row_offsets, y, sample_weight, row_index, raw_prediction,
                       seed_key, round_index, eval_sets, histogram_buffer):
        # The round is lowered for its mesh's platform alone: only that platform's kernels are traced.
        with lowering_for(mesh_platform(shape.mesh)):
            row_key, column_key, tree_key = _round_keys(seed_key, round_index)
            row_weight = _row_weight(shape, params, sample_weight, row_index, row_key)
            feature_allowed = _feature_allowed(shape, params.colsample_bytree, X_binned_T.shape[0], column_key)
            raw_prediction, trees, health, histogram_buffer = grow(params, X_binned_T, row_offsets, y, row_weight,
                                                                   raw_prediction, feature_allowed, tree_key,
                                                                   histogram_buffer, sample_weight)
            eval_raw_predictions = tuple(predict_eval(trees, X_binned, raw_eval)
                                         for X_binned, _, _, raw_eval in eval_sets)
            metric_values = _metric_values(shape, params.loss_params, _eval_labels(eval_sets), eval_raw_predictions)
            # The health flags as one array too (RoundHealth's fields along the last axis).
            return (raw_prediction, _packed(shape, trees), jnp.stack(health, axis=-1), eval_raw_predictions,
                    metric_values, histogram_buffer)

    return boosting_round


# Positions of ``raw_prediction`` and ``histogram_buffer`` in ``boosting_round``'s arguments
# (donated by the compiled rounds), and of ``eval_sets``.
RAW_PREDICTION_ARGUMENT = 6
EVAL_SETS_ARGUMENT = 9
HISTOGRAM_BUFFER_ARGUMENT = 10
DONATED_ARGUMENTS = (RAW_PREDICTION_ARGUMENT, HISTOGRAM_BUFFER_ARGUMENT)


# A round runs as two to four programs (``SplitRound``): the loss's derivatives
# (``round_statistics_function``), the trees grown from them with the eval sets' predictions and
# metrics (``round_trees_function``, which reads no loss: one program for every loss on the same
# shapes, and storable for a custom loss), and the metrics that are the loss itself
# (``round_metrics_function``). A new loss then compiles its derivatives alone: on 2 cores, a
# custom focal loss's first fit after a built-in's on 100k x 28 rows took 3.75 s with the round
# one program, 1.45 s as two (``experiments/results/new_loss.md``). A leaf refit, which reads the
# loss between the trees' splits and their leaf values, is a program of its own
# (``round_refit_function``): the trees' program then hands on the trees as grown and where the
# rows end (``GrownTrees``), and the eval metrics, which need the refit leaves, come after it.

def _without_loss(shape: RoundShape) -> RoundShape:
    """``shape`` with the loss left out of its objective and of its metrics' (which then read
    the link alone)."""
    objective = shape.objective._replace(loss=None)
    metrics = tuple(tuple(metric._replace(objective=objective) for metric in metrics) for metrics in shape.metrics)
    return shape._replace(objective=objective, metrics=metrics)


def trees_shape(shape: RoundShape) -> RoundShape:
    """``shape`` less what ``round_trees_function``'s program does not read (the loss, how its
    Hessians are formed, the row sample): the key of a program that every loss of these shapes
    shares. Its metrics are the eval metrics where none reads the loss and the leaves are not
    refit (they then read the link alone, and are computed with the trees: a call of their own
    had cost 0.05 ms a round, 8% of a round on 200 rows), else none (``round_metrics_function``
    computes them)."""
    if shape.leaf_refit or not shape.metrics or _metrics_read_loss(shape):
        shape = shape._replace(objective=Objective(loss=None, vector_output=False,
                                                   num_outputs=shape.objective.num_outputs, link=None), metrics=())
    else:
        shape = _without_loss(shape)
    return shape._replace(hessian_mode="exact", sample_rows=False, counts_zero_hessians=False)


def _without_growth(shape: RoundShape) -> RoundShape:
    """``shape`` less how its trees are grown, which only ``round_trees_function``'s program
    reads: whether they are pruned (a first gamma that prunes compiles the trees alone)."""
    return shape._replace(prune_splits=RoundShape._field_defaults["prune_splits"])


def _without_counting(shape: RoundShape) -> RoundShape:
    """``shape`` less the count of zero Hessians, which only the derivatives' program reads."""
    return shape._replace(counts_zero_hessians=False)


def statistics_shape(shape: RoundShape) -> RoundShape:
    """``shape`` less the eval metrics and the leaf refit, which ``round_statistics_function``'s
    program does not read: a new eval set or metric does not trace the loss's derivatives again,
    nor does a custom loss found to need a refit."""
    return _without_growth(shape)._replace(metrics=(), leaf_refit=False)


def refit_shape(shape: RoundShape) -> RoundShape:
    """``shape`` less what ``round_refit_function``'s program does not read (the eval metrics,
    how the Hessians were formed, how the trees were grown)."""
    return _without_counting(_without_growth(shape))._replace(metrics=(), hessian_mode="exact")


def metrics_shape(shape: RoundShape) -> RoundShape:
    """``shape`` as ``round_metrics_function``'s program reads it: without the loss where no
    metric is the loss, so that other losses' fits share the program."""
    shape = _without_counting(_without_growth(shape))
    return shape if _metrics_read_loss(shape) else _without_loss(shape)


def _metrics_read_loss(shape: RoundShape) -> bool:
    """Some eval metric is the training loss (``objective.EvalMetric`` without a function)."""
    return not all(getattr(metric, "function", None) is not None for metrics in shape.metrics for metric in metrics)


def round_statistics_function(shape: RoundShape) -> Callable:
    """``round_statistics(params, y, sample_weight, row_index, raw_prediction, seed_key,
    round_index)``: the round's row sample and ``(gradients, hessians)`` (``_tree_statistics``),
    and its ``RoundHealth`` flags stacked along a last axis."""
    rows, predictions = PartitionSpec(ROW_AXIS), PartitionSpec(ROW_AXIS, None)
    statistics_of_rows = jax.shard_map(
        partial(_tree_statistics, shape), mesh=shape.mesh,
        in_specs=(PartitionSpec(), predictions, rows, rows, rows),
        out_specs=((predictions, predictions), PartitionSpec()), check_vma=False)

    def round_statistics(params: RoundParams, y, sample_weight, row_index, raw_prediction, seed_key, round_index):
        with lowering_for(mesh_platform(shape.mesh)):
            row_key, _, _ = _round_keys(seed_key, round_index)
            row_weight = _row_weight(shape, params, sample_weight, row_index, row_key)
            statistics, health = statistics_of_rows(params, raw_prediction, y, row_weight, sample_weight)
            return statistics, jnp.stack(health, axis=-1)

    return round_statistics


# ``GrownTrees``' parts as ``shard_map`` specs: where the rows end is sharded with the rows.
_GROWN_SPECS = GrownTrees(PartitionSpec(), RowLeaves(PartitionSpec(), PartitionSpec(None, ROW_AXIS)),
                          (PartitionSpec(), PartitionSpec()))


def round_trees_function(shape: RoundShape) -> Callable:
    """``round_trees(growth, colsample_bytree, X_binned_T, row_offsets, statistics,
    raw_prediction, seed_key, round_index, eval_sets, histogram_buffer)`` for a ``trees_shape``:
    the round's trees grown from ``statistics`` (``round_statistics_function``'s), packed, the
    raw predictions moved by them, the eval sets' (``(X_binned, y, weight, raw_prediction)``
    each) too, the shape's metrics of them (none if it has none), and the histogram buffer.

    With a leaf refit (``raw_prediction`` then None): the trees as grown (``GrownTrees``), where
    each eval set's rows end in them (``(K, rows)``), and the histogram buffer; the refit
    (``round_refit_function``) moves the raw predictions."""
    rows, predictions = PartitionSpec(ROW_AXIS), PartitionSpec(ROW_AXIS, None)
    codes = PartitionSpec() if shape.shared_codes else PartitionSpec(None, ROW_AXIS)
    growth_specs = (PartitionSpec(), codes, rows, (predictions, predictions))
    growth_tail_specs = (PartitionSpec(), PartitionSpec(), rows)

    def grow_and_move(growth, X_binned_T, row_offsets, statistics, raw_prediction, feature_allowed, tree_key,
                      histogram_buffer):
        grown, histogram_buffer = _grow_trees(shape, growth, X_binned_T, row_offsets, statistics, feature_allowed,
                                              tree_key, histogram_buffer)
        return _moved(shape, raw_prediction, grown.trees, grown.row_leaves), grown.trees, histogram_buffer

    if shape.leaf_refit:
        grow = jax.shard_map(partial(_grow_trees, shape), mesh=shape.mesh, in_specs=growth_specs + growth_tail_specs,
                             out_specs=(_GROWN_SPECS, rows), check_vma=False)
        find_eval_leaves = _eval_leaf_finder(shape)
    else:
        grow = jax.shard_map(grow_and_move, mesh=shape.mesh, in_specs=growth_specs + (predictions,) + growth_tail_specs,
                             out_specs=(predictions, PartitionSpec(), rows), check_vma=False)
        predict_eval = _eval_predictor(shape, dict(mesh=shape.mesh))

    def round_trees(growth: GrowthParams, colsample_bytree, X_binned_T, row_offsets, statistics, raw_prediction,
                    seed_key, round_index, eval_sets, histogram_buffer):
        with lowering_for(mesh_platform(shape.mesh)):
            _, column_key, tree_key = _round_keys(seed_key, round_index)
            feature_allowed = _feature_allowed(shape, colsample_bytree, X_binned_T.shape[0], column_key)
            if shape.leaf_refit:
                grown, histogram_buffer = grow(growth, X_binned_T, row_offsets, statistics, feature_allowed, tree_key,
                                               histogram_buffer)
                eval_leaves = tuple(find_eval_leaves(grown.trees, X_binned) for X_binned, *_ in eval_sets)
                return grown, eval_leaves, histogram_buffer
            raw_prediction, trees, histogram_buffer = grow(growth, X_binned_T, row_offsets, statistics,
                                                           raw_prediction, feature_allowed, tree_key,
                                                           histogram_buffer)
            eval_raw_predictions = tuple(predict_eval(trees, X_binned, raw_eval)
                                         for X_binned, _, _, raw_eval in eval_sets)
            metric_values = (_metric_values(shape, None, _eval_labels(eval_sets), eval_raw_predictions)
                             if shape.metrics else ())
            return raw_prediction, _packed(shape, trees), eval_raw_predictions, metric_values, histogram_buffer

    return round_trees


def _eval_leaf_finder(shape: RoundShape) -> Callable:
    """``find(trees, X_binned)``: the leaf (heap index) that each of an eval set's rows reaches
    in each of the round's trees, ``(K, rows)``; each device finds its own share's
    (``_eval_predictor`` says why)."""
    return jax.shard_map(
        lambda trees, X_binned: jax.vmap(lambda tree: leaf_index(tree, X_binned, shape.max_bin - 1))(trees),
        mesh=shape.mesh, in_specs=(PartitionSpec(), PartitionSpec(ROW_AXIS, None)),
        out_specs=PartitionSpec(None, ROW_AXIS), check_vma=False)


def round_refit_function(shape: RoundShape) -> Callable:
    """``round_refit(params, y, sample_weight, row_index, raw_prediction, seed_key, round_index,
    grown, eval_raw_predictions, eval_leaves)`` for a ``refit_shape``: the leaf values of the
    round's trees as grown (``GrownTrees``, from ``round_trees_function``) set by exact
    minimisation of the loss (``_leaf_refit``), the raw predictions moved by them, the trees
    packed, and the eval sets' raw predictions moved (``eval_leaves``: where their rows end)."""
    rows, predictions = PartitionSpec(ROW_AXIS), PartitionSpec(ROW_AXIS, None)
    refit_rows = jax.shard_map(
        partial(_refit_and_move, shape), mesh=shape.mesh,
        in_specs=(PartitionSpec(), _GROWN_SPECS, predictions, rows, rows),
        out_specs=(predictions, PartitionSpec()), check_vma=False)
    move_eval = jax.shard_map(
        lambda trees, leaves, raw_eval: raw_eval + jnp.take_along_axis(trees.value, leaves, axis=1).T,
        mesh=shape.mesh, in_specs=(PartitionSpec(), PartitionSpec(None, ROW_AXIS), predictions),
        out_specs=predictions, check_vma=False)

    def round_refit(params: RoundParams, y, sample_weight, row_index, raw_prediction, seed_key, round_index,
                    grown: GrownTrees, eval_raw_predictions, eval_leaves):
        with lowering_for(mesh_platform(shape.mesh)):
            row_key, _, _ = _round_keys(seed_key, round_index)
            row_weight = _row_weight(shape, params, sample_weight, row_index, row_key)
            raw_prediction, trees = refit_rows(params, grown, raw_prediction, y, row_weight)
            eval_raw_predictions = tuple(move_eval(trees, leaves, raw_eval)
                                         for leaves, raw_eval in zip(eval_leaves, eval_raw_predictions))
            return raw_prediction, _packed(shape, trees), eval_raw_predictions

    return round_refit


def round_metrics_function(shape: RoundShape) -> Callable:
    """``round_metrics(loss_params, eval_labels, eval_raw_predictions)``: per eval set (its
    ``(y, weight)``), its metrics' values stacked."""
    def round_metrics(loss_params, eval_labels, eval_raw_predictions):
        with lowering_for(mesh_platform(shape.mesh)):
            return _metric_values(shape, loss_params, eval_labels, eval_raw_predictions)
    return round_metrics


# Positions of the raw predictions and the histogram buffer in ``round_trees``' arguments, and
# of the raw predictions in ``round_refit``'s.
TREES_DONATED_ARGUMENTS = (5, 9)
REFIT_DONATED_ARGUMENTS = (4,)


class SplitRound:
    """A round as its programs (the eval metrics' only where the trees' leave them out, the
    refit's with a leaf refit), called as ``round_function``'s round is (the same arguments and
    results, the same raw predictions and histogram buffer donated)."""

    def __init__(self, shape: RoundShape, statistics, trees, metrics, refit=None):
        self.shape, self.statistics, self.trees, self.metrics, self.refit = shape, statistics, trees, metrics, refit

    def _arguments(self, params, X_binned_T, row_offsets, y, sample_weight, row_index, raw_prediction, seed_key,
                   round_index, eval_sets, histogram_buffer, statistics=None, grown=None, eval_leaves=None) -> tuple:
        """Each program's arguments: the statistics', the trees' (given ``statistics``), the
        refit's (given the trees' ``grown`` and ``eval_leaves``), and the metrics' but for the
        eval raw predictions that the trees or the refit give."""
        return ((params, y, sample_weight, row_index, raw_prediction, seed_key, round_index),
                (params.growth, params.colsample_bytree, X_binned_T, row_offsets, statistics,
                 None if self.refit else raw_prediction, seed_key, round_index, eval_sets, histogram_buffer),
                (params, y, sample_weight, row_index, raw_prediction, seed_key, round_index, grown,
                 tuple(eval_set[3] for eval_set in eval_sets), eval_leaves),
                (params.loss_params, _eval_labels(eval_sets)))

    def __call__(self, *arguments):
        statistics_arguments, _, _, _ = self._arguments(*arguments)
        statistics, health = self.statistics(*statistics_arguments)
        _, trees_arguments, _, metrics_arguments = self._arguments(*arguments, statistics=statistics)
        if self.refit is None:
            raw_prediction, trees, eval_raw_predictions, metric_values, histogram_buffer = self.trees(*trees_arguments)
        else:
            grown, eval_leaves, histogram_buffer = self.trees(*trees_arguments)
            _, _, refit_arguments, _ = self._arguments(*arguments, grown=grown, eval_leaves=eval_leaves)
            raw_prediction, trees, eval_raw_predictions = self.refit(*refit_arguments)
            metric_values = ()
        if self.metrics:
            metric_values = self.metrics(*metrics_arguments, eval_raw_predictions)
        return raw_prediction, trees, health, eval_raw_predictions, metric_values, histogram_buffer

    def zero_hessian(self, *arguments) -> bool:
        """Whether some row of positive weight has an exactly zero Hessian entry at the round's
        raw predictions, for a shape that counts them (``RoundShape.counts_zero_hessians``): the
        derivatives' program alone, called with the round's ``arguments``."""
        statistics_arguments, _, _, _ = self._arguments(*arguments)
        _, health = self.statistics(*statistics_arguments)
        return bool(RoundHealth(*np.asarray(health).T).zero_hessian)

    def constant_offsets(self, arguments: tuple, raw_prediction: jax.Array) -> np.ndarray:
        """Each output's offset ``(K,)`` from ``raw_prediction`` (donated) minimising the weighted
        loss of all the rows, unpenalised, the other outputs held where they are: the refit's
        program, called with every row in one leaf, no learning rate, no penalty and no row
        sample. ``arguments``: the round's (``jax.ShapeDtypeStruct``s may stand for the raw
        predictions). With one output, or outputs that do not interact, it is the loss's best
        constant: a custom loss with a leaf refit finds its starting value with it, rather than
        with a program of its own."""
        shape = self.shape
        eval_sets = arguments[EVAL_SETS_ARGUMENT]
        grown, eval_leaves = self.grown_specs(raw_prediction, eval_sets)

        def filled(spec, value):
            return jax.device_put(np.full(spec.shape, value, spec.dtype), spec.sharding)

        one_leaf = GrownTrees(
            Tree(*(filled(spec, name == "is_leaf") for name, spec in zip(Tree._fields, grown.trees))),
            RowLeaves(*(filled(spec, 0) for spec in grown.row_leaves)),
            (filled(grown.bounds[0], -np.inf), filled(grown.bounds[1], np.inf)))
        y, sample_weight, row_index = arguments[3:6]
        _, packed, _ = self.refit(self._for_a_constant(arguments[0]), y, sample_weight, row_index, raw_prediction,
                                  *arguments[7:9], one_leaf, tuple(filled(eval_set[3], 0) for eval_set in eval_sets),
                                  tuple(filled(spec, 0) for spec in eval_leaves))
        return unpack_fields(np.asarray(packed), round_tree_template(shape)).value[:, 0]

    def derivative_sums(self, arguments: tuple, raw_prediction: jax.Array) -> tuple[np.ndarray, ...]:
        """The weighted sums over all the rows of the loss's gradients ``(K,)``, of their
        magnitudes, and of the Hessians as the splits take them (zeros replaced by the rows'
        weights, the Hessian mode applied), at ``raw_prediction``, with no row sample: the
        derivatives' program, called with the round's other ``arguments``. Summed on the host
        in float64; NaN where some counted row's value or derivatives are not finite."""
        y, sample_weight, row_index = arguments[3:6]
        (gradients, hessians), _ = self.statistics(self._for_a_constant(arguments[0]), y, sample_weight, row_index,
                                                   raw_prediction, *arguments[7:9])
        # Rows last and contiguous: numpy's float64 sum along them is pairwise and vectorised,
        # 3.5x faster than down the rows' axis of an (n, K) array (800k x 3: 4.1 against 15 ms).
        gradients = np.ascontiguousarray(np.asarray(gradients).T)
        return tuple(np.sum(per_row, axis=1, dtype=np.float64)
                     for per_row in (gradients, np.abs(gradients), np.ascontiguousarray(np.asarray(hessians).T)))

    def _for_a_constant(self, params: RoundParams) -> RoundParams:
        """``params`` for a constant's search (``constant_offsets``, ``derivative_sums``): no
        learning rate, no leaf penalty, no row sample; placed as the round's are."""
        zero = np.float32(0)
        growth = params.growth._replace(
            learning_rate=np.float32(1),
            reg=params.growth.reg.replace(reg_lambda=zero, reg_alpha=zero, max_delta_step=zero))
        return jax.device_put(params._replace(growth=growth, subsample=np.float32(1)), replicated(self.shape.mesh))

    def statistics_specs(self, raw_prediction) -> tuple:
        """``(gradients, hessians)``' shapes for raw predictions like ``raw_prediction``."""
        leaves = self.shape.vector_leaves
        channels = raw_prediction.shape[1] if leaves is None else leaves.hessian_channels
        return tuple(jax.ShapeDtypeStruct((raw_prediction.shape[0], width), jnp.float32,
                                          sharding=row_sharding(self.shape.mesh, 2))
                     for width in (raw_prediction.shape[1], channels))

    def grown_specs(self, raw_prediction, eval_sets) -> tuple:
        """With a leaf refit: the shapes of the trees' program's ``GrownTrees`` and eval leaves,
        for raw predictions like ``raw_prediction``."""
        shape = self.shape
        # The shardings the trees' program gives them (``_GROWN_SPECS``; eval leaves as rows).
        everywhere = NamedSharding(shape.mesh, _GROWN_SPECS.trees)
        by_rows = NamedSharding(shape.mesh, _GROWN_SPECS.row_leaves.last_position)
        K, nodes = shape.objective.num_outputs, num_heap_nodes(shape.max_depth)
        grown_leading = 1 if shape.vector_leaves is not None else K

        def spec(leading, width, dtype, sharding=everywhere):
            return jax.ShapeDtypeStruct((leading, width), dtype, sharding=sharding)

        trees = Tree(*(jax.ShapeDtypeStruct(field.shape, field.dtype, sharding=everywhere)
                       for field in round_tree_template(shape)))
        row_leaves = RowLeaves(spec(grown_leading, 2 ** shape.max_depth, jnp.int32),
                               spec(grown_leading, raw_prediction.shape[0], jnp.int32, by_rows))
        bounds = (spec(grown_leading, nodes, jnp.float32),) * 2
        eval_leaves = tuple(spec(K, eval_set[3].shape[0], jnp.int32, by_rows) for eval_set in eval_sets)
        return GrownTrees(trees, row_leaves, bounds), eval_leaves

    def program_arguments(self, arguments: tuple) -> tuple:
        """Each program's arguments for a round called with ``arguments`` (``jax.ShapeDtypeStruct``s
        may stand for the raw predictions), with the shapes of what the programs before give it:
        the statistics', the trees', the refit's and the metrics'."""
        raw_prediction, eval_sets = arguments[RAW_PREDICTION_ARGUMENT], arguments[EVAL_SETS_ARGUMENT]
        grown, eval_leaves = self.grown_specs(raw_prediction, eval_sets) if self.refit else (None, None)
        statistics_arguments, trees_arguments, refit_arguments, metrics_arguments = self._arguments(
            *arguments, statistics=self.statistics_specs(raw_prediction), grown=grown, eval_leaves=eval_leaves)
        return (statistics_arguments, trees_arguments, refit_arguments,
                metrics_arguments + (tuple(eval_set[3] for eval_set in eval_sets),))

    def lower_in_turn(self, *arguments):
        """The programs lowered for ``arguments`` (``program_arguments``), one at a time, to be
        compiled ahead of the first call: the trees' first, then the derivatives' and the
        metrics' together (compiled one after the other), then the refit's
        (``found_while_compiling`` compiles each group in a thread of its own as soon as it is
        lowered)."""
        statistics_arguments, trees_arguments, refit_arguments, metrics_arguments = self.program_arguments(arguments)
        yield self.trees.lower(*trees_arguments)
        others = [self.statistics.lower(*statistics_arguments)]
        if self.metrics:
            others.append(self.metrics.lower(*metrics_arguments))
        yield _LoweredInSequence(others)
        if self.refit:
            yield self.refit.lower(*refit_arguments)

    def jitted(self) -> "SplitRound":
        """This round with its stored programs made (``program_store.ready``)."""
        return SplitRound(self.shape, ready(self.statistics), ready(self.trees), self.metrics and ready(self.metrics),
                          self.refit and ready(self.refit))


class _LoweredInSequence(NamedTuple):
    """Lowered programs (``jax.stages.Lowered`` or the program store's) compiled one after the other."""
    programs: list

    def compile(self) -> None:
        for program in self.programs:
            program.compile()


@lru_cache(maxsize=64)
def _split_round(shape: RoundShape, statistics, trees, metrics, refit) -> SplitRound:
    """One ``SplitRound`` per shape and programs (the compiled-ahead bookkeeping holds it by identity)."""
    return SplitRound(shape, statistics, trees, metrics, refit)


def _needs_metrics_program(shape: RoundShape) -> bool:
    """The eval metrics are a program of their own: some metric is the loss, or they come after
    a leaf refit."""
    return bool(shape.metrics) and (shape.leaf_refit or _metrics_read_loss(shape))


@lru_cache(maxsize=64)
def compiled_round(shape: RoundShape) -> SplitRound:
    """The jitted round for one static shape (cached, so a new training run reuses it):
    ``SplitRound``'s programs, of which the trees' (compiled for a ``trees_shape``) serves every
    loss.

    The raw predictions and the histogram buffer are donated: the round writes the new ones
    over the old, so a round holds one copy of them, not two."""
    return _split_round(shape, _compiled_statistics(statistics_shape(shape)), _compiled_trees(trees_shape(shape)),
                        _compiled_metrics(metrics_shape(shape)) if _needs_metrics_program(shape) else None,
                        _compiled_refit(refit_shape(shape)) if shape.leaf_refit else None)


def _jit_options(shape: RoundShape, donated: tuple = ()) -> dict:
    return dict(donate_argnums=donated, compiler_options=compiler_options(mesh_platform(shape.mesh)))


def _round_jit_options(shape: RoundShape) -> dict:
    """``jax.jit``'s options for a round of ``shape`` in one program (``round_function``), one
    model's or many's, stored or not: its raw predictions and histogram buffer donated, its
    platform's compiler options."""
    return _jit_options(shape, DONATED_ARGUMENTS)


@lru_cache(maxsize=64)
def _compiled_statistics(shape: RoundShape):
    return jax.jit(round_statistics_function(shape), **_jit_options(shape))


@lru_cache(maxsize=64)
def _compiled_trees(shape: RoundShape):
    return jax.jit(round_trees_function(shape), **_jit_options(shape, TREES_DONATED_ARGUMENTS))


@lru_cache(maxsize=64)
def _compiled_refit(shape: RoundShape):
    return jax.jit(round_refit_function(shape), **_jit_options(shape, REFIT_DONATED_ARGUMENTS))


@lru_cache(maxsize=64)
def _compiled_metrics(shape: RoundShape):
    return jax.jit(round_metrics_function(shape), **_jit_options(shape))


def stored_round(shape: RoundShape, arguments: tuple):
    """``compiled_round(shape)``'s round through the program store (``program_store``: lowered
    once, by this process or an earlier one), for rounds called with arguments like
    ``arguments`` (the first round's, with ``ShapeDtypeStruct``s where its raw predictions are
    still to come); None where the store is off or cannot hold it. Each program that the store
    cannot hold (a custom loss's statistics and refit) is jitted as without it."""
    if store_folder() is None:
        return None
    platform = mesh_platform(shape.mesh)
    compiled = compiled_round(shape)
    statistics_arguments, trees_arguments, refit_arguments, metrics_arguments = compiled.program_arguments(arguments)
    parts = {"round_statistics": (statistics_shape(shape), round_statistics_function, statistics_arguments, ()),
             "round_trees": (trees_shape(shape), round_trees_function, trees_arguments, TREES_DONATED_ARGUMENTS)}
    if compiled.refit:
        parts["round_refit"] = (refit_shape(shape), round_refit_function, refit_arguments, REFIT_DONATED_ARGUMENTS)
    if compiled.metrics:
        parts["round_metrics"] = (metrics_shape(shape), round_metrics_function, metrics_arguments, ())
    stored = {name: stored_program(name, partial(make, part), part, part_arguments, platform,
                                   _jit_options(part, donated))
              for name, (part, make, part_arguments, donated) in parts.items()}
    if all(program is None for program in stored.values()):
        return None
    return _split_round(shape, stored["round_statistics"] or compiled.statistics,
                        stored["round_trees"] or compiled.trees,
                        compiled.metrics and (stored.get("round_metrics") or compiled.metrics),
                        compiled.refit and (stored.get("round_refit") or compiled.refit))


def clear_compiled_rounds() -> None:
    """Forget every compiled round (tests that replace what a round traces)."""
    for cache in (compiled_round, _split_round, _compiled_statistics, _compiled_trees, _compiled_refit,
                  _compiled_metrics, compiled_many_rounds):
        cache.cache_clear()


# Platforms whose train_many rounds loop over the models (``_models_one_at_a_time``); the
# others vmap the round over them.
MODELS_IN_A_LOOP_PLATFORMS = ("cpu",)


@lru_cache(maxsize=16)
def compiled_many_rounds(shape: RoundShape, params_axes: tuple, models_mesh=None):
    """``many_rounds_function``'s round, jitted (the raw predictions and histogram buffers donated)."""
    return jax.jit(many_rounds_function(shape, params_axes, models_mesh), **_round_jit_options(shape))


def stored_many_rounds(shape: RoundShape, params_axes: tuple, models_mesh, arguments: tuple):
    """``compiled_many_rounds``' round through the program store, as ``stored_round`` for one
    model's; None where the store is off or cannot hold it. (The parameters' tree is not part of
    the static key: the arguments hold it.)"""
    return stored_program("many_rounds", lambda: many_rounds_function(shape, params_axes, models_mesh),
                          (shape, params_axes[1], models_mesh), arguments, mesh_platform(shape.mesh),
                          _round_jit_options(shape))


def many_rounds_function(shape: RoundShape, params_axes: tuple, models_mesh=None) -> Callable:
    """One round of M models at once, batched over their sample weights, raw predictions,
    seeds, eval raw predictions and the parameters marked 0 in ``params_axes`` (``(treedef,
    axes)`` of the RoundParams leaves, 0 or None: parameters shared by all models stay
    unbatched, so e.g. a shared ``max_delta_step`` keeps its cheap branch); the binned data and
    labels are shared. On CPU (``MODELS_IN_A_LOOP_PLATFORMS``) a loop over the models
    (``_models_one_at_a_time``), elsewhere the round ``vmap``-ed over them.

    ``models_mesh`` (``devices.many_models_meshes``, CPU only): the models are split over its
    devices, equal shares (M a multiple of its size), each device looping over its own; the
    batched arguments and results are sharded along ``MODEL_AXIS``, the shared ones replicated."""
    treedef, leaf_axes = params_axes
    platform = mesh_platform(shape.mesh)
    if models_mesh is not None:
        batched = _models_one_at_a_time(round_function(shape, inside_models_mesh=True), leaf_axes)
        split, whole = PartitionSpec(MODEL_AXIS), PartitionSpec()
        params_specs = jax.tree_util.tree_unflatten(treedef, [split if axis == 0 else whole for axis in leaf_axes])
        eval_specs = tuple((whole, whole, whole, split) for _ in shape.metrics)
        per_eval = tuple(split for _ in shape.metrics)
        batched = jax.shard_map(
            batched, mesh=models_mesh, axis_names=frozenset({MODEL_AXIS}), check_vma=False,
            in_specs=(params_specs, whole, whole, whole, split, whole, split, split, whole, eval_specs, split),
            out_specs=(split, split, split, per_eval, per_eval, split))
    elif platform in MODELS_IN_A_LOOP_PLATFORMS:
        batched = _models_one_at_a_time(round_function(shape), leaf_axes)
    else:
        params_axes = jax.tree_util.tree_unflatten(treedef, leaf_axes)
        eval_axes = tuple((None, None, None, 0) for _ in shape.metrics)
        batched = jax.vmap(round_function(shape),
                           in_axes=(params_axes, None, None, None, 0, None, 0, 0, None, eval_axes, 0))
    return batched


def _models_one_at_a_time(round_function: Callable, params_leaf_axes: tuple) -> Callable:
    """``compiled_many_rounds``' batched round as a loop over the models (``lax.map``), each
    model's round the one ``jb.train`` runs. On CPU the round's cores are busy with one model
    already, and ``vmap`` cost more than it shared: the native kernels ran model after model into
    a batch buffer that was zeroed and copied into at every call, and the split scan's and the
    subtraction's loops, whose lengths differ between models, updated every model's histograms
    with a select at every step (16 models of 100k x 20 rows, 100 rounds: 0.66 s a model under
    vmap, 0.34 in the loop, 0.37-0.39 for one model alone).
    ``params_leaf_axes``: 0 for the RoundParams leaves stacked over the models, None for shared ones."""
    def rounds(params, X_binned_T, row_offsets, y, sample_weight, row_index, raw_prediction, seed_key,
               round_index, eval_sets, histogram_buffer):
        param_leaves, param_tree = jax.tree_util.tree_flatten(params)
        stacked = [leaf for leaf, axis in zip(param_leaves, params_leaf_axes) if axis == 0]

        def one_model(per_model):
            own_params, weight, raw, key, eval_raws, buffer = per_model
            own = iter(own_params)
            leaves = [next(own) if axis == 0 else leaf for leaf, axis in zip(param_leaves, params_leaf_axes)]
            own_sets = tuple(tuple(eval_set[:3]) + (eval_raw,) for eval_set, eval_raw in zip(eval_sets, eval_raws))
            return round_function(jax.tree_util.tree_unflatten(param_tree, leaves), X_binned_T, row_offsets, y,
                                  weight, row_index, raw, key, round_index, own_sets, buffer)

        eval_raws = tuple(eval_set[3] for eval_set in eval_sets)
        return jax.lax.map(one_model, (stacked, sample_weight, raw_prediction, seed_key, eval_raws, histogram_buffer))
    return rounds
