"""Split scan: the best split of every node from its histogram, by cumulative sums over bins.

For each node, feature and threshold bin ``b`` the left child holds the value bins ``<= b``;
rows with a missing value go left or right, whichever gives the larger ``loss_chg`` (the
learned default direction). Candidates whose children fall below ``min_child_weight`` (or hold
no Hessian mass) or whose feature is not sampled are excluded. Ties prefer the lower feature,
then "missing goes left", then the lower bin.

Monotone constraints (XGBoost's semantics): every node carries bounds on its value; children
values are clipped to the parent's bounds, gains are scored at the clipped values, and a split
on a feature constrained to increase (decrease) is excluded when the left child's value is above
(below) the right child's. A per-feature ``split_cost`` of the regularizer is subtracted from
every gain.

Vector leaves (``leaves``, one tree for K outputs): every histogram cell holds K gradient sums
and the packed Hessian sums (``VectorLeaves``); each child's value vector and score come from
``vector_value_and_score``, and ``min_child_weight`` applies to every output's Hessian sum.
The gradient and Hessian fields of the choice then carry those channels on a trailing axis.

On a CPU a native kernel scans a whole level in one call (``_native_scan``), with the same
arithmetic: scalar leaves without a custom penalty, and full-Hessian vector leaves without
monotone constraints.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .devices import axis_devices, in_steps_on_cpu, update_leading_chunks
from .histogram import cumulative_over_bins, first_maximum, top_after
from .native import (SCALAR_SPLIT_SCAN_TARGET, VECTOR_SPLIT_SCAN_TARGET, as_varying_as, available_native_target,
                     per_platform)
from .regularizer import (MAX_FULL_TO_DIAGONAL_SCORE, PSD_TOLERANCE, Regularization, VectorLeaves, leaf_value,
                          leaf_value_range, node_score, node_score_bounds, node_score_lower_bound, split_loss_change,
                          split_values_and_loss_change, value_and_score, vector_value_and_score)


class SplitChoice(NamedTuple):
    """The best split of each node of a level; every field has shape ``(num_nodes,)``, with a
    trailing channel axis for the statistics and values of vector leaves."""

    loss_change: jax.Array  # -inf where no candidate is valid
    feature: jax.Array  # int32
    threshold_bin: jax.Array  # int32: value bins <= threshold_bin go left
    default_left: jax.Array  # bool: where missing values go
    left_gradients: jax.Array
    left_hessians: jax.Array
    right_gradients: jax.Array
    right_hessians: jax.Array
    # The children's leaf values within the node's bounds (no learning rate), for monotone
    # constraints; zeros without them, or where the caller solves them (``children_values``).
    left_value: jax.Array
    right_value: jax.Array


class NodeBounds(NamedTuple):
    """Monotone constraints of one level: per-feature directions and per-node value bounds."""

    monotone: jax.Array  # int32 (n_features,): +1 increasing, -1 decreasing, 0 free
    lower: jax.Array  # (num_nodes,)
    upper: jax.Array  # (num_nodes,)


def hessian_mass(sum_hessians: jax.Array, leaves: VectorLeaves | None) -> jax.Array:
    """A node's Hessian sum as one number: for vector leaves, the trace."""
    return sum_hessians if leaves is None else jnp.sum(leaves.diagonal(sum_hessians), axis=-1)


# A node is left out of the split scan when its Hessian weight falls below twice
# ``min_child_weight`` by more than this fraction: its rows' Hessians then leave no candidate
# whose two children both hold ``min_child_weight``. The slack covers the scan's per-feature
# totals differing from the node's own sum in their last bits (the same rows summed in another
# order), so a node that some candidate can split is always scanned.
SPLITTABLE_SLACK = 1e-3


def splittable(sum_hessians: jax.Array, leaves: VectorLeaves | None, min_child_weight: jax.Array) -> jax.Array:
    """Whether a node with Hessian sums ``sum_hessians`` (``(nodes,)``, or ``(nodes, channels)``
    for vector leaves) may have a valid split: some output's Hessian weight, the one that
    ``find_best_splits`` holds to ``min_child_weight`` (the smallest diagonal entry for vector
    leaves), under twice ``min_child_weight``, or none at all, rules every candidate out. On
    small data most nodes of the deep levels are such (8 rows of a logistic loss at
    ``min_child_weight`` 1), and their chunks of the scan are skipped."""
    return _weight_at_least(sum_hessians, leaves, min_child_weight, 2)


def children_splittable(sum_hessians: jax.Array, leaves: VectorLeaves | None,
                        min_child_weight: jax.Array) -> jax.Array:
    """Whether a child of a node with Hessian sums ``sum_hessians`` may be ``splittable`` once
    the node splits: not where the node's weight is under three times ``min_child_weight``, as
    each child's is then under twice it (its sibling holds at least ``min_child_weight``). Such
    a split builds its children no histograms. (Testing the children's own weights instead made
    the trees' program 3% larger, for no faster trees on small data.)"""
    return _weight_at_least(sum_hessians, leaves, min_child_weight, 3)


