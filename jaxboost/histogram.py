"""Histograms: per (node, feature, bin) sums of gradients and Hessians.

The kernel builds the histogram of the rows at hand (one device's shard); the caller sums it
over the row axis (a reduce-scatter by feature when rows are sharded over devices: the kernels
can lay the result out feature by feature and pad it to equal feature blocks for that), so the
multi-core and multi-device paths are a wrapper around this function rather than a rewrite.

On CPU, XLA runs one scatter on one core and a flat scatter over ``n * d`` indices spills out of
cache; a scatter per feature into a small ``(nodes * bins)`` target (``lax.map`` over features)
is about twice as fast, and carrying ``(g, h)`` as one complex64 value halves the scatters
(measurements in the project's kernel notes). On a GPU the opposite holds: a complex64 add is an
atomic compare-and-swap loop there, so the kernel scatters float32 pairs instead, for all features
in one scatter, into copies of the live nodes' histograms so that fewer atomic adds contend for
one cell (``experiments/gpu_histogram_study.py``, ``experiments/gpu_level_copies.py``).

On CPU a native kernel (``histogram_kernel.cc``, an XLA FFI custom call built on first use; see
``jaxboost.native``) replaces the scatter: it skips the rows outside ``row_mask`` instead of
adding zeros for them, so the smaller child of each split costs only its own rows. The choice
is made per backend when the program is lowered; other backends, and CPUs where the kernel
could not be built, use the XLA kernel.

The codes may be a table wider than the local rows, read from a row offset: the devices of a
CPU share the Dataset's one table that way instead of each holding a copy of its rows (the XLA
kernel slices its rows out, a copy, so only the native kernels get that table).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .fixed_point import float_piece_bits, float_pieces_needed, from_pieces, magnitude_scale, to_pieces
from .native import (CHANNEL_HISTOGRAM_TARGET, CUMULATIVE_BINS_TARGET, FIRST_MAXIMUM_TARGET, HISTOGRAM_TARGET,
                     KERNELS, ROUTE_HISTOGRAM_TARGET, TOP_AFTER_TARGET, as_varying_as, available_native_target,
                     per_platform)


def _choose_native_target(name: str, what: str, kernel: str, threads: int, X_binned_T: jax.Array,
                          max_bin: int, row_ranges: int = 1) -> str | None:
    """The FFI target to use on CPU, or None for the XLA kernel everywhere."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    for name_of_count, count in (("threads", threads), ("row_ranges", row_ranges)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"{name_of_count} must be a positive integer; got {count!r}")
    if X_binned_T.dtype != jnp.uint8 or max_bin > 256:
        # The native kernels read one byte per code; wider codes go to the XLA kernel.
        if kernel == "native":
            raise ValueError(f"the native {what} kernel needs uint8 codes and max_bin <= 256; got "
                             f"{X_binned_T.dtype} codes and max_bin={max_bin}")
        return None
    return available_native_target(name, what, kernel)


def build_histogram(X_binned_T: jax.Array, node_index: jax.Array, gradients: jax.Array,
                    hessians: jax.Array, num_nodes: int, max_bin: int, row_mask: jax.Array | None = None,
                    kernel: str = "auto", threads: int = 1, feature_major: bool = False,
                    result_features: int | None = None, row_offset: jax.Array | None = None,
                    channels: int = 2, channel: int = 0, into: jax.Array | None = None,
                    features_used: jax.Array | None = None, deterministic: bool = False,
                    row_order: bool = False, row_ranges: int = 1) -> jax.Array:
    """Histogram of the local rows.

    Args:
      X_binned_T: uint8 ``(n_features, n_rows)``, feature-major so each feature's codes are
        contiguous; codes lie in ``[0, max_bin)``. With ``row_offset``, a wider code table
        whose columns ``[row_offset, row_offset + n_rows)`` are the local rows.
      node_index: int32 ``(n_rows,)`` in ``[0, num_nodes)``; rows that belong to no node being
        built must be left out by ``row_mask`` or carry zero gradient and Hessian (their index
        is then irrelevant).
      gradients, hessians: float32 ``(n_rows,)``.
      num_nodes, max_bin: static sizes.
      row_mask: optional bool ``(n_rows,)``: only these rows are summed (the native kernel
        skips the others, which is what makes building only the smaller children cheap).
      kernel: "auto" (native on CPU when available, else XLA), "xla", or "native" (error when
        the native kernel is unavailable). The environment variable ``JAXBOOST_NATIVE=0``
        makes "auto" mean "xla".
      threads: CPU threads of the native kernel (each takes a range of features); keep 1 when
        rows are sharded over one device per core.
      row_ranges: the native kernel sums the rows in up to this many contiguous ranges (each of
        at least 4096 rows), each into cells of its own, on XLA's CPU threads (those of the
        program's device), and adds them up range by range: the sums depend on the number of
        ranges, never on the threads that ran them. For the first pair of channels only, and
        not with ``row_order``; 1: the rows in one pass. The XLA kernel ignores it.
      feature_major: the native kernel lays the result out in memory feature by feature (the
        array is the same; XLA's layout is ``(n_features, num_nodes, max_bin, 2)``), so that
        summing it over devices scattered by feature needs no transpose first.
      result_features: feature slots of the result (None: ``n_features``): the codes' features,
        then zero ones (so that the features divide into equal blocks, one per device). Fewer
        than ``n_features`` make the result compact: the features of ``features_used`` (at most
        that many) fill its first slots in feature order, the rest are zero.
      row_offset: int32 scalar, the first local row's column in ``X_binned_T`` (the devices of
        a CPU share one table, each reading its own columns), or None when the columns are
        the rows.
      channels, channel, into: for histograms of more channels than one (g, h) pair, built a
        pair at a time: ``channels`` (even) per cell, this pair's sums in ``[channel, channel +
        2)``; ``into`` holds the earlier pairs' (the result of the call for ``channel - 2``),
        None for channel 0. The native kernel writes each pair into the one buffer in place.
      features_used: optional bool ``(n_features,)``: the features whose cells are read (a
        tree's column sample). The native kernel sums only those and leaves the others' cells
        zero (or, compact, has none); the XLA kernel sums every feature for a full result and the
        used ones alone for a compact one. None: all.
      deterministic: on accelerators, sum the rows as fixed-point integers
        (``jaxboost.fixed_point``), so the result does not depend on the order of the atomic
        adds; the CPU kernels add the rows in one order whatever this says.
      row_order: the native kernel adds a root's rows (one node, every row) to its cells in row
        order, as the channel kernel does, rather than alternating them between the cells and a
        second copy of them (faster where consecutive rows share a code); for pairs whose tree
        must be the channel kernel's, bit for bit.

    Returns:
      float32 ``(num_nodes, result_features, max_bin, channels)``: ``[..., channel]`` sums of
      gradients, ``[..., channel + 1]`` sums of Hessians, the other channels as in ``into``.
    """
    if row_mask is not None and jnp.shape(row_mask) != jnp.shape(node_index):
        raise ValueError(f"row_mask must hold one flag per row, shape {node_index.shape}; got {jnp.shape(row_mask)}")
    target = _choose_native_target(HISTOGRAM_TARGET, "histogram", kernel, threads, X_binned_T, max_bin, row_ranges)
    result_features = X_binned_T.shape[0] if result_features is None else result_features
    into = _earlier_channels(into, (num_nodes, result_features, max_bin), channels, channel)
    args = (X_binned_T, _offset_operand(X_binned_T, row_offset, node_index), node_index.astype(jnp.int32),
            gradients.astype(jnp.float32), hessians.astype(jnp.float32),
            jnp.zeros((0,), bool) if row_mask is None else row_mask.astype(bool), into,
            _features_used_operand(features_used, X_binned_T, result_features))
    xla = _xla_result(partial(_xla_histogram, num_nodes=num_nodes, max_bin=max_bin, deterministic=deterministic),
                      result_features, channels, channel)
    if target is None:
        return xla(*args)
    native = partial(_native_histogram, target=target, num_nodes=num_nodes, max_bin=max_bin, threads=threads,
                     feature_major=feature_major, result_features=result_features, channels=channels,
                     channel=channel, row_order=row_order, row_ranges=row_ranges)
    # Chosen when lowering: the FFI target exists only on CPU.
    return per_platform(*args, cpu=native, default=xla)


