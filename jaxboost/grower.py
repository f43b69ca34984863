"""Grower: one depth-wise tree from per-row gradients and Hessians, as one traced unit.

Every level is handled for all its nodes at once with static shapes: build histograms, scan
them for each node's best split, route rows to children. Only the smaller child of each split
gets a fresh histogram; its sibling's is the parent's minus it. Nodes that cannot split are
masked, never branched on; the scan and the subtraction run in fixed-size steps over a level's
slots, and a step whose slots hold no node that may split (most of a deep level's, on small
data) is left out of the loop rather than computed and masked (on one CPU device a native
kernel subtracts the splitting parents' children alone, in one call). A node whose Hessian
weight is under twice ``min_child_weight`` cannot split: it is not scanned, and the split of a
node under three times it, whose children are then both such, builds them no histograms
(``split.splittable``, ``split.children_splittable``). Afterwards, splits whose two children
are leaves and whose ``loss_chg`` is below ``gamma`` are pruned bottom-up (XGBoost's
``min_split_loss``).

Constraints travel with the nodes of a level: monotone constraints as value bounds per node
(children split the parent's range at the midpoint of their values, XGBoost's rule), and
interaction constraints as the set of features used on the path to each node (a node may split
on a feature only if some allowed group holds it and every feature already on its path).

Vector leaves (``leaves``, XGBoost's ``multi_output_tree``): one tree serves K outputs; rows
carry K gradients and a packed Hessian (``regularizer.VectorLeaves``), histograms carry those
channels, and each node's value is a K-vector (``value`` and ``sum_hessians`` get a trailing K
axis: the value and the Hessian diagonal).

Rows may be sharded over devices: pass the mapped ``axis_name`` and every sum over rows
(histograms, row counts) is completed over the devices; everything else is row-local or
replicated. Histograms are summed scattered by feature (a reduce-scatter; the features padded
with zero ones to equal blocks): each device keeps, subtracts and scans only its block of
features, and one all-gather per level compares the blocks' best splits.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .devices import all_sum, all_sum_scattered, axis_devices, chunks_in_use, in_steps_on_cpu
from .histogram import (FEATURE_MAJOR_LAYOUT, StatisticPairs, build_statistics_histogram, builds_channels_natively,
                        route_and_build_statistics_histogram, route_to_children, statistic_pairs)
from .native import (SIBLING_HISTOGRAMS_TARGET, as_varying_as, available_native_target, lowering_platform,
                     per_platform)
from .regularizer import (Regularization, VectorLeaves, clip_leaf_value, leaf_value, unbounded_leaf_value,
                          vector_value_and_score)
from .sampling import uniform_scores
from .split import (NodeBounds, children_splittable, find_best_splits_over_devices, hessian_mass, scan_chunk_nodes,
                    splittable)
from .sums import row_sum
from .tree import Tree, num_heap_nodes

# XGBoost's kRtEps: a split must improve the objective by more than this.
MIN_LOSS_CHANGE = 1e-6


class GrowthParams(NamedTuple):
    """Traced per-tree hyperparameters (changing them does not recompile)."""

    reg: Regularization
    learning_rate: jax.Array
    gamma: jax.Array
    min_child_weight: jax.Array
    colsample_bylevel: jax.Array
    colsample_bynode: jax.Array
    monotone: jax.Array | None = None  # int32 (n_features,) of +1 / -1 / 0; None: unconstrained
    interaction_groups: jax.Array | None = None  # bool (groups, n_features); None: unconstrained


def interaction_allowed(path_features: jax.Array, groups: jax.Array) -> jax.Array:
    """Features each node may split on: those of the groups holding every feature of its path
    (any feature at the root). ``path_features`` (nodes, d) bool, ``groups`` (G, d) bool."""
    group_holds_path = ~jnp.any(path_features[:, None, :] & ~groups[None, :, :], axis=-1)  # (nodes, G)
    allowed = jnp.any(group_holds_path[:, :, None] & groups[None, :, :], axis=1)
    return allowed | ~jnp.any(path_features, axis=-1, keepdims=True)


# Up to this many features, a sample ranks the features' scores by comparing every pair rather
# than sorting them: XLA's CPU sort calls a compiled comparator for every comparison, and the
# per-node samples of a depth-6 tree (a sort of 32 x 28 scores a level) took 0.5 of a 2.7 ms
# round at 40k rows. The pairs grow as the square of the features, so wide data sorts.
PAIRWISE_RANK_FEATURES = 128


def sample_features(key: jax.Array, allowed: jax.Array, fraction: jax.Array, max_keep: int | None = None) -> jax.Array:
    """Keep ``max(1, floor(fraction * #allowed))`` of the allowed features (last axis), uniformly:
    those of the smallest uniform scores (the features not allowed score above them all); at
    most ``max_keep`` (static) when given."""
    return sample_features_by_scores(uniform_scores(key, allowed.shape), allowed, fraction, max_keep)


def sample_features_by_scores(uniform: jax.Array, allowed: jax.Array, fraction: jax.Array,
                              max_keep: int | None = None) -> jax.Array:
    """``sample_features`` from uniform scores drawn already (``uniform``, the shape of
    ``allowed``)."""
    scores = jnp.where(allowed, uniform, 2.0)
    count = jnp.sum(allowed, axis=-1, keepdims=True)
    keep = jnp.maximum(1, jnp.floor(fraction * count).astype(jnp.int32))
    if max_keep is not None:
        keep = jnp.minimum(keep, max_keep)
    n_features = allowed.shape[-1]
    if n_features <= PAIRWISE_RANK_FEATURES:
        # A feature's rank: the features scored below it (equal scores: those before it).
        other, own = scores[..., None, :], scores[..., :, None]
        index = jnp.arange(n_features)
        below = (other < own) | ((other == own) & (index < index[:, None]))
        return allowed & (jnp.sum(below, axis=-1) < keep)
    # The keep-th smallest score is the cut. Scores equal to it are kept in feature order, as
    # many as the count needs: keeping them all took 251 features of 500 at a fraction of 0.5
    # in one round of a hundred (float32 uniforms tie).
    cut = jnp.take_along_axis(jnp.sort(scores, axis=-1), keep - 1, axis=-1)
    at_cut = scores == cut
    needed_at_cut = keep - jnp.sum(scores < cut, axis=-1, keepdims=True)
    return allowed & ((scores < cut) | (at_cut & (jnp.cumsum(at_cut, axis=-1) <= needed_at_cut)))


def tree_feature_slots(colsample_bytree: float, n_features: int) -> int | None:
    """The features a tree's column sample keeps (``sample_features`` of all ``n_features`` at
    ``colsample_bytree``, in float32 as the round computes it), the static number of feature
    slots of its histograms (``grow_tree``'s ``feature_slots``); None when it keeps them all."""
    if colsample_bytree >= 1:
        return None
    keep = max(1, int(np.floor(np.float32(colsample_bytree) * np.float32(n_features))))
    return keep if keep < n_features else None


def empty_tree(num_nodes: int, num_outputs: int | None = None) -> Tree:
    """Zeroed node arrays; ``num_outputs`` gives ``value`` and ``sum_hessians`` a trailing axis
    (vector leaves)."""
    zeros_f = jnp.zeros(num_nodes, jnp.float32)
    zeros_i = jnp.zeros(num_nodes, jnp.int32)
    zeros_b = jnp.zeros(num_nodes, bool)
    per_output = zeros_f if num_outputs is None else jnp.zeros((num_nodes, num_outputs), jnp.float32)
    return Tree(zeros_i, zeros_i, zeros_b, zeros_b, per_output, zeros_f, per_output)


def _two_to_the(depth):
    """``2 ** depth``: a Python int for a static ``depth``, one shift for a traced one (jnp's
    integer power unrolls a square-and-multiply over the exponent's bits, and every fusion
    that reads a level's first slot had repeated it: 64 KB of a round's LLVM IR, 637 -> 573)."""
    return 2 ** depth if isinstance(depth, int) else jnp.left_shift(jnp.int32(1), depth)


def _where_nodes(condition: jax.Array, x: jax.Array, y) -> jax.Array:
    """``where`` with a per-node condition over per-node arrays that may have trailing axes."""
    return jnp.where(condition.reshape(condition.shape + (1,) * (x.ndim - condition.ndim)), x, y)


def write_level(heap_field: jax.Array, level_field: jax.Array, first_slot) -> jax.Array:
    """Write a level's node slots into a heap-ordered field, from the level's first heap index.

    A level's nodes are contiguous in the heap, so this is one slice update (a scatter by heap
    index compiles to a loop of its own: the round's 16 scatters cost 0.5 of a first fit's 3.9 s).
    A level held in more slots than it has nodes writes its spare slots (no live node) over the
    first nodes of deeper levels, which are written afterwards; the slots always fit inside the
    heap (a level of depth d starts at slot 2^d - 1, and a level's slots never number more than
    the last level's)."""
    return jax.lax.dynamic_update_slice_in_dim(heap_field, level_field.astype(heap_field.dtype), first_slot, axis=0)


def sibling_histograms(parent: jax.Array, smaller: jax.Array, left_is_smaller: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(left, right)`` histograms of each parent's children, from the parent's and its smaller
    child's (leading axis: the parent's slot): the larger child's is the parent's minus the smaller's."""
    larger = parent - smaller
    choose = left_is_smaller.reshape(left_is_smaller.shape + (1,) * (parent.ndim - 1))
    return jnp.where(choose, smaller, larger), jnp.where(choose, larger, smaller)


def children_histograms_over_parents(parent_histograms: jax.Array, local_smaller: jax.Array | Callable,
                                     left_is_smaller: jax.Array, parent_splits: jax.Array, live_parents: jax.Array,
                                     axis_name: str | None, kernel: str = "auto") -> jax.Array:
    """A looped level's children histograms, written over its parents' buffer.

    ``parent_histograms``: ``(slots, ...)`` summed over devices (this device's feature block);
    ``local_smaller``: this device's smaller-child histograms, ``(slots, ...)`` before the sum
    over devices, specified for the parents that split (``parent_splits``); it may cover only
    the leading slots, as long as those hold every live parent. Or a function ``(start, count)
    -> (count, ...)`` that builds those of ``count`` parents from slot ``start`` (traced).
    Parent ``p``'s children land in slots ``2 p`` and ``2 p + 1``; in XLA's form the children
    of a parent that does not split get zeros. Only the chunks of ``parent_chunk_nodes``
    parents that hold one of the first ``live_parents`` slots (traced) and a parent that splits
    are summed over devices and subtracted, so a level's cost follows its splitting nodes rather
    than its buffer's slots (a level holds 2^depth nodes in 32 slots, or in the deep levels'
    wider buffer, and on few rows most deep nodes do not split); the other slots keep what they held,
    and no node there is active. The chunks go last first: a chunk's children land past every
    parent not yet read, so the buffer is updated in place. Off the CPU every parent's children
    are written in one step (``in_steps_on_cpu``).

    On CPU a native kernel writes the children, over the buffer in place: of exactly the parents
    that split among the first ``live_parents`` slots, leaving every other slot as it was (the
    children of a parent that does not split too). On one device, with the smaller children
    built (an array), in one call; else a call a step, after the step's sum over devices.
    ``kernel`` as for ``histogram.build_histogram``. XLA's steps, each a slice of the buffer and
    an update of it, were 0.34 of a 1.9 ms round at 10k rows.
    """
    slots = parent_histograms.shape[0]
    if slots < 2:
        return parent_histograms  # a depth-1 tree's single slot: its children are leaves
    devices = axis_devices(axis_name)
    chunk = parent_chunk_nodes(parent_histograms.shape, devices)
    target = available_native_target(SIBLING_HISTOGRAMS_TARGET, "sibling-histograms", kernel)

    def cut(per_parent, start, count: int):
        return jax.lax.dynamic_slice_in_dim(per_parent, start, count)

    def summed_smaller(start, count: int):
        """The smaller children of the ``count`` parents from slot ``start``, summed over devices."""
        local = local_smaller(start, count) if callable(local_smaller) else cut(local_smaller, start, count)
        return all_sum_scattered(local, axis_name, 1)

    def children(histograms, start, count: int):
        """The children of the ``count`` parents from slot ``start``: ``2 count`` slots."""
        left, right = sibling_histograms(cut(histograms, start, count), summed_smaller(start, count),
                                         cut(left_is_smaller, start, count))
        splits = cut(parent_splits, start, count)
        pairs = jnp.stack([_where_nodes(splits, left, 0.0), _where_nodes(splits, right, 0.0)], axis=1)
        return pairs.reshape((2 * count,) + left.shape[1:])

    def native_children(histograms, smaller, first_parent):
        """The children of the parents from slot ``first_parent`` that ``smaller`` (summed over
        devices) holds, written over ``histograms`` by the native kernel."""
        operands = (histograms, smaller, left_is_smaller, parent_splits, jnp.asarray(live_parents, jnp.int32),
                    jnp.asarray(first_parent, jnp.int32))
        # Summed over devices, the smaller children stay feature-major, as the kernels built
        # them: read so, rather than copied into node-major order first (0.15 ms a round at 100k
        # rows on 2 devices).
        smaller_layout = FEATURE_MAJOR_LAYOUT if devices > 1 else None
        result = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(histograms.shape, jnp.float32),
                                  vmap_method="sequential", input_output_aliases={0: 0},
                                  input_layouts=[None, smaller_layout, None, None, None, None])(
            *operands, smaller_feature_major=np.int64(devices > 1))
        return as_varying_as(result, operands)

    def in_steps():
        starts, used = chunks_in_use(live_parents, chunk, slots // 2, parent_splits)

        def one_chunk(step, histograms):
            start = starts[used - 1 - step]
            if target is not None:
                return native_children(histograms, summed_smaller(start, chunk), start)
            return jax.lax.dynamic_update_slice_in_dim(histograms, children(histograms, start, chunk), 2 * start,
                                                       axis=0)

        return jax.lax.fori_loop(0, used, one_chunk, parent_histograms)

    def at_once():
        # Every parent's children fill the buffer (those of parents that do not split: zeros).
        return children(parent_histograms, 0, slots // 2)

    if target is not None and devices == 1 and not callable(local_smaller):
        # Nothing to sum over devices: every parent in one call, no steps.
        return per_platform(cpu=lambda: native_children(parent_histograms, local_smaller, 0), default=at_once)
    return in_steps_on_cpu(in_steps, at_once)


# Parents per step of the children's subtraction when rows are sharded over devices: in the
# shallow levels' 32 slots, and in the deep levels' wider buffers. Each step then sums its
# smaller children over the devices, a collective, so the steps are wider than the split scan's
# (at 800k rows on 2 devices, depth 10: 58.0 ms a tree with these, 61.6 with 4 and 8). On one
# device a step sums nothing and takes the split scan's cache-sized steps (10k rows: depth 10
# 8.8 -> 5.9 ms, depth 6 1.69 -> 1.60, medians of 6 runs).
SHALLOW_PARENT_CHUNK = 8
WIDE_PARENT_CHUNK = 32
# At most this many bytes of a device's feature block of cells per step: a step holds its
# chunk's smaller children of every feature before the sum (devices times this) and two
# sums after it. 10 outputs with the full Hessian (66 channels, 0.95 MB a parent) take 4
# parents a step instead of 8: the trees' program 82.9 -> 67.7 MB of temporaries a device at
# 160k rows, rounds as fast (383-452 against 429-484 ms, alternating); fewer channels keep 8.
PARENT_CHUNK_BYTES = 4 * 1024 * 1024


def parent_chunk_nodes(histogram_shape: tuple[int, ...], devices: int) -> int:
    """Parents per step of ``children_histograms_over_parents`` over a level's histograms of
    ``histogram_shape`` (slots first; this device's block of features) on ``devices`` devices."""
    slots = histogram_shape[0]
    if devices == 1:
        chunk = scan_chunk_nodes(slots, math.prod(histogram_shape[1:]))
    else:
        widest = SHALLOW_PARENT_CHUNK if slots <= LOOPED_LEVEL_NODES else WIDE_PARENT_CHUNK
        chunk = scan_chunk_nodes(widest, math.prod(histogram_shape[1:]), PARENT_CHUNK_BYTES)
    return min(chunk, max(slots // 2, 1))


def _parent_chunks(histogram_shape: tuple[int, ...], live_parents: jax.Array,
                   axis_name: str | None) -> tuple[int, jax.Array]:
    """``(chunk, count)``: ``children_histograms_over_parents`` reads the smaller children of
    the first ``chunk * count`` parent slots, the chunks that hold the live parents."""
    slots = histogram_shape[0]
    if slots < 2:
        return 1, jnp.zeros((), jnp.int32)
    chunk = parent_chunk_nodes(histogram_shape, axis_devices(axis_name))
    return chunk, jnp.minimum((live_parents + chunk - 1) // chunk, slots // (2 * chunk))


def _children(nodes: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    return jnp.minimum(2 * nodes + 1, num_nodes - 1), jnp.minimum(2 * nodes + 2, num_nodes - 1)


def prunes_splits(gamma: float) -> bool:
    """Whether pruning by ``gamma`` can turn a split into a leaf: a split's loss change is above
    ``MIN_LOSS_CHANGE``, so a smaller ``gamma`` (XGBoost's default 0) prunes none, and a tree
    grown for it leaves the pruning out of its program (71 KB of the depth-6 round's LLVM IR)."""
    return gamma > MIN_LOSS_CHANGE


def prune_by_gamma(tree: Tree, max_depth: int, gamma: jax.Array) -> tuple[Tree, jax.Array]:
    """Turn into leaves, bottom-up, the splits whose children are leaves and whose loss_chg < gamma.

    Returns the pruned tree and ``surviving_leaf`` (num_nodes,): for every former leaf, the leaf
    that now holds its rows. Each pass looks at all nodes at once; ``max_depth`` passes reach
    the root.
    """
    num_nodes = tree.is_leaf.shape[0]
    nodes = jnp.arange(num_nodes)
    left, right = _children(nodes, num_nodes)
    is_split = ~tree.is_leaf & (tree.loss_change > 0)

    def prune_pass(_, is_leaf):
        prune = is_split & ~is_leaf & is_leaf[left] & is_leaf[right] & (tree.loss_change < gamma)
        pruned_parent = prune[(nodes - 1) // 2] & (nodes > 0)
        return (is_leaf | prune) & ~pruned_parent

    is_leaf = jax.lax.fori_loop(0, max_depth, prune_pass, tree.is_leaf)

    def hand_down(_, state):
        # A node below a (new) leaf hands its rows to that leaf.
        surviving_leaf, closed = state
        parent = jnp.maximum((nodes - 1) // 2, 0)
        inherit = closed[parent] & (nodes > 0)
        return jnp.where(inherit, surviving_leaf[parent], surviving_leaf), closed | inherit

    surviving_leaf, closed = jax.lax.fori_loop(0, max_depth, hand_down, (nodes, is_leaf))
    # Nodes below a leaf are never reached again: clear them, so that sums over nodes (gain
    # importance, split counts) see only the tree that predicts.
    unreachable = closed & ~is_leaf
    pruned = tree._replace(is_leaf=is_leaf, loss_change=jnp.where(is_leaf, 0.0, tree.loss_change))
    pruned = Tree(*(_where_nodes(unreachable, jnp.zeros_like(field), field) for field in pruned))
    return pruned, surviving_leaf


# Off the CPU, levels with at most this many nodes share one compiled loop body sized for this
# many nodes; deeper levels share another, sized for the widest of them (see ``grow_tree``).
LOOPED_LEVEL_NODES = 32


class RowLeaves(NamedTuple):
    """Where the rows end in a tree: row ``i`` is in leaf ``position_leaf[last_position[i]]``.

    Kept as the two arrays so that a round adds leaf values by position (one small table read
    per row) rather than first forming every row's leaf."""

    position_leaf: jax.Array  # (2^max_depth,) heap index of the leaf over each last-level position
    last_position: jax.Array  # (n_rows,) each row's position on the last level

    def heap_index(self) -> jax.Array:
        """The heap index of each row's leaf, ``(n_rows,)``."""
        return self.position_leaf[self.last_position]


class _LevelState(NamedTuple):
    """The nodes of one level; node arrays are sized for the level's node capacity."""

    tree: Tree
    node_of_row: jax.Array  # (n,) position of each row's node within the current level
    active: jax.Array  # (capacity,) the level's nodes that exist and may split
    level_gradients: jax.Array  # (capacity,), vector leaves (capacity, K)
    level_hessians: jax.Array  # (capacity,), vector leaves (capacity, Hessian channels)
    histograms: jax.Array | None  # (capacity, d, bins, channels padded to pairs); None on the leaf level
    lower: jax.Array  # (capacity,) value bounds from monotone constraints (+-inf when free)
    upper: jax.Array
    path_features: jax.Array | None  # (capacity, d) features split on above each node


def _widened(state: _LevelState, capacity: int, histogram_buffer: jax.Array | None) -> _LevelState:
    """A level's node arrays, with empty slots appended up to ``capacity``, and its histograms
    written over the leading slots of ``histogram_buffer`` (None: padded with zeros). The
    buffer's other slots may hold anything: the deeper levels read only slots they wrote."""
    def padded(per_node, fill):
        if per_node is None:
            return None
        extra = jnp.full((capacity - per_node.shape[0],) + per_node.shape[1:], fill, per_node.dtype)
        return jnp.concatenate([per_node, extra])

    if histogram_buffer is None:
        histograms = padded(state.histograms, 0)
    else:
        histograms = jax.lax.dynamic_update_slice_in_dim(histogram_buffer, state.histograms, 0, axis=0)
    return state._replace(active=padded(state.active, False), level_gradients=padded(state.level_gradients, 0),
                          level_hessians=padded(state.level_hessians, 0), histograms=histograms,
                          lower=padded(state.lower, -jnp.inf), upper=padded(state.upper, jnp.inf),
                          path_features=padded(state.path_features, False))


def looped_level_nodes(max_depth: int, platform: str) -> int:
    """Slots of the level loop that starts at the root, for trees of ``max_depth`` on
    ``platform``. On CPU every level's, ``2^(max_depth - 1)``: there the scan and the
    subtraction step over the slots of live nodes only, so one loop serves every level (at
    depths 7-10 a first fit compiled 0.25-0.35 s sooner than with a second loop for the deep
    levels, trees as fast). Elsewhere a level is handled whole, every slot at once, so the
    shallow levels keep at most ``LOOPED_LEVEL_NODES`` slots and deeper ones get a second loop."""
    widest = 2 ** (max_depth - 1)
    return widest if platform == "cpu" else min(LOOPED_LEVEL_NODES, widest)


def histogram_buffer_shape(max_depth: int, n_features: int, max_bin: int, channels: int,
                           devices: int = 1) -> tuple[int, ...]:
    """Per device, the shape of the histogram buffer that ``grow_tree`` can take from its caller
    (``histogram_buffer``): the widest level's ``2^(max_depth - 1)`` slots. ``channels``: 2, or
    the vector leaves' gradient and packed Hessian channels, an odd number padded with a zero
    one to the kernels' pairs (``StatisticPairs.width``); with rows sharded over ``devices``
    each keeps a block of the features (padded to equal blocks)."""
    return (2 ** (max_depth - 1), -(-n_features // devices), max_bin, channels)


def grow_tree(X_binned_T: jax.Array, gradients: jax.Array, hessians: jax.Array, feature_allowed: jax.Array,
              key: jax.Array, params: GrowthParams, max_depth: int, max_bin: int,
              axis_name: str | None = None, sample_columns: bool = True,
              leaves: VectorLeaves | None = None, missing_values: bool = True,
              row_offset: jax.Array | None = None,
              histogram_buffer: jax.Array | None = None,
              kernel_threads: int = 1,
              feature_slots: int | None = None,
              deterministic_histogram: bool = False,
              prune_splits: bool = True,
              kernel_row_ranges: int = 1) -> tuple[Tree, RowLeaves, tuple, jax.Array | None]:
    """Grow one tree.

    Args:
      X_binned_T: uint8 ``(n_features, n_rows)``, or with ``row_offset`` a wider code table
        whose columns ``[row_offset, row_offset + n_rows)`` are the rows (``build_histogram``).
      gradients, hessians: float32 ``(n_rows,)``, sample weights already applied; rows out of
        the sample (or padding) carry zeros. Vector leaves: ``(n_rows, K)`` gradients and
        ``(n_rows, leaves.hessian_channels)`` packed Hessians.
      feature_allowed: bool ``(n_features,)``, the features sampled for this tree.
      key: PRNG key for per-level and per-node column sampling.
      sample_columns: False when ``colsample_bylevel`` and ``colsample_bynode`` are both 1, so
        the sampling is left out of the compiled program.
      leaves: the vector-leaf layout, or None for one scalar output (monotone constraints
        apply to scalar leaves only).
      missing_values: False when no row has a missing code: the split scan then skips the
        direction for missing values (``find_best_splits``); the tree is the same.
      row_offset: int32 scalar or None, as above.
      histogram_buffer: float32 of ``histogram_buffer_shape`` (this device's), or None. The
        level loop over the widest levels (the deep one, or the shallow one of a tree of depth
        6 or less) keeps its histograms in it, whatever it holds, instead of in a fresh buffer:
        a caller that keeps it from tree to tree (donated to a jitted round) keeps those tens of
        MB out of the scratch memory XLA allocates for every call, and a shallow tree's root
        is written into it without zeroing the other slots first (0.14 of a 2.2 ms tree at
        10k rows).
      kernel_threads: threads of the CPU histogram kernel, each taking a range of features
        (``devices.kernel_threads``: wide data on one device); 1 when rows are sharded.
      feature_slots: static; at least the number of features in ``feature_allowed`` (a tree's
        column sample, ``tree_feature_slots``), or None. The histograms then hold that many
        feature slots, the sampled features' in feature order (the rest never allowed), and
        the sums over devices, the subtraction and the split scan run over those slots only.
      deterministic_histogram: on accelerators, histograms sum fixed-point integers, so a tree
        does not depend on the order of the atomic adds (``build_histogram``).
      prune_splits: False when ``params.gamma`` cannot prune a split (``prunes_splits``): the
        pruning is left out of the program.
      kernel_row_ranges: ranges of rows that the CPU kernels of the root and of the routed
        levels sum apart on the device's threads (``devices.kernel_row_ranges``: one device of
        a multi-core CPU); 1 when rows are sharded. Scalar leaves only (vector leaves: 1).

    Returns:
      ``(tree, row_leaves, (lower, upper), histogram_buffer)``: the tree's node arrays (values
      times the learning rate), the leaf holding each row (``RowLeaves``), every node's value
      bounds (for leaf refits under monotone constraints), and the histogram buffer to pass to
      the next tree (None when none was passed).

    The levels run in one ``fori_loop`` over buffers of ``looped_level_nodes`` slots: on CPU
    every level; elsewhere the shallow levels (up to ``LOOPED_LEVEL_NODES`` nodes), and deeper
    trees run the levels below in a second loop over buffers sized for the widest of them
    (``2^(max_depth - 1)`` slots). The last level that splits runs in its loop too, masked: its
    children are written into the tree as leaves, and it builds no histograms. So a tree of any
    depth compiles at most two level bodies, on CPU one.
    """
    n_features, n_rows = X_binned_T.shape[0], gradients.shape[0]
    num_nodes = num_heap_nodes(max_depth)
    monotone = params.monotone
    if leaves is not None and monotone is not None:
        raise ValueError("monotone constraints apply to scalar leaves only, not to vector leaves")
    K = None if leaves is None else leaves.num_outputs
    if leaves is None:
        statistics = StatisticPairs(((gradients, hessians),), 2)
    else:
        statistics = statistic_pairs((gradients, hessians))
    node_bounds = (jnp.full(num_nodes, -jnp.inf), jnp.full(num_nodes, jnp.inf))

    def record_values(tree, bounds, depth, level, values=None):
        """Write the values, covers and value bounds of a level's nodes (``level``: a
        ``_LevelState``, or the leaves' fields of one) into the tree; ``values``: those nodes'
        values if solved already (``level_values``)."""
        active = level.active
        first_slot = _two_to_the(depth) - 1
        if leaves is None:
            if values is None:
                values = leaf_value(level.level_gradients, level.level_hessians, params.reg, level.lower, level.upper)
            cover = level.level_hessians
        else:
            cover = leaves.diagonal(level.level_hessians)
        values = params.learning_rate * values
        bounds = tuple(write_level(b, slots, first_slot) for b, slots in zip(bounds, (level.lower, level.upper)))
        return tree._replace(
            value=write_level(tree.value, _where_nodes(active, values, 0.0), first_slot),
            sum_hessians=write_level(tree.sum_hessians, _where_nodes(active, cover, 0.0), first_slot),
        ), bounds, first_slot

    def record_leaves(tree, bounds, depth, level, values=None):
        """``record_values`` for a level written as leaves."""
        tree, bounds, first_slot = record_values(tree, bounds, depth, level, values)
        return tree._replace(is_leaf=write_level(tree.is_leaf, level.active, first_slot)), bounds

    def level_values(level, child_gradients, child_hessians):
        """The values of a level's nodes and of their children (no learning rate; a custom
        penalty's without bounds, which the caller clips), in one traced copy of the solve: each
        copy of the vector solve adds about a second to a first fit's compile at K = 10 (the
        split scan holds the other), and each copy of a custom penalty's Newton steps is a loop
        compiled on its own (the split scan leaves the children's values within their parent's
        bounds, for monotone constraints, to this one too)."""
        capacity = level.level_gradients.shape[0]
        gradients = jnp.concatenate([level.level_gradients, child_gradients])
        hessians = jnp.concatenate([level.level_hessians, child_hessians])
        if leaves is None:
            values = unbounded_leaf_value(gradients, hessians, params.reg)
        else:
            values, _ = vector_value_and_score(gradients, hessians, params.reg, leaves)
        return values[:capacity], values[capacity:]

    def split_level(depth, carry, children_are_leaves=None, parent_slots: int | None = None):
        """Split the level's nodes (``depth`` traced: the level of a loop over levels); the
        children's arrays come out in the same slots, their histograms over the parents'.

        ``children_are_leaves`` (a traced flag, for a loop that runs down to the leaves): when
        it holds, the children form the last level and get no histograms. In such a loop the
        children are written into the tree as leaves at their full number (twice the level's
        slots) at every level; below the last, the next level writes over them.
        ``parent_slots``: the leading slots that can hold a parent whose children get
        histograms (None: all); the smaller children's histograms are built for those only."""
        state, bounds = carry
        capacity = state.active.shape[0]
        active = state.active
        tree, first_slot = state.tree, _two_to_the(depth) - 1
        node_features = jnp.broadcast_to(feature_allowed, (capacity, n_features))
        if sample_columns:
            level_features = sample_features_by_scores(
                jax.lax.dynamic_index_in_dim(level_scores, depth, keepdims=False), feature_allowed,
                params.colsample_bylevel)
            # The level's slots hold its nodes in heap order: slot i is heap node first_slot + i.
            node_features = sample_features_by_scores(
                jax.lax.dynamic_slice_in_dim(node_scores, first_slot, capacity),
                jnp.broadcast_to(level_features, (capacity, n_features)), params.colsample_bynode)
        if params.interaction_groups is not None:
            # After sampling, as XGBoost does: constraints filter the sampled features.
            node_features = node_features & interaction_allowed(state.path_features, params.interaction_groups)
        level_bounds = None if monotone is None else NodeBounds(in_slots(monotone), state.lower, state.upper)
        # A level (traced depth) fills only the first 2^depth of its slots.
        live_nodes = _two_to_the(depth)
        # Nodes too light to split are not scanned: their choices stay empty, no split.
        scanned = active & splittable(state.level_hessians, leaves, params.min_child_weight)
        # A custom penalty's level solve gives the winner's children's values too (below).
        solves_level = leaves is not None or params.reg.penalty is not None
        split = find_best_splits_over_devices(state.histograms, in_slots(node_features) & slot_in_sample, slot_reg,
                                              params.min_child_weight, axis_name, level_bounds, leaves, live_nodes,
                                              missing_values, scanned, children_values=not solves_level)
        if slot_feature is not None:
            split = split._replace(feature=slot_feature[split.feature])
        # Scanned, not active: an active node too light to split may hold no histogram.
        splits = scanned & (split.loss_change > MIN_LOSS_CHANGE)
        tree = tree._replace(
            feature=write_level(tree.feature, jnp.where(splits, split.feature, 0), first_slot),
            threshold_bin=write_level(tree.threshold_bin, jnp.where(splits, split.threshold_bin, 0), first_slot),
            default_left=write_level(tree.default_left, splits & split.default_left, first_slot),
            is_leaf=write_level(tree.is_leaf, active & ~splits, first_slot),
            loss_change=write_level(tree.loss_change, jnp.where(splits, split.loss_change, 0.0), first_slot),
        )

        node_of_row = state.node_of_row

        def all_children(left, right):
            return jnp.stack([left, right], axis=1).reshape((2 * capacity,) + left.shape[1:])

        def children(left, right):
            return all_children(left, right)[:capacity]

        # Histogram only the child with fewer rows; the sibling's is the parent's minus it.
        # The smaller child by Hessian sum: known on every device without counting rows.
        left_is_smaller = hessian_mass(split.left_hessians, leaves) <= hessian_mass(split.right_hessians, leaves)
        # A node too light for either child to split: its children are never scanned, so they
        # get no histograms.
        histogram_splits = splits & children_splittable(state.level_hessians, leaves, params.min_child_weight)
        summed_nodes = live_nodes
        if children_are_leaves is not None:
            # Leaves need no histograms: the kernel only routes, and nothing is summed.
            histogram_splits = histogram_splits & ~children_are_leaves
            summed_nodes = jnp.where(children_are_leaves, 0, live_nodes)
        def with_the_route():
            # The kernel writes the parents whose smaller children are read, and no more.
            chunk, read_chunks = _parent_chunks(state.histograms.shape, summed_nodes, axis_name)
            child_of_row, smaller = route_and_build_statistics_histogram(
                X_binned_T, node_of_row, statistics, split.feature, split.threshold_bin, split.default_left,
                histogram_splits, left_is_smaller, max_bin, feature_major=sharded, result_features=summed_features,
                row_offset=row_offset, histogram_nodes=parent_slots, live_nodes=chunk * read_chunks,
                threads=kernel_threads, keep_padding=True, features_used=feature_allowed,
                deterministic=deterministic_histogram, row_ranges=kernel_row_ranges)
            return child_of_row, children_histograms_over_parents(state.histograms, smaller, left_is_smaller,
                                                                  histogram_splits, summed_nodes, axis_name)

        def in_parent_chunks():
            # Many channels on a CPU: each step of the children's subtraction builds its own
            # parents' smaller children (every channel in the native kernel's pass), rather than
            # cutting them from those of every parent, built at once: at 10 classes with the full
            # Hessian that buffer was 29 MiB a device (16 parents x 28 features x 66 channels),
            # and its cuts copied 7.6 MB a step.
            child_of_row, in_smaller_child = route_to_children(
                X_binned_T, node_of_row, statistics, split.feature, split.threshold_bin, split.default_left,
                histogram_splits, left_is_smaller, max_bin, parent_slots, feature_major=sharded,
                row_offset=row_offset)

            def smaller(start, count: int):
                return build_statistics_histogram(
                    X_binned_T, node_of_row - start, statistics, count, max_bin, row_mask=in_smaller_child,
                    feature_major=sharded, result_features=summed_features, row_offset=row_offset,
                    threads=kernel_threads, keep_padding=True, features_used=feature_allowed,
                    deterministic=deterministic_histogram)

            return child_of_row, children_histograms_over_parents(state.histograms, smaller, left_is_smaller,
                                                                  histogram_splits, summed_nodes, axis_name)

        if builds_channels_natively(statistics, X_binned_T, max_bin, parent_slots):
            child_of_row, histograms = per_platform(cpu=in_parent_chunks, default=with_the_route)
        else:
            child_of_row, histograms = with_the_route()
        lower, upper = state.lower, state.upper
        values = children_values = None
        if solves_level:
            values, children_values = level_values(state, all_children(split.left_gradients, split.right_gradients),
                                                   all_children(split.left_hessians, split.right_hessians))
        left_lower, left_upper, right_lower, right_upper = lower, upper, lower, upper
        if monotone is not None:
            left_value, right_value = split.left_value, split.right_value
            if solves_level:
                # Within the parent's bounds, as the split scan gives them (scalar leaves only).
                left_value, right_value = (clip_leaf_value(children_values.reshape(capacity, 2)[:, side], params.reg,
                                                           lower, upper) for side in (0, 1))
            # Children split the parent's range at the midpoint of their values (XGBoost's rule).
            middle = 0.5 * (left_value + right_value)
            direction = monotone[split.feature]
            left_upper = jnp.where(direction > 0, middle, upper)
            right_lower = jnp.where(direction > 0, middle, lower)
            left_lower = jnp.where(direction < 0, middle, lower)
            right_upper = jnp.where(direction < 0, middle, upper)
        path_features = state.path_features
        if path_features is not None:
            path_features = path_features | (jax.nn.one_hot(split.feature, n_features, dtype=bool) & splits[:, None])
            path_features = children(path_features, path_features)
        child_fields = dict(active=all_children(splits, splits),
                            level_gradients=all_children(split.left_gradients, split.right_gradients),
                            level_hessians=all_children(split.left_hessians, split.right_hessians),
                            lower=all_children(left_lower, right_lower), upper=all_children(left_upper, right_upper))
        if solves_level and leaves is None:
            values = clip_leaf_value(values, params.reg, lower, upper)
            children_values = clip_leaf_value(children_values, params.reg, child_fields["lower"], child_fields["upper"])
        tree, bounds, _ = record_values(tree, bounds, depth, state, values=values)
        if children_are_leaves is not None:
            # The children are written as leaves at every level of the loop, not only where
            # they are the last level: at the others the next level writes each of these
            # fields again over all of them (its own slots, then its spare ones over deeper
            # levels, written in turn). Masked by the flag, each write had read back the slots
            # it kept, and the loop's level writes compiled to 203 KB of LLVM IR instead of
            # 156 (the trees' program 619 -> 572 KB at depth 6; the same trees, bit for bit).
            leaf_level = _LevelState(tree=None, node_of_row=None, histograms=None, path_features=None, **child_fields)
            tree, bounds = record_leaves(tree, bounds, depth + 1, leaf_level, values=children_values)
        # The next level's nodes all sit in its first capacity positions.
        return _LevelState(tree=tree, node_of_row=child_of_row, histograms=histograms, path_features=path_features,
                           **{name: field[:capacity] for name, field in child_fields.items()}), bounds

    # With rows sharded over devices, histograms are summed over the devices scattered by
    # feature: each device keeps the block of features it scans (a reduce-scatter), so the sums
    # move, and the sibling subtraction and level copies touch, 1/devices of the cells. The
    # kernels lay them out feature by feature (no transpose before the sum), padded with zero
    # features to equal blocks.
    devices = axis_devices(axis_name)
    sharded = devices > 1
    # A tree's column sample: the kernels write compact histograms, its features' cells in
    # ``feature_slots`` slots (padded to equal blocks over the devices), so the sums over
    # devices, the subtraction and the split scan skip the other features too (at
    # colsample_bytree=0.5, 20k rows x 50 features: 2.5 -> 1.8 ms a tree).
    def in_device_blocks(count: int) -> int:
        return -(-count // devices) * devices

    histogram_features = n_features
    if feature_slots is not None and in_device_blocks(feature_slots) < n_features:
        histogram_features = feature_slots
    # Feature slots of the kernels' results: padded to equal blocks, one a device.
    summed_features = in_device_blocks(histogram_features)
    slot_feature, slot_in_sample, slot_reg = None, True, params.reg
    if histogram_features < n_features:
        (listed,) = jnp.nonzero(feature_allowed, size=summed_features, fill_value=-1)
        slot_in_sample = listed >= 0
        slot_feature = jnp.where(slot_in_sample, listed, 0).astype(jnp.int32)
        if jnp.ndim(params.reg.split_cost) == 1:
            slot_reg = params.reg.replace(split_cost=jnp.asarray(params.reg.split_cost)[slot_feature])

    def in_slots(per_feature):
        """Per-feature values (last axis) in the histograms' feature slots."""
        return per_feature if slot_feature is None else per_feature[..., slot_feature]

    looped_capacity = looped_level_nodes(max_depth, lowering_platform())
    grows_deep_levels = looped_capacity < 2 ** (max_depth - 1)
    looped_levels = looped_capacity.bit_length() - 1  # levels whose children fit in looped_capacity
    level_scores = node_scores = None
    if sample_columns:
        # The level and node samples' scores, drawn for the whole tree at once: a score per
        # level and one per node that can split (2^max_depth - 1; a level's slots past its
        # nodes read the next level's, whose nodes are masked). Two draws a level had cost 0.1
        # of a 3.4 ms round at 40k rows with colsample_bynode (on CPU each draw is a loop).
        scores = uniform_scores(key, (max_depth + 2 ** max_depth - 1, n_features))
        level_scores, node_scores = scores[:max_depth], scores[max_depth:]
    root_index = jnp.zeros(n_rows, jnp.int32)

    def root_level(root):
        # The root alone is summed over rows and devices; the level's other slots start empty.
        return jnp.zeros((looped_capacity,) + root.shape).at[0].set(root)

    def root_histograms(root):
        # Slots past the root's hold no active node until a level writes them (a scan step that
        # reads one with the root masks its choice), so a shallow tree's buffer needs no zeroing.
        if histogram_buffer is None or grows_deep_levels:
            return root_level(root)
        return jax.lax.dynamic_update_slice_in_dim(histogram_buffer, root[None], 0, axis=0)

    if histogram_buffer is not None:
        expected = histogram_buffer_shape(max_depth, histogram_features, max_bin, statistics.width, devices)
        if histogram_buffer.shape != expected:
            raise ValueError(f"histogram_buffer must have this device's shape {expected} (histogram_buffer_shape); "
                             f"got {histogram_buffer.shape}")
    # Only the tree's sampled features are summed, at every level: the level and node samples
    # draw from them, so no other feature's cells are read (colsample_bytree=0.5 halves the
    # kernels' work).
    local_root = build_statistics_histogram(X_binned_T, root_index, statistics, 1, max_bin, feature_major=sharded,
                                            result_features=summed_features, row_offset=row_offset,
                                            threads=kernel_threads, keep_padding=True, features_used=feature_allowed,
                                            deterministic=deterministic_histogram, row_ranges=kernel_row_ranges)
    root_histogram = all_sum_scattered(local_root, axis_name, 1)[0]
    # Every row lies in one bin of each feature, so the first sampled feature's bins sum to the
    # root's totals: no separate sums over rows. Every device sums the same feature's, so all
    # hold the same totals bit for bit. (In compact histograms it is in the first slot.)
    first_sampled = 0 if slot_feature is not None else jnp.argmax(feature_allowed)
    root_totals = all_sum(row_sum(jax.lax.dynamic_index_in_dim(local_root[0], first_sampled, keepdims=False)),
                          axis_name)
    num_gradient_channels = gradients.shape[1] if gradients.ndim == 2 else 1
    root_gradients = root_totals[:num_gradient_channels]
    root_hessians = root_totals[num_gradient_channels:statistics.channels]
    if leaves is None:
        root_gradients, root_hessians = root_gradients[0], root_hessians[0]
    state = _LevelState(
        tree=empty_tree(num_nodes, K),
        node_of_row=root_index,
        active=jnp.zeros(looped_capacity, bool).at[0].set(True),
        level_gradients=root_level(root_gradients),
        level_hessians=root_level(root_hessians),
        histograms=root_histograms(root_histogram),
        lower=jnp.full(looped_capacity, -jnp.inf),
        upper=jnp.full(looped_capacity, jnp.inf),
        path_features=None if params.interaction_groups is None else jnp.zeros((looped_capacity, n_features), bool),
    )
    if not grows_deep_levels:
        # The last level fits the loop's slots too: it runs in the loop, masked, rather than in
        # a second copy of the level's program (0.8 s of a 3.4 s first fit at depth 6). The
        # kernels build the smaller children for the leading half of the slots, which hold the
        # parents of every level but the last, as the second loop does: their results over every
        # slot, 29 MB a level at depth 10, took 57 -> 77 ms a tree at 800k rows, and at depth 6
        # with 10-output full-Hessian leaves (66 channels) the trees' program held 127 MiB a
        # device instead of 98.
        parent_slots = looped_capacity // 2 if looped_capacity > 1 else None
        state, node_bounds = jax.lax.fori_loop(
            0, max_depth,
            lambda depth, c: split_level(depth, c, children_are_leaves=depth == max_depth - 1,
                                         parent_slots=parent_slots),
            (state, node_bounds))
        tree = state.tree
    else:
        carry = jax.lax.fori_loop(0, looped_levels, split_level, (state, node_bounds))
        # The deeper levels share a second loop, down to the leaves, with buffers sized for the
        # widest of them: one compiled body instead of one per level. Its steps follow the live
        # nodes, the children's histograms are written over their parents', and histograms are
        # built for the leading half of the slots, which hold every level's parents but the last.
        deep_capacity = 2 ** (max_depth - 1)
        state, node_bounds = jax.lax.fori_loop(
            looped_levels, max_depth,
            lambda depth, c: split_level(depth, c, children_are_leaves=depth == max_depth - 1,
                                         parent_slots=deep_capacity // 2),
            (_widened(carry[0], deep_capacity, histogram_buffer), carry[1]))
        tree = state.tree
    returned_buffer = None if histogram_buffer is None else state.histograms
    # No leaf update per level: a row's last-level position names its path, and the table gives
    # the leaf on that path.
    surviving_leaf = None
    if prune_splits:
        tree, surviving_leaf = prune_by_gamma(tree, max_depth, params.gamma)
    position_leaf = leaf_of_position(tree.is_leaf, max_depth)
    if surviving_leaf is not None:
        position_leaf = surviving_leaf[position_leaf]
    return tree, RowLeaves(position_leaf, state.node_of_row), node_bounds, returned_buffer


def leaf_of_position(is_leaf: jax.Array, max_depth: int) -> jax.Array:
    """For each last-level position ``p`` (``2^max_depth`` of them), the heap index of the
    shallowest leaf on the path to it. Rows keep moving below the node where they stopped (a
    node that did not split still routes them), so their last-level position lies under their
    leaf."""
    positions = jnp.arange(2 ** max_depth)

    def shallower(step, leaf):
        depth = max_depth - 1 - step
        ancestor = _two_to_the(depth) - 1 + (positions >> (max_depth - depth))
        return jnp.where(is_leaf[ancestor], ancestor, leaf)

    # A loop, not unrolled selects: XLA fuses unrolled ones into the per-row gather that reads
    # the table and recomputes the whole table for every row (7 ms a tree at 400k rows).
    return jax.lax.fori_loop(0, max_depth, shallower, 2 ** max_depth - 1 + positions)