def _weight_at_least(sum_hessians: jax.Array, leaves: VectorLeaves | None, min_child_weight: jax.Array,
                     multiple: int) -> jax.Array:
    """A positive weight of at least ``multiple`` times ``min_child_weight``, less the slack."""
    weight = sum_hessians if leaves is None else jnp.min(leaves.diagonal(sum_hessians), axis=-1)
    # The weights are scaled, not min_child_weight: a product of the traced parameter alone is a
    # kernel of its own in the trees' program, each one more module to compile.
    scale = np.float32(1 / (multiple * (1 - SPLITTABLE_SLACK)))
    return (weight > 0) & (weight * scale >= min_child_weight)


def _unravel_valid_index(flat: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """``jnp.unravel_index`` of indices known to lie in ``[0, prod(shape))``, as uint32."""
    flat = flat.astype(jnp.uint32)
    indices = []
    for size in reversed(shape[1:]):
        indices.append(lax.rem(flat, jnp.uint32(size)))
        flat = lax.div(flat, jnp.uint32(size))
    return (flat, *reversed(indices))


# Candidates a node that a custom penalty's split scan solves exactly in a batch
# (_best_of_contenders), and the rounding allowed for in its bounds, relative to the sizes of
# their terms (float32's epsilon is 1.2e-7). With one node a step (20k rows, depth 6, ms a
# round): batches of 15 took 6.9-7.0 unbounded but 11.9-13.5 under monotone constraints, where
# some nodes need hundreds of candidates solved; 63, 7.6-8.3 and 10.0-10.7; 31, 7.1-7.4 and
# 10.4-11.5. (With two nodes a step, 127 and 255 had been slower than 63.)
CONTENDERS_PER_NODE = 31  # top_k of 32
BOUND_ROUNDING = 1e-5


def monotone_allows(direction: jax.Array, left_value: jax.Array, right_value: jax.Array) -> jax.Array:
    """Whether a split's children's values keep its feature's monotone ``direction`` (+1 the
    right child's value at least the left's, -1 at most, 0 either)."""
    return ~((direction > 0) & (left_value > right_value)) & ~((direction < 0) & (left_value < right_value))


def _best_of_contenders(lefts: list, children: Callable, node_sums: tuple[jax.Array, jax.Array],
                        split_cost: jax.Array, reg: Regularization,
                        bounds: NodeBounds | None = None) -> tuple[jax.Array, jax.Array]:
    """``first_maximum`` of a custom penalty's gains ``(K, d, dirs, B-1)``, solving few of them.

    Every candidate's gain is first bounded above cheaply (``node_score_bounds``: one tangent of
    the penalty a side, where the exact gain takes Newton steps until the slowest candidate
    settles). The candidates are then solved in batches of CONTENDERS_PER_NODE a node, in the
    order of their bounds, as the full scan solves them, until the highest bound left unsolved
    is below the best gain solved (no candidate left can reach it) or none is left; the first
    of the maximum wins. The first batch mostly settles a node: in a 10-round fit of 20k rows,
    572 of 593 nodes (a quadratic penalty) and 587 of 592 (smooth L1), the rest in 2 to 12
    batches; under monotone constraints, 536 of 584 and 550 of 582, a few in up to 109 and 165.
    Where it did not, every candidate had been solved (the full scan): its code and its loops
    of Newton steps made a third of a first fit's compile and, for a smooth L1, two thirds of a
    round. A candidate that repeats the one before it is never needed. The same split and gain
    as the full scan (gains that are not numbers, from a penalty that is not finite everywhere,
    never win). The penalty must be convex, as ``jb.regularizers.custom`` asks. With monotone
    ``bounds``, the gains' bounds take the leaf values within each node's bounds, a candidate
    whose children's value ranges certainly break its feature's direction is left unsolved, and
    a solved one whose children's values break it counts as not valid, as in the full scan.

    ``node_sums``: the node's gradient and Hessian sums as each feature's bins total them
    ``(K, d, 1)``. The node's scores from them are solved in each batch's call: the bounds take
    a lower bound of them (``node_score_lower_bound``), and once solved, the highest bound left
    unsolved is lowered by the least of the node's features' differences between the two. A
    call of their own had been one more loop of Newton steps to compile and to run at every
    chunk of nodes (smooth L1, 20k rows: 2.6 ms of a round's XLA time, against 2.9 for the
    contenders')."""
    num_nodes = node_sums[0].shape[0]
    # (K, d, dirs, B-1), as the full scan lays out its gains (``children`` of each direction's
    # left sums ``lefts``).
    left_gradients, left_hessians, right_gradients, right_hessians, valid = (
        jnp.stack(parts, axis=2) for parts in zip(*(children(left) for left in lefts)))
    cost = split_cost[:, :, :, None] if split_cost.ndim == 3 else split_cost  # (1, d, 1) per feature
    value_lower = value_upper = None
    if bounds is not None:
        value_lower, value_upper = bounds.lower[:, None, None, None], bounds.upper[:, None, None, None]
    parent_gradients, parent_hessians = (sums[:, :, :, None] for sums in node_sums)  # (K, d, 1, 1)
    parent = node_score_lower_bound(parent_gradients, parent_hessians, reg, value_lower, value_upper)
    if bounds is not None:
        # A candidate whose children's values certainly break its feature's direction (their
        # ranges apart, the wrong way round) needs no solving: the full scan finds it not valid.
        # Strong splits against a constraint had topped the bounds and sent most chunks to the
        # full scan, when the contenders had one batch.
        left_low, left_high = leaf_value_range(left_gradients, left_hessians, reg, value_lower, value_upper)
        right_low, right_high = leaf_value_range(right_gradients, right_hessians, reg, value_lower, value_upper)
        direction = bounds.monotone[None, :, None, None]
        valid = valid & ~(((direction > 0) & (left_low > right_high)) | ((direction < 0) & (left_high < right_low)))
    left_upper, left_size = node_score_bounds(left_gradients, left_hessians, reg, value_lower, value_upper)
    right_upper, right_size = node_score_bounds(right_gradients, right_hessians, reg, value_lower, value_upper)
    margin = BOUND_ROUNDING * (left_size + right_size + jnp.abs(parent) + jnp.abs(cost))
    upper = (left_upper + right_upper - parent - cost + margin).reshape(num_nodes, -1)
    valid = jnp.broadcast_to(valid, left_gradients.shape).reshape(num_nodes, -1)
    # A candidate past an empty bin repeats the one before it, sums and gain, and the first of
    # the two wins their tie: the repeats need no solving (a node of few rows has runs of them).
    # Each is compared with the running sums shifted by a bin behind a row of NaN (equal to
    # nothing). Compared in the candidates' layout instead, as shifted slices joined to a first
    # column, the fusion that computes the bounds ran about 2.3x slower (215 against 95 us a
    # chunk of 2 nodes).
    previous_gradients, previous_hessians = (
        jnp.stack(parts, axis=2) for parts in zip(*(
            children(jnp.concatenate([jnp.full_like(left[..., :1, :], jnp.nan), left[..., :-1, :]], axis=-2))[:2]
            for left in lefts)))
    repeats = ((left_gradients == previous_gradients) & (left_hessians == previous_hessians)).reshape(num_nodes, -1)
    # -inf for the candidates that need no solving, +inf where a bound is NaN (solved first).
    key = jnp.where(valid & ~repeats, jnp.where(jnp.isnan(upper), jnp.inf, upper), -jnp.inf)
    num_candidates = key.shape[1]
    width = CONTENDERS_PER_NODE + 1
    if num_candidates < width:
        # Fewer candidates than a batch: slots past them, never valid, fill it.
        key = jnp.pad(key, ((0, 0), (0, width - num_candidates)), constant_values=-jnp.inf)
    nodes = jnp.arange(num_nodes)[:, None]
    # The first M of a batch are solved; the last one's bound is the highest left unsolved.
    solved_slot = jnp.arange(width) < CONTENDERS_PER_NODE
    node_lower, node_upper = (None, None) if bounds is None else (bounds.lower[:, None], bounds.upper[:, None])

    def batch(state):
        _, _, best, best_value, last_key, last_candidate = state
        # The next M + 1 candidates after the last one solved: bound descending, then the
        # lower index first.
        chosen, bound = top_after(key, last_key, last_candidate, width)  # (K, M + 1)

        def at_chosen(array):
            # (A padding slot reads the last candidate: not counted.)
            return jnp.broadcast_to(array, left_gradients.shape).reshape(num_nodes, -1)[
                nodes, jnp.minimum(chosen, num_candidates - 1)]

        # One solve: the batch's two sides and the node's score by each feature's totals.
        values, scores = value_and_score(
            jnp.concatenate([at_chosen(left_gradients), at_chosen(right_gradients), node_sums[0][:, :, 0]], axis=1),
            jnp.concatenate([at_chosen(left_hessians), at_chosen(right_hessians), node_sums[1][:, :, 0]], axis=1),
            reg, node_lower, node_upper)
        left_value, right_value = values[:, :width], values[:, width:2 * width]
        parent_score = scores[:, 2 * width:, None, None]  # (K, d, 1, 1), as node_score gives it
        loss_change = scores[:, :width] + scores[:, width:2 * width] - at_chosen(parent_score)
        counted = solved_slot & (bound > -jnp.inf) & ~jnp.isnan(loss_change)
        if bounds is not None:
            counted = counted & monotone_allows(at_chosen(bounds.monotone[None, :, None, None]), left_value,
                                                right_value)
        gains = jnp.where(counted, loss_change - at_chosen(cost), -jnp.inf)
        # The batch's first maximum (the lowest index at it), kept if it beats the best so far or
        # ties it at a lower index: first_maximum's choice over the candidates solved.
        batch_value = jnp.max(gains, axis=1)
        batch_best = jnp.min(jnp.where((gains == batch_value[:, None]) & counted, chosen, num_candidates), axis=1)
        better = (batch_value > best_value) | ((batch_value == best_value) & (batch_best < best))
        best = jnp.where(better, batch_best, best).astype(jnp.int32)
        best_value = jnp.where(better, batch_value, best_value)
        # The unsolved candidates' bounds, with the node's solved scores in place of their lower
        # bound: none can reach the best gain (a tie would need a lower index), or none is left.
        # (Read by reductions over the slots: with its indices sliced, XLA's CPU compiler made
        # top_k, where it serves, a whole sort of the candidates.)
        highest_unsolved = jnp.max(jnp.where(solved_slot, -jnp.inf, bound), axis=1)
        next_bound = highest_unsolved - jnp.min((parent_score - parent).reshape(num_nodes, -1), axis=1)
        settled = (next_bound < best_value) | (highest_unsolved == -jnp.inf)
        last_solved = jnp.arange(width) == CONTENDERS_PER_NODE - 1
        last_key = jnp.max(jnp.where(last_solved, bound, -jnp.inf), axis=1)
        last_candidate = jnp.max(jnp.where(last_solved, chosen, -1), axis=1).astype(jnp.int32)
        return jnp.all(settled), state[1] + 1, best, best_value, last_key, last_candidate

    def unsettled(state):
        # Every batch takes M more candidates of each node: at most all of them.
        return ~state[0] & (state[1] * CONTENDERS_PER_NODE < num_candidates)

    # With no valid candidate: index 0 and -inf, as first_maximum gives.
    start = (jnp.bool_(False), jnp.int32(0), jnp.zeros(num_nodes, jnp.int32), jnp.full(num_nodes, -jnp.inf),
             jnp.full(num_nodes, jnp.inf), jnp.full(num_nodes, -1, jnp.int32))
    _, _, best, best_value, _, _ = jax.lax.while_loop(unsettled, batch, start)
    return best, best_value


def find_best_splits(histograms: jax.Array, feature_allowed: jax.Array, reg: Regularization,
                     min_child_weight: jax.Array, bounds: NodeBounds | None = None,
                     leaves: VectorLeaves | None = None, missing_values: bool = True,
                     prune: bool = True, children_values: bool = True) -> SplitChoice:
    """Best split per node.

    Args:
      histograms: float32 ``(num_nodes, n_features, max_bin, channels)``: gradient and Hessian
        sums (2 channels, or the ``leaves`` layout, which may be followed by a zero channel
        padding it to the kernels' pairs); the last bin holds the missing values.
      feature_allowed: bool ``(num_nodes, n_features)`` (column sampling, interaction
        constraints).
      bounds: monotone constraints, or None when there are none (scalar leaves only).
      leaves: the vector-leaf layout, or None for scalar leaves.
      missing_values: False when no training row has a missing value. Every missing bin is then
        empty, both directions score exactly alike, and only "missing goes left" (the tie rule's
        choice) is scanned: the same split for half the candidates.
      prune: for a custom penalty (scalar leaves), solve only the candidates that
        can win (``_best_of_contenders``); False: every candidate. The same split either way.
      children_values: False: with ``bounds``, the winner's children's values are left zeros,
        for a caller that solves them itself (the grower, a custom penalty's in its level's
        solve: each call of the Newton steps is a loop of its own to compile).
    """
    num_nodes, n_features, max_bin, _ = histograms.shape
    n_value_bins = max_bin - 1
    value_cumsum = cumulative_over_bins(histograms)[:, :, :n_value_bins, :]  # (K, d, B-1, C)
    missing = histograms[:, :, n_value_bins, :][:, :, None, :]  # (K, d, 1, C)
    # Per-feature node totals (rather than totals passed in) make an empty side exactly zero.
    node_total = value_cumsum[:, :, -1:, :] + missing
    K = 1 if leaves is None else leaves.num_outputs

    def channels(sums):
        """(gradients, hessians, weight for min_child_weight) of ``(..., C)`` sums."""
        if leaves is None:
            return sums[..., 0], sums[..., 1], sums[..., 1]
        hessians = sums[..., K:K + leaves.hessian_channels]  # past them: a zero channel padding to pairs
        return sums[..., :K], hessians, jnp.min(leaves.diagonal(hessians), axis=-1)

    lower = upper = None
    if bounds is not None:
        lower, upper = bounds.lower[:, None, None], bounds.upper[:, None, None]
    split_cost = jnp.asarray(reg.split_cost)
    split_cost = split_cost[None, :, None] if split_cost.ndim == 1 else split_cost

    def vector_children(left_gradients, left_hessians, right_gradients, right_hessians, active=None):
        """Both children's vector leaf values and scores, stacked (left first): one call, as each
        step of the element-wise solve is a fused loop of its own (half the loops of a tree, and
        half the code to compile). ``active``: the (left, right) candidates whose scores are read."""
        return vector_value_and_score(jnp.stack([left_gradients, right_gradients]),
                                      jnp.stack([left_hessians, right_hessians]), reg, leaves, active)

    def children(left: jax.Array) -> tuple[jax.Array, ...]:
        """The candidates' (left gradients, left Hessians, right gradients, right Hessians)
        from the left children's running sums ``left``, and whether each is a valid split."""
        left_gradients, left_hessians, left_weight = channels(left)
        right_gradients, right_hessians, right_weight = channels(node_total - left)
        valid = (feature_allowed[:, :, None]
                 & (left_weight >= min_child_weight) & (right_weight >= min_child_weight)
                 & (left_weight > 0) & (right_weight > 0))
        return left_gradients, left_hessians, right_gradients, right_hessians, valid

    def gains(left: jax.Array, parent_score: jax.Array | None) -> jax.Array:
        """``loss_chg`` of every threshold ``(K, d, B-1)`` (-inf where the candidate is not
        allowed) from the left children's running sums ``left``, missing values sent one way
        (a leading axis: several ways), and the node's scores ``(K, d, 1)`` (None: vector
        leaves). Each direction is computed whole, so the children's sums are never stored for
        every candidate: the winner's are recomputed below."""
        left_gradients, left_hessians, right_gradients, right_hessians, valid = children(left)
        if leaves is not None:
            # Only valid candidates' scores are read, and the last left side's (the node's own).
            node_itself = jnp.arange(valid.shape[-1]) == valid.shape[-1] - 1
            _, scores = vector_children(left_gradients, left_hessians, right_gradients, right_hessians,
                                        jnp.stack([valid | node_itself, valid]))
            # The last candidate is the node itself (below): its left side's score is the parent's.
            loss_change = scores[0] + scores[1] - scores[0][..., -1:]
            return jnp.where(valid, loss_change - split_cost, -jnp.inf)[..., :-1]
        elif bounds is None:
            loss_change = split_loss_change(left_gradients, left_hessians, right_gradients, right_hessians, reg,
                                            parent_score)
        else:
            left_value, right_value, loss_change = split_values_and_loss_change(
                left_gradients, left_hessians, right_gradients, right_hessians, reg, parent_score, lower, upper)
            valid = valid & monotone_allows(bounds.monotone[None, :, None], left_value, right_value)
        return jnp.where(valid, loss_change - split_cost, -jnp.inf)

    # Direction axis: index 0 sends missing values left, index 1 sends them right.
    directions = (True, False) if missing_values else (True,)
    lefts = [value_cumsum + missing if missing_goes_left else value_cumsum for missing_goes_left in directions]
    if leaves is not None:
        # Vector leaves: the node's own score comes from the candidates' solve, as one more
        # candidate that sends every row left (its empty right side makes it invalid). Each
        # traced copy of the vector solve adds about a second of compile at K = 10.
        lefts = [jnp.concatenate([left, node_total], axis=2) for left in lefts]
    # (K, d, dirs, B-1), or (K, d, B-1) for one direction; first_maximum reads it as it is
    # (see there: merged into one axis, the gains were not vectorised).
    def scanned():
        # The node's score by each feature's totals (K, d, 1).
        parent_score = None if leaves is not None else node_score(*channels(node_total)[:2], reg, lower, upper)
        if not missing_values:
            loss_change = gains(lefts[0], parent_score)
        elif leaves is not None:
            # Vector leaves: both directions in one solve (see vector_children).
            loss_change = jnp.moveaxis(gains(jnp.stack(lefts), parent_score), 0, 2)
        else:
            loss_change = jnp.stack([gains(left, parent_score) for left in lefts], axis=2)
        return first_maximum(loss_change)

    if leaves is None and reg.penalty is not None and prune:
        # On a CPU; elsewhere the full scan, as before (a GPU's loop whose length is traced
        # reads its condition back to the host, not measured against the solves it would save).
        best, best_value = per_platform(
            cpu=lambda: _best_of_contenders(lefts, children, channels(node_total)[:2], split_cost, reg, bounds),
            default=scanned)
    else:
        best, best_value = scanned()
    # The flat index is a valid one (0 <= best < its size): unsigned, its unravelling and the
    # gathers below skip jnp's handling of negative and out-of-range indices, code that every
    # fusion reading the winner had repeated.
    feature, direction, threshold_bin = _unravel_valid_index(best, (n_features, len(directions), n_value_bins))

    # The winner's children, recomputed from the running sums exactly as the scan formed them.
    nodes = jnp.arange(num_nodes, dtype=jnp.uint32)
    missing_goes_left = direction == 0
    left_sums = value_cumsum[nodes, feature, threshold_bin] + jnp.where(missing_goes_left[:, None],
                                                                        missing[nodes, feature, 0], 0.0)
    right_sums = node_total[nodes, feature, 0] - left_sums
    left_gradients, left_hessians, _ = channels(left_sums)
    right_gradients, right_hessians, _ = channels(right_sums)
    if bounds is not None and children_values:
        # Both in one call: a custom penalty's every call is a loop of Newton steps to compile.
        left_value, right_value = leaf_value(jnp.stack([left_gradients, right_gradients]),
                                             jnp.stack([left_hessians, right_hessians]), reg, bounds.lower,
                                             bounds.upper)
    else:
        # Only monotone constraints read them; the grower solves vector leaves' values itself.
        left_value = right_value = jnp.zeros((num_nodes,) if leaves is None else (num_nodes, K))
    return SplitChoice(
        loss_change=best_value,
        feature=feature.astype(jnp.int32),
        threshold_bin=threshold_bin.astype(jnp.int32),
        default_left=missing_goes_left,
        left_gradients=left_gradients,
        left_hessians=left_hessians,
        right_gradients=right_gradients,
        right_hessians=right_hessians,
        left_value=left_value,
        right_value=right_value,
    )


def _empty_choice(num_nodes: int, leaves: VectorLeaves | None) -> SplitChoice:
    """A zeroed ``SplitChoice`` with ``find_best_splits``'s shapes (spelled out: tracing the scan
    once more just for its shapes cost a tenth of a second at every first fit)."""
    def floats(width):
        return jnp.zeros((num_nodes,) if leaves is None else (num_nodes, width), jnp.float32)

    K = None if leaves is None else leaves.num_outputs
    hessian_width = None if leaves is None else leaves.hessian_channels
    return SplitChoice(
        loss_change=jnp.zeros(num_nodes, jnp.float32), feature=jnp.zeros(num_nodes, jnp.int32),
        threshold_bin=jnp.zeros(num_nodes, jnp.int32), default_left=jnp.zeros(num_nodes, bool),
        left_gradients=floats(K), left_hessians=floats(hessian_width), right_gradients=floats(K),
        right_hessians=floats(hessian_width), left_value=floats(K), right_value=floats(K))


# Bytes of histogram cells scanned per step. A step's histograms, their running sums and its
# gains stay in a core's L2 cache this way; steps of 8 or 32 nodes of 28 features (0.5-1.8 MB of
# cells) spilled to L3, and a depth-6 tree of 10k rows took 2.8 against 1.9 ms a tree with steps
# of 2 nodes (medians of 6 runs; depth 10: 10.8 against 7.0 ms; 800k rows on 2 devices, 14
# features each: 24.2 against 24.0).
SCAN_CHUNK_BYTES = 128 * 1024


def scan_chunk_nodes(num_slots: int, cells_per_node: int, budget_bytes: int = SCAN_CHUNK_BYTES) -> int:
    """Slots per step of the split scan of a level held in ``num_slots`` slots whose histograms
    hold ``cells_per_node`` float32 cells a node: the largest power of two whose cells fit in
    ``budget_bytes`` (at least 1, at most ``num_slots``, a power of two too)."""
    fitting = max(1, budget_bytes // (4 * max(cells_per_node, 1)))
    return min(1 << (fitting.bit_length() - 1), num_slots)


def _packed_choice(choice: SplitChoice) -> jax.Array:
    """``choice``'s fields side by side in one float32 ``(nodes, channels)`` array: integers and
    flags travel exactly as float32 (< 2^24). One array is one collective to gather, or one
    slice update to write: a write per field had been a fusion per field, each recomputing the
    fields' shared values (XLA's CPU fusions have one output each)."""
    num_nodes = choice.feature.shape[0]
    return jnp.concatenate([field.reshape(num_nodes, -1).astype(jnp.float32) for field in choice], axis=1)


def _unpacked_choice(packed: jax.Array, template: SplitChoice) -> SplitChoice:
    """The ``SplitChoice`` that ``_packed_choice`` packed, with ``template``'s shapes and dtypes
    (its node count may differ)."""
    num_nodes = packed.shape[0]
    fields, start = [], 0
    for field in template:
        width = math.prod(field.shape[1:])
        part = packed[:, start:start + width]
        fields.append(part.reshape((num_nodes,) + field.shape[1:]).astype(field.dtype))
        start += width
    return SplitChoice(*fields)


def find_best_splits_of_live_nodes(histograms: jax.Array, feature_allowed: jax.Array, reg: Regularization,
                                   min_child_weight: jax.Array, bounds: NodeBounds | None = None,
                                   leaves: VectorLeaves | None = None, live_nodes: jax.Array | None = None,
                                   missing_values: bool = True, active: jax.Array | None = None,
                                   kernel: str = "auto", children_values: bool = True) -> SplitChoice:
    """``find_best_splits`` for the first ``live_nodes`` node slots only (traced; None: all),
    and of those, when ``active`` (bool, one flag per slot) is given, for the chunks that hold
    an active node.

    On a CPU, scalar leaves without a custom penalty, and full-Hessian vector leaves without
    monotone constraints, are scanned by one native kernel for the whole level (``_native_scan``);
    ``kernel`` as for ``histogram.build_histogram``. Otherwise, in XLA:

    A level's node arrays are sized for the widest level that shares its compiled loop, so the
    root's level holds 1 live node in 32 slots. The scan runs over ``scan_chunk_nodes`` slots at
    a time (a custom penalty's: one), as many times as the live (and active) nodes need; the other slots get zeros (no
    split). Each chunk cuts its own nodes out in one slice, so the slots that are not live are
    never copied. A deep level of a tree grown on few rows has most of its slots empty: their
    chunks are skipped (with the kernel's and the subtraction's skips, a depth-10 tree of 10k
    rows took 11.5 ms instead of 19.1). Off the CPU every slot is scanned in one step
    (``in_steps_on_cpu``); the choices in the slots of nodes that are not active are never taken as splits.
    """
    num_nodes = histograms.shape[0]
    target = _native_scan_target(leaves, bounds, reg, kernel)
    if target is not None:
        scanned = jnp.ones(num_nodes, bool) if live_nodes is None else jnp.arange(num_nodes) < live_nodes
        if live_nodes is not None and active is not None:
            scanned = scanned & active

        def native():
            return _native_scan(target, histograms, feature_allowed, reg, min_child_weight, leaves, scanned,
                                missing_values, bounds)

        def xla():
            return find_best_splits_of_live_nodes(histograms, feature_allowed, reg, min_child_weight, bounds, leaves,
                                                  live_nodes, missing_values, active, kernel="xla",
                                                  children_values=children_values)

        return per_platform(cpu=native, default=xla)

    chunk = scan_chunk_nodes(num_nodes, math.prod(histograms.shape[1:]))
    if leaves is None and reg.penalty is not None:
        # A custom penalty's contenders: one node a step, as a step's batches run until every
        # node in it is settled, so each node takes the batches it needs and no more (20k rows
        # x 28 features, depth 6: under monotone constraints 10.2-10.7 against 12.3-16.1 ms a
        # round with 2 nodes a step, and the same or less unbounded and on 4 to 100 features;
        # 8 nodes a step took 2.5-4x the time under monotone constraints).
        chunk = 1

    def scan_nodes(start, count):
        def cut(per_node):
            return jax.lax.dynamic_slice_in_dim(per_node, start, count)

        node_bounds = None if bounds is None else bounds._replace(lower=cut(bounds.lower), upper=cut(bounds.upper))
        return find_best_splits(cut(histograms), cut(feature_allowed), reg, min_child_weight, node_bounds, leaves,
                                missing_values, children_values=children_values)

    if live_nodes is None or num_nodes <= chunk or num_nodes % chunk:
        return scan_nodes(0, num_nodes)

    def in_steps():
        empty = _empty_choice(num_nodes, leaves)
        packed = update_leading_chunks(_packed_choice(empty), lambda start: _packed_choice(scan_nodes(start, chunk)),
                                       live_nodes, chunk, active)
        return _unpacked_choice(packed, empty)

    return in_steps_on_cpu(in_steps, lambda: scan_nodes(0, num_nodes))


def _native_scan_target(leaves: VectorLeaves | None, bounds: NodeBounds | None, reg: Regularization,
                        kernel: str) -> str | None:
    """The FFI target of the native scan where one applies: scalar leaves without a custom
    penalty, or full-Hessian vector leaves without monotone bounds."""
    if leaves is None:
        if reg.penalty is not None:
            return None
        return available_native_target(SCALAR_SPLIT_SCAN_TARGET, "scalar split-scan", kernel)
    if not leaves.full_hessian or bounds is not None:
        return None
    return available_native_target(VECTOR_SPLIT_SCAN_TARGET, "vector split-scan", kernel)


def _native_scan(target: str, histograms: jax.Array, feature_allowed: jax.Array, reg: Regularization,
                 min_child_weight: jax.Array, leaves: VectorLeaves | None, scanned: jax.Array,
                 missing_values: bool, bounds: NodeBounds | None = None) -> SplitChoice:
    """``find_best_splits`` of the ``scanned`` nodes of a level by a native kernel, the whole
    level in one call; the nodes not scanned get ``_empty_choice``'s zeros.

    Scalar leaves: the kernel follows ``node_score``'s closed form, or with ``max_delta_step >
    0`` or monotone ``bounds`` its value at the clipped leaf value (with bounds, the candidates
    whose children's values go against their feature's direction are not valid, and the
    winner's children's values come back). A node whose bins mostly hold no row (under half of
    them held with one direction, two thirds with two: a node of fewer than about 175 or 280
    rows in 256 bins) is scanned at the bins that do: the others' candidates repeat the one
    before them. As XLA code a level took a step per two nodes, each some ten operations
    whose fixed costs were most of a round at small data (200 training rows: 0.31-0.33 against
    0.26 ms a round).

    Full-Hessian vector leaves: the kernel follows the scan's and ``vector_value_and_score``'s
    arithmetic (the regularizer's constants come from there). As XLA code, each node's step
    around the native solve copied its histogram, running sums and candidates' sides into arrays
    of their own: at 10 outputs about half of the scan's time."""
    num_nodes, n_features = histograms.shape[:2]
    # Scalar leaves' sides come back with their values: (gradient, Hessian, value).
    width = 3 if leaves is None else leaves.num_outputs + leaves.hessian_channels
    split_cost = jnp.broadcast_to(jnp.asarray(reg.split_cost, jnp.float32), (n_features,))
    # A max_delta_step known to be unused reads as 0: the closed form, as node_score takes it.
    max_delta_step = 0.0 if reg.bounds_leaves is False else reg.max_delta_step
    per_node = [jnp.broadcast_to(jnp.asarray(value, jnp.float32), (num_nodes,))
                for value in (reg.reg_lambda, reg.reg_alpha, max_delta_step, min_child_weight)]
    if bounds is None:
        per_node += [jnp.full(num_nodes, -jnp.inf), jnp.full(num_nodes, jnp.inf)]
    else:
        per_node += [bounds.lower.astype(jnp.float32), bounds.upper.astype(jnp.float32)]
    operands = (histograms.astype(jnp.float32), feature_allowed.astype(bool),
                jnp.broadcast_to(split_cost, (num_nodes, n_features)), jnp.stack(per_node, axis=1), scanned)
    results = (jax.ShapeDtypeStruct((num_nodes,), jnp.float32), jax.ShapeDtypeStruct((num_nodes,), jnp.int32),
               jax.ShapeDtypeStruct((num_nodes,), jnp.int32), jax.ShapeDtypeStruct((num_nodes,), jnp.bool_),
               jax.ShapeDtypeStruct((num_nodes, width), jnp.float32),
               jax.ShapeDtypeStruct((num_nodes, width), jnp.float32))
    directions = np.int64(2 if missing_values else 1)
    if leaves is None:
        monotone = jnp.zeros(n_features, jnp.int32) if bounds is None else bounds.monotone.astype(jnp.int32)
        operands += (jnp.broadcast_to(monotone, (num_nodes, n_features)),)
        attributes = dict(directions=directions, constrained=np.int64(bounds is not None))
    else:
        attributes = dict(outputs=np.int64(leaves.num_outputs), directions=directions,
                          general_objective=np.int64(reg.bounds_leaves is not False),
                          psd_tolerance=np.float32(PSD_TOLERANCE),
                          max_full_to_diagonal=np.float32(MAX_FULL_TO_DIAGONAL_SCORE),
                          threads=np.int64(leaves.solve_threads))
    # Leading axes are more nodes to the kernel, so a vmapped call is one call.
    outputs = jax.ffi.ffi_call(target, results, vmap_method="broadcast_all")(*operands, **attributes)
    gain, feature, threshold_bin, default_left, left, right = (as_varying_as(output, operands) for output in outputs)
    if leaves is None:
        return SplitChoice(gain, feature, threshold_bin, default_left, left[:, 0], left[:, 1], right[:, 0],
                           right[:, 1], left_value=left[:, 2], right_value=right[:, 2])
    K = leaves.num_outputs
    no_values = jnp.zeros((num_nodes, K), jnp.float32)
    return SplitChoice(gain, feature, threshold_bin, default_left, left[:, :K], left[:, K:], right[:, :K],
                       right[:, K:], left_value=no_values, right_value=no_values)


def find_best_splits_over_devices(histograms: jax.Array, feature_allowed: jax.Array, reg: Regularization,
                                  min_child_weight: jax.Array, axis_name: str | None,
                                  bounds: NodeBounds | None = None, leaves: VectorLeaves | None = None,
                                  live_nodes: jax.Array | None = None, missing_values: bool = True,
                                  active: jax.Array | None = None, children_values: bool = True) -> SplitChoice:
    """``find_best_splits_of_live_nodes`` with the features divided among the devices of ``axis_name``.

    With rows sharded over ``m`` devices, ``histograms`` hold this device's block of ``b``
    features only: device ``i`` holds features ``[i b, (i + 1) b)`` of the features padded with
    zero ones to ``m b`` (``feature_allowed`` and the per-feature settings are unpadded). Each
    device scans its block and the blocks' winners are compared after one all-gather. Blocks
    are in feature order, so taking the first best block keeps the tie rule (lower feature
    first); padded features are never allowed.
    """
    devices = axis_devices(axis_name)
    if devices == 1:
        return find_best_splits_of_live_nodes(histograms, feature_allowed, reg, min_child_weight, bounds, leaves,
                                              live_nodes, missing_values=missing_values, active=active,
                                              children_values=children_values)
    block = histograms.shape[1]
    start = jax.lax.axis_index(axis_name) * block

    def features_of_block(per_feature, axis=0):
        padding = [(0, 0)] * per_feature.ndim
        padding[axis] = (0, devices * block - per_feature.shape[axis])
        return jax.lax.dynamic_slice_in_dim(jnp.pad(per_feature, padding), start, block, axis=axis)

    split_cost = jnp.asarray(reg.split_cost)
    local_reg = reg.replace(split_cost=features_of_block(split_cost)) if split_cost.ndim == 1 else reg
    local_bounds = None if bounds is None else bounds._replace(monotone=features_of_block(bounds.monotone))
    local = find_best_splits_of_live_nodes(histograms, features_of_block(feature_allowed, axis=1), local_reg,
                                           min_child_weight, local_bounds, leaves, live_nodes,
                                           missing_values=missing_values, active=active,
                                           children_values=children_values)
    local = local._replace(feature=local.feature + start)
    # One collective for all fields.
    gathered = jax.lax.all_gather(_packed_choice(local).T, axis_name)  # (devices, channels, nodes)
    winner = jnp.argmax(gathered[:, 0, :], axis=0)  # channel 0 is loss_change
    best = jnp.take_along_axis(gathered, winner[None, None, :], axis=0)[0].T  # (nodes, channels)
    return _unpacked_choice(best, local)