def _features_used_operand(features_used, X_binned_T, result_features: int) -> jax.Array:
    """The native kernels' operand for ``features_used``: one flag per feature, or empty for all."""
    if features_used is None:
        if result_features < X_binned_T.shape[0]:
            raise ValueError(f"a compact histogram ({result_features} feature slots for {X_binned_T.shape[0]} "
                             "features) needs features_used")
        return jnp.zeros((0,), bool)
    if jnp.shape(features_used) != X_binned_T.shape[:1]:
        raise ValueError(f"features_used must hold one flag per feature, shape {X_binned_T.shape[:1]}; got "
                         f"{jnp.shape(features_used)}")
    return jnp.asarray(features_used).astype(bool)


def _xla_result(kernel, result_features: int, channels: int, channel: int):
    """An XLA ``kernel`` called with the native kernels' operands, its histogram (its result, or
    the last of them: one (g, h) pair a cell) made into theirs: in ``result_features`` slots
    (padded with zero features, or compact: the kernel is given the used features' list, as
    ``features``, and sums those alone), written into channels ``[channel, channel + 2)`` of the
    cells of ``into`` (the operand before ``features_used``; empty for channel 0: the other
    channels are then zeros)."""
    def call(*args):
        *operands, into, features_used = args
        n_features = operands[0].shape[0]
        if result_features < n_features:
            (listed,) = jnp.nonzero(features_used, size=result_features, fill_value=n_features)
            outputs = kernel(*operands, features=listed)
        else:
            outputs = kernel(*operands)
        pair = outputs[-1] if isinstance(outputs, tuple) else outputs
        if result_features > n_features:
            pair = jnp.pad(pair, ((0, 0), (0, result_features - n_features), (0, 0), (0, 0)))
        if channels != 2:
            earlier = into if channel else jnp.zeros(pair.shape[:-1] + (channels,), jnp.float32)
            pair = earlier.at[..., channel:channel + 2].set(pair)
        return outputs[:-1] + (pair,) if isinstance(outputs, tuple) else pair
    return call


def _earlier_channels(into, cells: tuple, channels: int, channel: int) -> jax.Array:
    """``into`` checked against the pair's place in the cells (an empty operand for channel 0)."""
    if channels < 2 or channels % 2 or channel < 0 or channel % 2 or channel + 2 > channels:
        raise ValueError(f"channel must be even and leave a pair in the {channels} channels (an even number); "
                         f"got channel {channel}")
    if (into is None) != (channel == 0):
        raise ValueError("into (the earlier pairs' histogram) is given exactly for a channel past 0")
    if into is None:
        return jnp.zeros((0,), jnp.float32)
    if jnp.shape(into) != cells + (channels,) or into.dtype != jnp.float32:
        raise ValueError(f"into must be float32 {cells + (channels,)}; got {into.dtype} {jnp.shape(into)}")
    return into


