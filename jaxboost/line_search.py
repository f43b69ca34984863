"""A safeguarded 1-D minimiser, run for many segments (leaves) at once.

Solves, for every segment ``j`` of rows,

    c_j = argmin_c  sum_{i in j} w_i l(y_i, F_i + c) + penalty(c)

for a convex per-example loss and the leaf penalty of ``regularizer`` (elastic net plus any
custom convex penalty), using only the sign of the (sub)derivative: bracket the
minimiser by doubling steps away from 0, then bisect to float32 resolution (on accelerators,
several probes a step: doublings, then a bracket cut into many parts). It needs no Hessian,
so it is exact where Newton steps fail: absolute error, quantile and hinge losses, whose
Hessian is zero, get the exact weighted median / quantile of their residuals. Used for the
starting value (one segment holding every row, no penalty) and for leaf refits (THEORY.md, GBDT).
``newton_minimiser`` is its host-side counterpart for one variable, driven by a compiled round's
derivatives (a custom loss's starting value).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .devices import all_sum
from .fixed_point import fixed_point_segment_sum
from .native import SEGMENT_SUM_TARGET, as_varying_as, lowering_platform, native_target, per_platform
from .regularizer import Regularization, penalty_derivative
from .sums import row_sum

MAX_EXPANSIONS = 64
MAX_BISECTIONS = 64
# Smallest first step, in raw-prediction units, so a zero Newton estimate still moves.
MIN_FIRST_STEP = 1e-3
# Derivatives probed per segment and step where the code is lowered for an accelerator
# (``probes_per_step``): a step's cost there is its kernel launches and the loop's test on the
# host more than its rows. Absolute error's rounds on an H100, 400k rows: 11.3 ms a tree with
# one probe (bisection), 6.6 with 7, 6.2 with 15, 7.3 with 31.
ACCELERATOR_PROBES = 15


def segment_sums(per_row: jax.Array, segment_ids: jax.Array, num_segments: int,
                 deterministic: bool = False) -> jax.Array:
    """``jax.ops.segment_sum``; one segment (the starting value) is a sum over rows
    (``sums.row_sum``): a scatter compiles to a loop of its own and runs on one core. On CPU
    float32 rows go through a native kernel (``native.SEGMENT_SUM_TARGET``) that keeps four
    partial sums: XLA's scatter adds one row at a time, 30-odd times a round in a leaf refit.
    ``deterministic``: on accelerators the rows are summed as fixed-point integers, in a result
    that does not depend on the order of the atomic adds (the CPU's sums have one order anyway)."""
    if num_segments == 1:
        return row_sum(per_row)[None]

    def xla(values, ids):
        if deterministic and values.dtype == jnp.float32:
            return fixed_point_segment_sum(values, ids, num_segments)
        return jax.ops.segment_sum(values, ids, num_segments)

    target = native_target(SEGMENT_SUM_TARGET)
    if target is None or per_row.ndim != 1 or per_row.dtype != jnp.float32:
        return xla(per_row, segment_ids)

    def native(values, ids):
        result = jax.ShapeDtypeStruct((num_segments,), jnp.float32)
        return as_varying_as(jax.ffi.ffi_call(target, result, vmap_method="sequential")(values, ids), (values, ids))

    return per_platform(per_row, segment_ids.astype(jnp.int32), cpu=native, default=xla)


def probes_per_step() -> int:
    """Probes of each segment's derivative a step: one on CPU (bisection), ``ACCELERATOR_PROBES``
    where the code is lowered for an accelerator."""
    return 1 if lowering_platform() == "cpu" else ACCELERATOR_PROBES


def minimise_segment_offsets(weighted_derivative: Callable[[jax.Array], jax.Array], segment_ids: jax.Array,
                             num_segments: int, segment_weights: jax.Array, reg: Regularization,
                             axis_name: str | None = None, deterministic: bool = False) -> jax.Array:
    """The minimising offset of every segment.

    Args:
      weighted_derivative: ``offset_per_row -> w_i * l'(y_i, F_i + offset_i)``, shape ``(n,)``.
      segment_ids: int32 ``(n,)`` in ``[0, num_segments)``.
      segment_weights: ``(num_segments,)`` summed sample weights, to scale the first step.
      reg: the leaf penalty (use zeros for an unpenalised problem).
      axis_name: the mapped axis the rows are sharded over, if any.
      deterministic: sums that do not depend on the order of a GPU's atomic adds
        (``segment_sums``).

    Returns:
      float32 ``(num_segments,)``.
    """
    probes = probes_per_step()  # a bracket searched that many doublings a step, cut in that many + 1 parts

    def loss_derivative(offsets):
        """``offsets`` ``(num_segments, probes)`` -> each probe's summed derivative, same shape."""
        per_row_offsets = (jnp.broadcast_to(offsets[0], segment_ids.shape + offsets.shape[1:]) if num_segments == 1
                           else offsets[segment_ids])
        if probes == 1:  # the rows' derivatives as one vector: the CPU's native segment sum takes it
            sums = segment_sums(weighted_derivative(per_row_offsets[:, 0]), segment_ids, num_segments,
                                deterministic)[:, None]
        else:
            per_row = jax.vmap(weighted_derivative, in_axes=1, out_axes=1)(per_row_offsets)
            sums = segment_sums(per_row, segment_ids, num_segments, deterministic)
        return all_sum(sums, axis_name)

    zero = jnp.zeros(num_segments, jnp.float32)
    no_l1 = reg.replace(reg_alpha=jnp.float32(0))

    # One loop, one derivative per step for every segment: the first step probes 0, whose slope
    # sets each segment's direction and first probe; then a segment not yet bracketed probes
    # its far end (doubling it until the slope turns), a bracketed one bisects. Written once,
    # the derivative (the loss's autodiff and a segment sum) is traced and compiled once: the
    # probe at 0 had been a copy of its own before the loop. The segments' state is one array,
    # rows lower, upper, bracketed, direction and solved at 0 (flags as 0/1): XLA's CPU fusions
    # have one output each, and five outputs each recomputed the step's shared values. Together:
    # the starting value's program 141 -> 116 KB of LLVM IR (22 -> 16 modules), a refit round's
    # 121 -> 101 KB.
    # With several probes a step (accelerators, where a step's cost is its launches and the loop's
    # test on the host, not the rows), a segment not yet bracketed probes its far end and the
    # next doublings of it, a bracketed one cuts its bracket into probes + 1 parts: the new
    # bracket ends at the first probe past the minimiser. One probe is plain bisection.
    fractions = jnp.arange(1, probes + 1, dtype=jnp.float32) / (probes + 1)
    doublings = 2.0 ** jnp.arange(probes, dtype=jnp.float32)
    expansion_steps = -(-MAX_EXPANSIONS // probes)

    def step(state):
        segments, iteration = state
        lower, upper, bracketed, direction, solved_at_zero = segments
        bracketed, solved_at_zero = bracketed > 0, solved_at_zero > 0
        started = iteration >= 0
        # (segments, probes); with one probe, the cut is the bracket's middle, 0.5 * (lower + upper).
        cuts = lower[:, None] * (1.0 - fractions) + upper[:, None] * fractions
        probe = jnp.where(started, jnp.where(bracketed[:, None], cuts, upper[:, None] * doublings), 0.0)
        slope = loss_derivative(probe)

        # The first step: the smooth part of the slope at 0 (loss plus any custom penalty; L1
        # handled apart). 0 is optimal when the subdifferential there, slope +- alpha, holds 0.
        slope_at_zero = slope[:, 0] + penalty_derivative(zero, no_l1, zero)
        solved_first = jnp.abs(slope_at_zero) <= reg.reg_alpha
        direction_first = jnp.where(slope_at_zero > 0, -1.0, 1.0)  # towards the minimiser
        newton_estimate = (jnp.abs(slope_at_zero) - reg.reg_alpha) / (segment_weights + reg.reg_lambda + 1e-12)
        first_probe = jnp.maximum(jnp.nan_to_num(newton_estimate), MIN_FIRST_STEP) * direction_first

        # Later steps. ``direction`` picks the one-sided derivative of alpha |c| at c = 0.
        past_minimiser = (slope + penalty_derivative(probe, reg, direction[:, None])) * direction[:, None] >= 0
        if probes == 1:
            any_past, past_probe, before_past = past_minimiser[:, 0], probe[:, 0], lower
        else:
            any_past = jnp.any(past_minimiser, axis=1)
            first_past = jnp.argmax(past_minimiser, axis=1)[:, None]
            towards_zero = jnp.concatenate([lower[:, None], probe[:, :-1]], axis=1)  # each probe's neighbour
            past_probe = jnp.take_along_axis(probe, first_past, axis=1)[:, 0]
            before_past = jnp.take_along_axis(towards_zero, first_past, axis=1)[:, 0]
        last_probe = probe[:, -1]
        newly_bracketed = ~bracketed & (any_past | (iteration + 1 >= expansion_steps))
        lower_next = jnp.where(any_past, before_past, last_probe)
        upper_next = jnp.where(any_past, past_probe, jnp.where(bracketed, upper, 2.0 * last_probe))
        later = jnp.stack([lower_next, upper_next, (bracketed | newly_bracketed).astype(jnp.float32), direction,
                           solved_at_zero.astype(jnp.float32)])
        first = jnp.stack([zero, first_probe, solved_first.astype(jnp.float32), direction_first,
                           solved_first.astype(jnp.float32)])
        return jnp.where(started, later, first), iteration + 1

    def unresolved(state):
        segments, iteration = state
        lower, upper, bracketed, _, solved_at_zero = segments
        width = jnp.abs(upper - lower)
        scale = jnp.maximum(jnp.abs(lower), jnp.abs(upper))
        open_segments = (solved_at_zero == 0) & ((bracketed == 0) | (width > 2e-7 * scale + 1e-30))
        return (iteration < 0) | (jnp.any(open_segments) & (iteration < MAX_EXPANSIONS + MAX_BISECTIONS))

    start = jnp.stack([zero, zero, zero, jnp.ones(num_segments, jnp.float32), zero])
    (lower, upper, _, _, solved_at_zero), _ = lax.while_loop(unresolved, step, (start, -1))
    return jnp.where(solved_at_zero > 0, 0.0, 0.5 * (lower + upper))


# ``newton_minimiser`` ends when a step, or the bracket, is this small relative to the point
# (float32 resolution, as the bisection's bracket above).
HOST_RESOLUTION = 2e-7
# A slope summed from float32 gradients is rounding below this fraction of their magnitudes' sum
# (2 float32 epsilons): Newton steps end there (a custom loss's starting value: on the host, and
# in the program of several outputs', ``boosting.newton_constant``).
SLOPE_ROUNDING = 2 * float(np.finfo(np.float32).eps)


def newton_minimiser(derivative_sums: Callable[[float], tuple[float, float, float]]) -> float:
    """The minimiser of a convex function of one variable ``c``, from ``derivative_sums(c) ->
    (slope, curvature, slope_noise)``: ``curvature`` a positive scale of the slope's rate of
    change (exact for a smooth loss; any positive stand-in where it is zero), ``slope_noise``
    the size below which a slope is rounding (a float32 loss's: its per-row gradients' rounding;
    0 for exact slopes), where the search ends. Newton steps from 0, safeguarded by
    the slope's sign: until the slope turns, a step that does not halve the slope doubles the
    last one (at least ``MIN_FIRST_STEP``: a zero Newton step still moves); once the minimiser
    is bracketed, a Newton step that leaves the bracket or is not half the last step gives way
    to the secant of the bracket's slopes (``_illinois_secant``), and after a Newton step that
    does not halve the slope only the secant is left. It ends when the bracket, or a Newton step
    that halved the slope, falls to ``HOST_RESOLUTION`` of the point, or at a slope within its
    noise. A slope that is not finite counts as past the minimiser, so the search stays where
    the loss is defined (the bracket is then halved); one at 0 sends the search upwards, as the
    search in a program goes."""
    point = 0.0
    slope, curvature, noise = derivative_sums(point)
    if abs(slope) <= noise:
        return point
    if not math.isfinite(slope):  # upwards, as the search in a program goes
        slope, curvature = -math.inf, math.nan
    # The bracket's ends, slope < 0 at lower and > 0 at upper, and their slopes (NaN: unknown).
    bracket = [-math.inf, point, math.nan, slope] if slope > 0 else [point, math.inf, slope, math.nan]
    last_step, longest_step, trusted, last_moved, widths = 0.0, 0.0, True, None, []
    lower, upper = bracket[:2]
    for _ in range(MAX_EXPANSIONS + MAX_BISECTIONS):
        newton = point - slope / curvature if curvature > 0 and math.isfinite(curvature) else math.nan
        newton_length = abs(newton - point) if math.isfinite(newton) else 0.0
        towards = 1.0 if slope < 0 else -1.0
        stepped_newton = False
        if math.isinf(lower) or math.isinf(upper):
            stepped_newton = trusted and newton_length > 0.0
            length = newton_length if stepped_newton else max(newton_length, 2.0 * longest_step, MIN_FIRST_STEP)
            longest_step = max(longest_step, length)
            candidate = point + towards * length
        elif trusted and lower < newton < upper and newton_length <= 0.5 * abs(last_step):
            candidate, stepped_newton = newton, True
        elif len(widths) > 2 and upper - lower > 0.5 * widths[-3]:
            # The secants gain little where the slope is far from linear across the bracket
            # (Poisson's exponential: one end stayed put for 60 halvings of its slope).
            candidate = 0.5 * (lower + upper)
        else:
            candidate = _illinois_secant(*bracket)
        candidate_slope, candidate_curvature, noise = derivative_sums(candidate)
        if abs(candidate_slope) <= noise:
            return candidate
        defined = math.isfinite(candidate_slope)
        # Not finite: past the minimiser, seen from the last point.
        moved = 0 if (candidate_slope < 0 if defined else candidate < point) else 1
        bracket[moved], bracket[2 + moved] = candidate, candidate_slope if defined else math.nan
        # The same end moved twice running: the other end's slope is halved, so that the next
        # secant moves it (the Illinois rule; a plain secant can keep one end for ever).
        if moved == last_moved and not stepped_newton:
            bracket[3 - moved] *= 0.5
        last_moved = moved
        # A Newton step that does not halve the slope: the curvature misleads; secants from here.
        if stepped_newton and not abs(candidate_slope) <= 0.5 * abs(slope):
            trusted = False
        last_step = candidate - point
        if defined:
            point, slope, curvature = candidate, candidate_slope, candidate_curvature
        lower, upper = bracket[:2]
        widths.append(upper - lower)
        if math.isfinite(lower) and math.isfinite(upper) and (
                upper - lower <= HOST_RESOLUTION * max(abs(lower), abs(upper)) + 1e-30):
            return 0.5 * (lower + upper)
        # A Newton step this small that still halved the slope lands at the minimiser (an
        # overstated curvature's small steps do not halve it, and lose the Newton steps).
        if trusted and stepped_newton and defined and abs(last_step) <= HOST_RESOLUTION * abs(point) + 1e-30:
            return point
    return point


def _illinois_secant(lower: float, upper: float, lower_slope: float, upper_slope: float) -> float:
    """Where the line through the bracket's end slopes crosses 0 (regula falsi, superlinear
    with the Illinois rule, where bisection gains a bit a call); the middle where a slope is
    unknown (not finite). Against bisection, the calls of ``newton_minimiser``'s test cases:
    curvature overstated 10^4 times 35 -> 14, understated 38 -> 3, a loss undefined above 5
    26 -> 12, Poisson 28 -> 21; a weighted median's steps of slope 30 -> 34."""
    middle = 0.5 * (lower + upper)
    if not (math.isfinite(lower_slope) and math.isfinite(upper_slope)):
        return middle
    crossing = lower - lower_slope * (upper - lower) / (upper_slope - lower_slope)
    return crossing if lower < crossing < upper else middle