def route_and_build_histogram(X_binned_T: jax.Array, node_of_row: jax.Array, gradients: jax.Array,
                              hessians: jax.Array, split_feature: jax.Array, split_threshold_bin: jax.Array,
                              split_default_left: jax.Array, splits: jax.Array, left_is_smaller: jax.Array,
                              max_bin: int, kernel: str = "auto", threads: int = 1,
                              feature_major: bool = False, result_features: int | None = None,
                              row_offset: jax.Array | None = None, histogram_nodes: int | None = None,
                              live_nodes: jax.Array | None = None, channels: int = 2,
                              features_used: jax.Array | None = None,
                              deterministic: bool = False, row_ranges: int = 1) -> tuple[jax.Array, jax.Array]:
    """Route the local rows to the children of a level's splits, and histogram the smaller children.

    One pass over the rows does what would otherwise be a gather, several element-wise ops and
    a masked histogram: row ``i`` in node ``p`` goes to child ``2 p + goes_right`` (codes equal
    to ``max_bin - 1`` are missing and follow ``split_default_left[p]``, others go right when
    above ``split_threshold_bin[p]``), and the histogram sums the rows of node ``p``'s smaller
    child (left when ``left_is_smaller[p]``) for the nodes that split.

    Args:
      X_binned_T, node_of_row, gradients, hessians: as for ``build_histogram``; ``node_of_row``
        in ``[0, num_nodes)`` with ``num_nodes = splits.shape[0]``.
      split_feature, split_threshold_bin: int32 ``(num_nodes,)``; split_default_left, splits,
        left_is_smaller: bool ``(num_nodes,)``. ``left_is_smaller`` must be the same on every
        device when rows are sharded (e.g. from the split's global left/right sums), so that
        every device builds the same children.
      max_bin: static number of bins; the missing code is ``max_bin - 1``.
      kernel, threads, feature_major, result_features, row_offset, features_used, deterministic:
        as for ``build_histogram``; channels too: the pair is channels 0 and 1 of cells of
        ``channels`` (the others zero for the XLA kernel, unwritten by the native one), which
        ``build_histogram`` fills.
      histogram_nodes: static; only the smaller children of the first ``histogram_nodes``
        nodes are summed (None: of all ``num_nodes``). A level held in more slots than can
        hold a parent routes every slot but builds histograms for those only.
      live_nodes: int32 scalar or None: no row lies in a node from ``live_nodes`` on, and the
        native kernel leaves those nodes' histogram cells unwritten (unspecified) rather
        than zeroing them (a level's nodes fill the leading slots of a wider buffer).

    Returns:
      ``(child_of_row, smaller)``: int32 ``(n_rows,)`` and float32
      ``(histogram_nodes, result_features, max_bin, channels)`` indexed by the parent's position.
      Only the cells of nodes that split are specified: the native kernel leaves the others
      unwritten too (most slots of a deep level hold no split), so callers read the smaller
      children of splitting nodes only.
    """
    num_nodes = jnp.shape(splits)[0]
    histogram_nodes = num_nodes if histogram_nodes is None else histogram_nodes
    if not 0 < histogram_nodes <= num_nodes:
        raise ValueError(f"histogram_nodes must lie in [1, {num_nodes}] (the nodes routed); got {histogram_nodes}")
    for name, value in [("split_feature", split_feature), ("split_threshold_bin", split_threshold_bin),
                        ("split_default_left", split_default_left), ("left_is_smaller", left_is_smaller)]:
        if jnp.shape(value) != (num_nodes,):
            raise ValueError(f"{name} must have shape ({num_nodes},) like splits; got {jnp.shape(value)}")
    target = _choose_native_target(ROUTE_HISTOGRAM_TARGET, "route", kernel, threads, X_binned_T, max_bin, row_ranges)
    result_features = X_binned_T.shape[0] if result_features is None else result_features
    args = (X_binned_T, _offset_operand(X_binned_T, row_offset, node_of_row), node_of_row.astype(jnp.int32),
            gradients.astype(jnp.float32), hessians.astype(jnp.float32), split_feature.astype(jnp.int32),
            split_threshold_bin.astype(jnp.int32), split_default_left.astype(bool), splits.astype(bool),
            left_is_smaller.astype(bool),
            jnp.reshape(jnp.asarray(histogram_nodes if live_nodes is None else live_nodes, jnp.int32), (1,)),
            _earlier_channels(None, (), channels, 0),
            _features_used_operand(features_used, X_binned_T, result_features))
    xla = _xla_result(partial(_xla_route_histogram, num_nodes=histogram_nodes, max_bin=max_bin,
                              deterministic=deterministic), result_features, channels, 0)
    if target is None:
        return xla(*args)
    native = partial(_native_route_histogram, target=target, num_nodes=histogram_nodes, max_bin=max_bin,
                     threads=threads, feature_major=feature_major, result_features=result_features,
                     channels=channels, row_ranges=row_ranges)
    # Chosen when lowering: the FFI target exists only on CPU.
    return per_platform(*args, cpu=native, default=xla)


def cumulative_over_bins(histograms: jax.Array, kernel: str = "auto") -> jax.Array:
    """Running sums over the bin axis: ``jnp.cumsum(histograms, axis=-2)`` for float32
    ``(..., bins, channels)`` histograms. ``kernel`` as for ``build_histogram``.

    On CPU a native kernel does it: XLA's CPU cumsum is a reduce-window that re-adds the whole
    window for every bin (7 ms a tree in the split scans of a depth-6 tree, against 0.5 ms)."""
    histograms = jnp.asarray(histograms, jnp.float32)
    if histograms.ndim < 2:
        raise ValueError(f"histograms must have a bin and a channel axis; got shape {histograms.shape}")
    target = available_native_target(CUMULATIVE_BINS_TARGET, "cumulative-bins", kernel)

    def xla(values):
        return jnp.cumsum(values, axis=-2)

    if target is None:
        return xla(histograms)

    def native(values):
        result = jax.ShapeDtypeStruct(values.shape, jnp.float32)
        # Leading axes are batch axes to the kernel, so a vmapped call is one call.
        return as_varying_as(jax.ffi.ffi_call(target, result, vmap_method="expand_dims")(values), (values,))

    return per_platform(histograms, cpu=native, default=xla)


def first_maximum(values: jax.Array, kernel: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``(argmax, max)`` of each row of float32 ``(rows, ...)`` values, over the row's
    remaining axes in row-major order: the first flat index of each row's maximum (argmax's tie
    rule) and the maximum. ``kernel`` as for ``build_histogram``.

    On CPU a native kernel reads the values once. XLA's variadic (value, index) reduce is several
    times slower on CPU, and as two plain reductions (the other backends' way) XLA fuses the
    computation of the values into both and so runs it twice. The values need not be reshaped
    to two axes first: on CPU a reshape that merges the split scan's (features, bins) axes left
    the fusion computing the gains as one flat loop, which LLVM did not vectorise (a node of
    300 features took 0.29 ms instead of 0.13)."""
    values = jnp.asarray(values, jnp.float32)
    if values.ndim < 2 or math.prod(values.shape[1:]) == 0:
        raise ValueError(f"values must be (rows, ...) with a non-empty row; got shape {values.shape}")
    target = available_native_target(FIRST_MAXIMUM_TARGET, "first-maximum", kernel)

    def xla(v):
        # The barrier makes both reductions read one computed array: fused separately, the values
        # could be recomputed with different rounding and the maximum then match nothing.
        v = lax.optimization_barrier(v.reshape(v.shape[0], math.prod(v.shape[1:])))
        maximum = jnp.max(v, axis=1, keepdims=True)
        candidates = jnp.arange(v.shape[1], dtype=jnp.int32)
        return jnp.min(jnp.where(v == maximum, candidates, v.shape[1] - 1), axis=1), maximum[:, 0]

    if target is None:
        return xla(values)

    def native(v):
        results = (jax.ShapeDtypeStruct(v.shape[:1], jnp.int32), jax.ShapeDtypeStruct(v.shape[:1], jnp.float32))
        outputs = jax.ffi.ffi_call(target, results, vmap_method="sequential")(v)
        return tuple(as_varying_as(output, (v,)) for output in outputs)

    return per_platform(values, cpu=native, default=xla)


def top_after(values: jax.Array, last_value: jax.Array, last_index: jax.Array, k: int,
              kernel: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The indices and values of the ``k`` largest of each row of float32 ``(..., n)`` values
    that come after the row's ``last_value`` at ``last_index`` in ``lax.top_k``'s order (value
    descending, the lower index first among equal values); the others read as -inf: the indices
    that ``lax.top_k`` gives of the values so masked. Values must not be NaN. ``kernel`` as for
    ``build_histogram``.

    On CPU a native kernel keeps each row's k best in one pass, where XLA's TopK sorted the
    row's (value, index) pairs (a custom penalty's batches of candidates,
    ``split._best_of_contenders``)."""
    values = jnp.asarray(values, jnp.float32)
    last_value = jnp.asarray(last_value, jnp.float32)
    last_index = jnp.asarray(last_index, jnp.int32)
    if values.ndim < 1 or not 0 < k <= values.shape[-1] or last_value.shape != values.shape[:-1]:
        raise ValueError(f"values must be (..., n) with 0 < k <= n and one last value a row; got {values.shape}, "
                         f"k={k}, last values {last_value.shape}")
    target = available_native_target(TOP_AFTER_TARGET, "top-after", kernel)

    def xla(v, last, last_at):
        candidate = jnp.arange(v.shape[-1])
        after = (v < last[..., None]) | ((v == last[..., None]) & (candidate > last_at[..., None]))
        remaining = jnp.where(after, v, -jnp.inf)
        # The indices alone, the values read through them: with its values read, or its indices
        # sliced, XLA's CPU compiler made top_k a whole sort of each row.
        _, chosen = jax.lax.top_k(remaining, k)
        return chosen, jnp.take_along_axis(remaining, chosen, axis=-1)

    if target is None:
        return xla(values, last_value, last_index)

    def native(v, last, last_at):
        results = (jax.ShapeDtypeStruct(v.shape[:-1] + (k,), jnp.int32),
                   jax.ShapeDtypeStruct(v.shape[:-1] + (k,), jnp.float32))
        # Leading axes are more rows to the kernel, so a vmapped call is one call.
        outputs = jax.ffi.ffi_call(target, results, vmap_method="broadcast_all")(v, last, last_at)
        return tuple(as_varying_as(output, (v,)) for output in outputs)

    return per_platform(values, last_value, last_index, cpu=native, default=xla)


def _offset_operand(X_binned_T, row_offset, rows: jax.Array) -> jax.Array:
    """``row_offset`` as the kernels' int32 ``(1,)`` operand (0 when None, after checking that
    the code table's columns are the rows)."""
    if row_offset is None:
        if jnp.shape(X_binned_T)[1] != jnp.shape(rows)[0]:
            raise ValueError(f"X_binned_T has {jnp.shape(X_binned_T)[1]} rows (columns) but the per-row arrays "
                             f"{jnp.shape(rows)[0]}; pass row_offset to read a window of a wider table")
        return jnp.zeros((1,), jnp.int32)
    return jnp.reshape(jnp.asarray(row_offset, jnp.int32), (1,))


def _local_codes(X_binned_T, row_offset, n_rows: int):
    """The columns of the local rows (the XLA kernels' view of ``row_offset``): a copy when
    the table is wider than the rows, which only the native kernels avoid."""
    if X_binned_T.shape[1] == n_rows:
        return X_binned_T
    return lax.dynamic_slice_in_dim(X_binned_T, row_offset[0], n_rows, axis=1)


def _xla_route(X_binned_T, row_offset, node_of_row, feature, threshold_bin, default_left, *, max_bin):
    """``(child_of_row, goes_right)``: codes equal to ``max_bin - 1`` are missing and follow the
    node's default direction."""
    code = X_binned_T[feature[node_of_row], row_offset[0] + jnp.arange(node_of_row.shape[0])]
    goes_right = jnp.where(code == max_bin - 1, ~default_left[node_of_row], code > threshold_bin[node_of_row])
    return 2 * node_of_row + goes_right.astype(jnp.int32), goes_right


def _xla_route_histogram(X_binned_T, row_offset, node_of_row, gradients, hessians, feature, threshold_bin,
                         default_left, splits, left_is_smaller, live_nodes, *, num_nodes, max_bin, features=None,
                         deterministic: bool = False):
    del live_nodes  # every node's cells are summed (zeros where no row lies)
    child_of_row, goes_right = _xla_route(X_binned_T, row_offset, node_of_row, feature, threshold_bin, default_left,
                                          max_bin=max_bin)
    in_smaller_child = _in_smaller_child(node_of_row, goes_right, splits, left_is_smaller, num_nodes)
    return child_of_row, _xla_histogram(X_binned_T, row_offset, node_of_row, gradients, hessians, in_smaller_child,
                                        num_nodes=num_nodes, max_bin=max_bin, features=features,
                                        deterministic=deterministic)


def _in_smaller_child(node_of_row, goes_right, splits, left_is_smaller, histogram_nodes: int) -> jax.Array:
    """The rows that a level's histogram sums: in the smaller child of one of the first
    ``histogram_nodes`` nodes, if that node splits."""
    return (splits[node_of_row] & (goes_right != left_is_smaller[node_of_row])
            & (node_of_row < histogram_nodes))


def _routed_to_smaller_child(node_of_row, child_of_row, splits, left_is_smaller, histogram_nodes: int) -> jax.Array:
    """``_in_smaller_child`` of rows routed to ``child_of_row`` (``2 node + goes_right``)."""
    goes_right = (child_of_row - 2 * node_of_row) == 1
    return _in_smaller_child(node_of_row, goes_right, splits, left_is_smaller, histogram_nodes)


# The native kernels' result layouts, major to minor: node-major or feature-major.
FEATURE_MAJOR_LAYOUT = (1, 0, 2, 3)
_HISTOGRAM_LAYOUTS = {False: (0, 1, 2, 3), True: FEATURE_MAJOR_LAYOUT}


def _native_route_histogram(X_binned_T, row_offset, node_of_row, gradients, hessians, feature, threshold_bin,
                            default_left, splits, left_is_smaller, live_nodes, into, features_used, *, target,
                            num_nodes, max_bin, threads, feature_major, result_features, channels, row_ranges):
    results = (jax.ShapeDtypeStruct(node_of_row.shape, jnp.int32),
               jax.ShapeDtypeStruct((num_nodes, result_features, max_bin, channels), jnp.float32))
    inputs = (X_binned_T, row_offset, node_of_row, gradients, hessians, feature, threshold_bin, default_left,
              splits, left_is_smaller, live_nodes, into, features_used)
    # One thread reads each row's node before writing its child (or, with row ranges, one a
    # range), so the children may overwrite the nodes: XLA then updates the level loop's row
    # positions in place instead of copying them into the loop state every level. Threads
    # that take features all read every row's node.
    outputs = jax.ffi.ffi_call(target, results, vmap_method="sequential",
                               output_layouts=[None, _HISTOGRAM_LAYOUTS[feature_major]],
                               input_output_aliases={2: 0} if threads == 1 else None)(
        *inputs, missing_bin=np.int64(max_bin - 1), threads=np.int64(threads), row_ranges=np.int64(row_ranges),
        feature_major=np.int64(feature_major), channel=np.int64(0))
    return tuple(as_varying_as(output, inputs) for output in outputs)


def _native_channel_histogram(X_binned_T, row_offset, node_index, statistics, more_statistics, row_mask, into,
                              features_used, *, target, num_nodes, max_bin, threads, feature_major, result_features,
                              width, channel):
    result = jax.ShapeDtypeStruct((num_nodes, result_features, max_bin, width), jnp.float32)
    layout = _HISTOGRAM_LAYOUTS[feature_major]
    inputs = (X_binned_T, row_offset, node_index, statistics, more_statistics, row_mask, into, features_used)
    histogram = jax.ffi.ffi_call(target, result, vmap_method="sequential", output_layouts=layout,
                                 input_layouts=[None] * 6 + [layout if channel else None, None],
                                 input_output_aliases={6: 0} if channel else None)(
        *inputs, threads=np.int64(threads), feature_major=np.int64(feature_major), channel=np.int64(channel))
    return as_varying_as(histogram, inputs)


def _native_histogram(X_binned_T, row_offset, node_index, gradients, hessians, row_mask, into, features_used, *,
                      target, num_nodes, max_bin, threads, feature_major, result_features, channels, channel,
                      row_order, row_ranges):
    result = jax.ShapeDtypeStruct((num_nodes, result_features, max_bin, channels), jnp.float32)
    inputs = (X_binned_T, row_offset, node_index, gradients, hessians, row_mask, into, features_used)
    # Under vmap (several models trained at once) the kernel runs once per batch member. Past
    # channel 0 the result is the earlier channels' buffer, written in place.
    histogram = jax.ffi.ffi_call(target, result, vmap_method="sequential",
                                 output_layouts=_HISTOGRAM_LAYOUTS[feature_major],
                                 input_layouts=[None] * 6 + [_HISTOGRAM_LAYOUTS[feature_major] if channel else None,
                                                             None],
                                 input_output_aliases={6: 0} if channel else None)(
        *inputs, threads=np.int64(threads), row_ranges=np.int64(row_ranges), feature_major=np.int64(feature_major),
        channel=np.int64(channel), row_order=np.int64(row_order))
    return as_varying_as(histogram, inputs)


def _xla_histogram(X_binned_T, row_offset, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
                   features=None, deterministic: bool = False):
    """The XLA kernels' histogram of every feature, or with ``features`` (int32, one a slot; past
    the last feature: a zero slot) of those alone, their codes taken out before the sums.
    ``deterministic``: the accelerators' kernel sums fixed-point integers (the CPU's adds the
    rows in one order anyway)."""
    X_binned_T = _local_codes(X_binned_T, row_offset, node_index.shape[0])
    n_features = X_binned_T.shape[0]
    if features is not None:
        X_binned_T = jnp.take(X_binned_T, features, axis=0, mode="fill", fill_value=0)
    args = (X_binned_T, node_index, gradients, hessians, row_mask)
    sizes = dict(num_nodes=num_nodes, max_bin=max_bin)
    # Chosen when lowering: complex64 scatters are the faster XLA kernel on CPU, and on a GPU
    # 20 to 1000 times slower than the float32 kernel (an atomic compare-and-swap loop per add).
    histogram = per_platform(*args, cpu=partial(_complex_scatter_histogram, **sizes),
                             default=partial(_pair_scatter_histogram, **sizes, deterministic=deterministic))
    if features is None:
        return histogram
    # Spare slots read code 0 of every row: their sums are dropped.
    return jnp.where((features < n_features)[None, :, None, None], histogram, 0.0)


def _complex_scatter_histogram(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin):
    """One ``segment_sum`` of complex64 ``(g, h)`` per feature, rows outside the mask adding zeros."""
    if row_mask.shape[0]:
        gradients = jnp.where(row_mask, gradients, 0.0)
        hessians = jnp.where(row_mask, hessians, 0.0)
    n_features = X_binned_T.shape[0]
    packed = lax.complex(gradients, hessians)
    node_offset = node_index.astype(jnp.int32) * max_bin

    def one_feature(codes):
        return jax.ops.segment_sum(packed, node_offset + codes.astype(jnp.int32),
                                   num_segments=num_nodes * max_bin, indices_are_sorted=False)

    per_feature = lax.map(one_feature, X_binned_T)  # (d, nodes * bins) complex64
    per_feature = per_feature.reshape(n_features, num_nodes, max_bin).transpose(1, 0, 2)
    return jnp.stack([per_feature.real, per_feature.imag], axis=-1)


# Atomic adds into few cells wait on one another: the root's rows all land in 256 bins of a
# feature, and a level's loop runs in buffers of its widest level (32 node slots at depth 6) while
# the first levels' rows fill a few of those nodes. The kernel therefore scatters into a fixed
# number of node slots shared out among the level's live nodes: with L nodes in use each gets
# slots // L copies (the root 256, the last level of a depth-6 tree 8), row i adding into its
# node's copy i % (slots // L), and the copies are folded back after. Whole trees on an H200, 1M x
# 28 (experiments/results/gpu_level_copies.md): the same copies for every level, 2 a node (64
# cells a copy, at most 8) 4.7 ms a tree, 32 (1024, at most 32) 2.2; 256 slots shared out 1.7.
_SCATTER_NODE_SLOTS = 256
# Bounds on one scatter: its flat index is int32; its index and update arrays (one entry per
# row and feature) are materialised; its slots take at most this many cells (two float32
# each: 128 MB). Features go in groups that keep within all three.
_MAX_SCATTER_ENTRIES = 2 ** 26
_MAX_SCATTER_CELLS = 2 ** 24


def scatter_slots(num_nodes: int) -> int:
    """Node slots the accelerators' kernel scatters into for ``num_nodes`` nodes: copies of the
    live nodes' histograms, shared out when the level's rows are summed."""
    return max(_SCATTER_NODE_SLOTS, num_nodes)


def scatter_layout(n_features: int, n_rows: int, num_nodes: int, max_bin: int) -> tuple[int, int]:
    """``(slots, features a scatter)`` of the accelerators' kernel: ``scatter_slots`` node
    slots, and the most features one scatter takes within its bounds (at least one)."""
    slots = scatter_slots(num_nodes)
    cells = slots * max_bin
    # Dropped rows' indices lie up to one group's cells past the end: still an int32.
    features = min(n_features, (2 ** 31 - 1) // (2 * cells), _MAX_SCATTER_ENTRIES // max(n_rows, 1),
                   _MAX_SCATTER_CELLS // cells)
    return slots, max(1, features)


def _pair_scatter_histogram(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
                            features_per_scatter: int | None = None, deterministic: bool = False):
    """float32 ``(g, h)`` pairs scattered over all features at once (or in groups,
    ``scatter_layout``) into ``scatter_slots`` node slots, each live node's rows spread over an
    equal share of them, then folded back to ``num_nodes`` nodes. Rows outside the mask or the
    nodes get an index past the end, which the scatter drops before any add.

    ``deterministic``: each of ``g`` and ``h`` goes in as whole-number float32 pieces
    (``jaxboost.fixed_point``), as many as keep 24 bits of a value, with bits a piece from the
    most rows one copy of a cell can get, so that every partial sum is exact; the copies are
    folded in int32. No sum then depends on the order of the atomic adds."""
    n_features, n_rows = X_binned_T.shape
    slots, most_features = scatter_layout(n_features, n_rows, num_nodes, max_bin)
    cells = slots * max_bin
    features_per_scatter = most_features if features_per_scatter is None else features_per_scatter
    groups = -(-n_features // features_per_scatter)
    codes = jnp.pad(X_binned_T, ((0, groups * features_per_scatter - n_features), (0, 0)))
    size = features_per_scatter * cells
    # Rows outside the mask, and rows of nodes outside [0, num_nodes) (which a segment sum
    # drops too), go past the end.
    kept = (node_index >= 0) & (node_index < num_nodes)
    kept = kept & row_mask if row_mask.shape[0] else kept
    live = jnp.maximum(jnp.max(jnp.where(kept, node_index, -1)) + 1, 1)
    copies = jnp.maximum(slots // live, 1)
    slot = node_index.astype(jnp.int32) + live * (jnp.arange(n_rows, dtype=jnp.int32) % copies)
    row_cell = jnp.where(kept, slot * max_bin, size)
    feature_cell = jnp.arange(features_per_scatter, dtype=jnp.int32)[:, None] * cells
    if deterministic:
        # Row i goes to copy i % copies: a copy's cell gets at most ceil(n_rows / copies) rows,
        # and a level gets at least slots // num_nodes copies.
        pieces = float_pieces_needed(-(-n_rows // max(slots // num_nodes, 1)), n_rows)
        bits = float_piece_bits((n_rows + copies - 1) // copies, n_rows)
        scales = (magnitude_scale(gradients, bits, kept), magnitude_scale(hessians, bits, kept))
        per_row = jnp.stack([piece for values, scale in zip((gradients, hessians), scales)
                             for piece in to_pieces(values, scale, bits, pieces)], axis=-1)
    else:
        per_row = jnp.stack([gradients, hessians], axis=-1)
    width = per_row.shape[-1]
    per_row = jnp.broadcast_to(per_row, (features_per_scatter, n_rows, width))
    # Slot s holds a copy of node s % live (the slots past live * copies stay zero).
    owner = jnp.arange(slots, dtype=jnp.int32) % live

    def one_group(group_codes):
        index = row_cell + feature_cell + group_codes.astype(jnp.int32)
        sums = jnp.zeros((size, width), jnp.float32).at[index.reshape(-1)].add(per_row.reshape(-1, width),
                                                                                mode="drop")
        sums = sums.reshape(features_per_scatter, slots, max_bin, width)
        if deterministic:
            sums = sums.astype(jnp.int32)  # whole numbers: the fold's sums in int32, exact too
        sums = jnp.zeros((features_per_scatter, num_nodes, max_bin, width), sums.dtype).at[:, owner].add(sums)
        if not deterministic:
            return sums
        return jnp.stack([from_pieces([sums[..., k * pieces + j] for j in range(pieces)], scale, bits)
                          for k, scale in enumerate(scales)], axis=-1)

    per_group = lax.map(one_group, codes.reshape(groups, features_per_scatter, n_rows))
    per_feature = per_group.reshape(groups * features_per_scatter, num_nodes, max_bin, 2)[:n_features]
    return per_feature.transpose(1, 0, 2, 3)


def paired_width(channels: int) -> int:
    """Channels of the kernels' cells for ``channels`` statistics: the kernels add pairs of
    channels, so an odd number is padded with a zero channel."""
    return channels + channels % 2


class StatisticPairs(NamedTuple):
    """Per-row statistics as the ``(first, second)`` float32 ``(n_rows,)`` column pairs the
    kernels read, two channels per pass, and (``blocks``) as the ``(n_rows, C_i)`` arrays they
    came from, whose columns side by side are the channels: the native kernel of many channels
    reads up to two of them whole, joining a row's columns as it copies the row (vector leaves'
    gradients and packed Hessians, as the derivatives' program gives them, had been a copy of
    both joined into one array: 20 MB a device at 80k rows of 65 channels); more blocks are
    summed a pair of channels at a time. Formed once per tree: slicing the columns of an
    ``(n_rows, C)`` array inside the level loop copied them at every level."""

    pairs: tuple
    channels: int
    blocks: tuple | None = None

    @property
    def width(self) -> int:
        """Channels of the kernels' cells (``paired_width``)."""
        return paired_width(self.channels)


def statistic_pairs(statistics) -> StatisticPairs:
    """``(n_rows, C)`` statistics, or a sequence of ``(n_rows, C_i)`` blocks whose columns side
    by side are the channels, as column pairs (the last padded with zeros when the channels are
    odd); a ``StatisticPairs`` is returned as it is."""
    if isinstance(statistics, StatisticPairs):
        return statistics
    blocks = tuple(jnp.asarray(block, jnp.float32) for block in
                   (statistics if isinstance(statistics, (tuple, list)) else (statistics,)))
    columns = [block[:, i] for block in blocks for i in range(block.shape[1])]
    channels = len(columns)
    if channels % 2:
        columns.append(jnp.zeros_like(columns[0]))
    return StatisticPairs(tuple(zip(columns[::2], columns[1::2])), channels, blocks)


def build_statistics_histogram(X_binned_T: jax.Array, node_index: jax.Array,
                               statistics: jax.Array | StatisticPairs, num_nodes: int, max_bin: int,
                               row_mask: jax.Array | None = None, feature_major: bool = False,
                               result_features: int | None = None, row_offset: jax.Array | None = None,
                               threads: int = 1, keep_padding: bool = False,
                               features_used: jax.Array | None = None, deterministic: bool = False,
                               row_ranges: int = 1) -> jax.Array:
    """``build_histogram`` for any number of per-row channels (vector leaves: K gradients and
    the packed Hessian), two channels per kernel pass. ``row_ranges`` serves one pair of
    channels (scalar leaves); more are summed in one pass over the rows.

    Returns float32 ``(num_nodes, n_features, max_bin, C)`` for ``statistics`` ``(n_rows, C)``
    (or their ``StatisticPairs``); with ``keep_padding``, ``statistics.width`` channels, the last
    zero when C is odd (the grower keeps it: dropping it copied a level's cells).
    """
    statistics = statistic_pairs(statistics)
    options = dict(threads=threads, feature_major=feature_major, result_features=result_features,
                   row_offset=row_offset, features_used=features_used, deterministic=deterministic)
    if len(statistics.pairs) == 1:
        histogram = build_histogram(X_binned_T, node_index, *statistics.pairs[0], num_nodes, max_bin, row_mask,
                                    row_ranges=row_ranges, **options)
    else:
        histogram = build_channels_histogram(X_binned_T, node_index, statistics, num_nodes, max_bin, row_mask,
                                             **options)
    return histogram if keep_padding else _without_padding(histogram, statistics.channels)


# Widest cells whose one-node histogram (a tree's root) the CPU builds a pair of channels per
# pass of the pair kernel rather than in one pass of the channel kernel: a root's cells stay in
# the caches, where the pair kernel's four features a row outrun the channel kernel's one (3
# classes, diagonal vector leaves, 160k rows: the root 23-29 -> 10-12 ms of the devices' time a
# round in 2 alternating profiles; 3 classes, full Hessian, width 10: 26-29 against 19-28; 10
# classes, diagonal, width 20: 32-39 against 43-53, slower).
ROOT_PAIR_PASSES_MAX_WIDTH = 8
# Widest cells whose histograms of several nodes (a level's smaller children) the CPU builds by
# pair passes over those children's rows too, rather than in the channel kernel's passes, the
# same sums bit for bit. In a tree's first 6 levels (at most ``ROUTED_NARROW_PARENTS_MAX`` parent
# slots, or a deep tree's first loop) the route kernel sums the first pair while it routes the
# rows, every parent at once, as for a scalar tree; in the deep levels' wide buffers the rows are
# routed by a pass of their own and the children summed a parent chunk at a time. Measured in whole rounds
# (`bench_vector_leaves.md`): the Student t with vector leaves (2 outputs, full Hessian: width 6)
# on 800k x 50 rows at depth 6, 271 against 322 ms a round with the chunked pair passes
# everywhere, 248 against 268 with the route kernel's first pair; at depth 10 the route kernel's
# first pair on every level was slower than the channel kernel (543-759 against 419-503 ms on
# 200k rows), the chunked passes as fast, and the two as above 375 against 412; 4 classes'
# diagonal (width 8) slower by pair passes, 45-60 against 38-52.
CHILDREN_PAIR_PASSES_MAX_WIDTH = 6
ROUTED_NARROW_PARENTS_MAX = 16


def _by_pair_passes(num_nodes: int, width: int) -> bool:
    """Whether the CPU builds a histogram of ``num_nodes`` nodes' cells of ``width`` channels by
    pair passes rather than by the channel kernel."""
    return width <= (ROOT_PAIR_PASSES_MAX_WIDTH if num_nodes == 1 else CHILDREN_PAIR_PASSES_MAX_WIDTH)


def builds_by_pair_passes(statistics: StatisticPairs, num_nodes: int, X_binned_T: jax.Array, max_bin: int,
                          kernel: str = "auto", threads: int = 1) -> bool:
    """Whether ``build_channels_histogram`` sums the statistics' pairs apart, each in cells of
    its own (no native channel kernel for them, or cells narrow enough for pair passes), rather
    than every channel of a row in one pass into cells of them all."""
    return _pairs_apart(_channel_kernel_target(statistics, kernel, threads, X_binned_T, max_bin), kernel, num_nodes,
                        statistics.width)


def _pairs_apart(channel_target: str | None, kernel: str, num_nodes: int, width: int) -> bool:
    """``builds_by_pair_passes`` given the channel kernel's target (None: none)."""
    return channel_target is None or (kernel == "auto" and _by_pair_passes(num_nodes, width))


def build_channels_histogram(X_binned_T: jax.Array, node_index: jax.Array, statistics: StatisticPairs,
                             num_nodes: int, max_bin: int, row_mask: jax.Array | None = None, kernel: str = "auto",
                             threads: int = 1, feature_major: bool = False, result_features: int | None = None,
                             row_offset: jax.Array | None = None, channel: int = 0,
                             into: jax.Array | None = None, features_used: jax.Array | None = None,
                             deterministic: bool = False) -> jax.Array:
    """The histogram of the statistics' channels from ``channel`` on, after ``into`` (the
    histogram of the channels before it; None for channel 0). Arguments as for
    ``build_histogram``.

    Returns float32 ``(num_nodes, result_features, max_bin, statistics.width)`` (an odd number
    of channels padded with a zero one). On CPU one native pass adds all of a row's
    channels to its cell (the channel kernel: ``into`` then holds every channel, the later ones
    to be written in place). Where pairs are built apart (``builds_by_pair_passes``: a root's
    cells of at most ``ROOT_PAIR_PASSES_MAX_WIDTH`` channels and several nodes' of at most
    ``CHILDREN_PAIR_PASSES_MAX_WIDTH``, the pair kernel; or without the channel kernel, and with
    ``kernel="xla"``, ``build_histogram``), on a CPU each pair is summed into cells of its own
    and the pairs are laid side by side after ``into``'s first ``channel`` channels; elsewhere
    each pair goes into the cells of all the channels, after the last. ``into`` may hold just
    the channels before ``channel`` (the route kernel's first pair, built apart).
    """
    result_features = X_binned_T.shape[0] if result_features is None else result_features
    width = statistics.width

    def full_width(earlier):
        # Earlier pairs built apart (a caller that chose pair passes where this path was taken).
        if earlier is None or earlier.shape[-1] == width:
            return earlier
        return jnp.pad(earlier, ((0, 0),) * (earlier.ndim - 1) + ((0, width - earlier.shape[-1]),))

    def pair_histogram(index: int, **cells):
        """Pair ``index``'s histogram (``cells``: its place in wider cells, as ``build_histogram``'s),
        its root's rows added in row order, so that pair passes and the channel kernel grow one
        tree, bit for bit, whichever the cells' width chooses."""
        return build_histogram(X_binned_T, node_index, *statistics.pairs[index], num_nodes, max_bin, row_mask,
                               kernel=kernel, threads=threads, feature_major=feature_major,
                               result_features=result_features, row_offset=row_offset, features_used=features_used,
                               deterministic=deterministic, row_order=True, **cells)

    def each_into_the_last(*_):
        histogram = full_width(into)
        for index in range(channel // 2, len(statistics.pairs)):
            histogram = pair_histogram(index, channels=width, channel=2 * index, into=histogram)
        return histogram

    def apart_then_joined(*_):
        # Each pair in cells of its own, two channels wide, joined once all are summed: a pair's
        # adds into cells of every channel spread over that many more cache lines (16 nodes x 50
        # features of 6 channels: 4.9 MB a device, against 1.6 MB a pair), and the passes ran
        # slower than a one-output tree's. Device time a round (2 devices, profiles alternating
        # with the passes into shared cells; the same trees): the Student t at 400k x 50 rows, the
        # children's three passes 63-68 against 81-100 ms, plus 11 to join them; 3 classes'
        # diagonal at 160k rows 33.5-36.7 against 44.9-46.4, plus 3.1-3.4, the round's 73-76
        # against 86-87. On CPU only: an accelerator's scattered adds have not been measured so.
        built = [pair_histogram(index) for index in range(channel // 2, len(statistics.pairs))]
        earlier = [] if into is None else [into if into.shape[-1] == channel else into[..., :channel]]
        if not feature_major:
            return jnp.concatenate(earlier + built, axis=-1)
        # Joined features first, as the kernels lay the cells out: joined nodes first, XLA wrote
        # the cells node by node and then copied them feature by feature (a pass over them more).
        joined = jnp.concatenate([jnp.swapaxes(part, 0, 1) for part in earlier + built], axis=-1)
        return jnp.swapaxes(joined, 0, 1)

    target = _channel_kernel_target(statistics, kernel, threads, X_binned_T, max_bin)
    if _pairs_apart(target, kernel, num_nodes, width):
        return per_platform(cpu=apart_then_joined, default=each_into_the_last)
    first, *more = statistics.blocks
    args = (X_binned_T, _offset_operand(X_binned_T, row_offset, node_index), node_index.astype(jnp.int32),
            first, more[0] if more else jnp.zeros((0, 0), jnp.float32),
            jnp.zeros((0,), bool) if row_mask is None else row_mask.astype(bool),
            _earlier_channels(full_width(into), (num_nodes, result_features, max_bin), width, channel),
            _features_used_operand(features_used, X_binned_T, result_features))
    native = partial(_native_channel_histogram, target=target, num_nodes=num_nodes, max_bin=max_bin, threads=threads,
                     feature_major=feature_major, result_features=result_features, width=width, channel=channel)
    # Chosen when lowering: the FFI target exists only on CPU.
    return per_platform(*args, cpu=native, default=each_into_the_last)


def _without_padding(histogram: jax.Array, channels: int) -> jax.Array:
    """The histogram without the zero channel that pads an odd number of channels to pairs."""
    return histogram if histogram.shape[-1] == channels else histogram[..., :channels]


def _channel_kernel_target(statistics: StatisticPairs, kernel: str, threads: int, X_binned_T: jax.Array,
                           max_bin: int) -> str | None:
    """The native kernel of many channels for ``statistics`` on a CPU, or None (statistics given
    as pairs alone, or as more blocks than it reads: a pair of channels at a time)."""
    if statistics.blocks is None or len(statistics.blocks) > 2:
        return None
    return _choose_native_target(CHANNEL_HISTOGRAM_TARGET, "channel histogram", kernel, threads, X_binned_T, max_bin)


def builds_channels_natively(statistics: StatisticPairs, X_binned_T: jax.Array, max_bin: int,
                             parents: int | None = None) -> bool:
    """Whether a level whose children's histograms are built for ``parents`` parent slots
    builds them from ``statistics`` (more than one pair) by native kernels of their own when
    lowered for a CPU, a parent chunk at a time (the channel kernel, or for narrow cells pair
    passes), rather than taking the first pair from the route kernel: not for cells of at most
    ``CHILDREN_PAIR_PASSES_MAX_WIDTH`` channels in a tree's first levels, ``parents`` at most
    ``ROUTED_NARROW_PARENTS_MAX`` or None (every slot of a deep tree's first loop, 32)."""
    if len(statistics.pairs) < 2 or _channel_kernel_target(statistics, "auto", 1, X_binned_T, max_bin) is None:
        return False
    first_levels = parents is None or parents <= ROUTED_NARROW_PARENTS_MAX
    return not (statistics.width <= CHILDREN_PAIR_PASSES_MAX_WIDTH and first_levels)


def route_to_children(X_binned_T: jax.Array, node_of_row: jax.Array, statistics: StatisticPairs,
                      split_feature: jax.Array, split_threshold_bin: jax.Array, split_default_left: jax.Array,
                      splits: jax.Array, left_is_smaller: jax.Array, max_bin: int, histogram_nodes: int | None,
                      feature_major: bool = False,
                      row_offset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(child_of_row, in_smaller_child)``: ``route_and_build_histogram``'s routing alone, and
    the rows whose smaller child of one of the first ``histogram_nodes`` nodes (None: of all)
    that split (``splits``) a histogram sums, for callers that build those histograms
    themselves (a few nodes at a time: ``grower.children_histograms_over_parents``)."""
    # No node splits for the kernel, which then only routes (its one node's cells unwritten).
    child_of_row, _ = route_and_build_histogram(
        X_binned_T, node_of_row, *statistics.pairs[0], split_feature, split_threshold_bin, split_default_left,
        jnp.zeros_like(splits), left_is_smaller, max_bin, feature_major=feature_major, row_offset=row_offset,
        histogram_nodes=1)
    histogram_nodes = jnp.shape(splits)[0] if histogram_nodes is None else histogram_nodes
    return child_of_row, _routed_to_smaller_child(node_of_row, child_of_row, splits, left_is_smaller,
                                                  histogram_nodes)


def route_and_build_statistics_histogram(X_binned_T: jax.Array, node_of_row: jax.Array,
                                         statistics: jax.Array | StatisticPairs,
                                         split_feature: jax.Array, split_threshold_bin: jax.Array,
                                         split_default_left: jax.Array, splits: jax.Array,
                                         left_is_smaller: jax.Array, max_bin: int,
                                         feature_major: bool = False, result_features: int | None = None,
                                         row_offset: jax.Array | None = None, histogram_nodes: int | None = None,
                                         live_nodes: jax.Array | None = None,
                                         threads: int = 1, keep_padding: bool = False,
                                         features_used: jax.Array | None = None,
                                         deterministic: bool = False,
                                         row_ranges: int = 1) -> tuple[jax.Array, jax.Array]:
    """``route_and_build_histogram`` for any number of channels: the first pair is histogrammed
    while routing, the others afterwards over the rows of the smaller children only.
    ``keep_padding`` and ``row_ranges`` as for ``build_statistics_histogram``."""
    statistics = statistic_pairs(statistics)
    pairs = statistics.pairs
    nodes = jnp.shape(splits)[0] if histogram_nodes is None else histogram_nodes
    # The first pair in cells of its own where the others are summed apart too.
    apart = len(pairs) > 1 and builds_by_pair_passes(statistics, nodes, X_binned_T, max_bin, threads=threads)
    child_of_row, histogram = route_and_build_histogram(
        X_binned_T, node_of_row, *pairs[0], split_feature, split_threshold_bin, split_default_left, splits,
        left_is_smaller, max_bin, threads=threads, feature_major=feature_major, result_features=result_features,
        row_offset=row_offset, histogram_nodes=histogram_nodes, live_nodes=live_nodes,
        channels=2 if apart else statistics.width, features_used=features_used, deterministic=deterministic,
        row_ranges=row_ranges if len(pairs) == 1 else 1)
    if len(pairs) > 1:
        in_smaller_child = _routed_to_smaller_child(node_of_row, child_of_row, splits, left_is_smaller,
                                                    histogram.shape[0])
        histogram = build_channels_histogram(X_binned_T, node_of_row, statistics, histogram.shape[0], max_bin,
                                             in_smaller_child, threads=threads, feature_major=feature_major,
                                             result_features=result_features, row_offset=row_offset, channel=2,
                                             into=histogram, features_used=features_used,
                                             deterministic=deterministic)
    return child_of_row, histogram if keep_padding else _without_padding(histogram, statistics.channels)
