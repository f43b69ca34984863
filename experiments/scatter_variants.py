"""Variants of the accelerators' histogram scatter (``histogram._pair_scatter_histogram``), for
``gpu_level_copies.py`` to time as whole trees on a GPU. Each takes the library kernel's
arguments and returns the same ``(nodes, features, bins, 2)`` float32 sums; the study swaps one in
for the library's in a child process.

* ``live_copies(node_slots)``: the library's kernel with another number of node slots. A level's
  loop runs in buffers of its widest level (32 slots at depth 6); with ``L`` nodes in use the
  kernel's ``node_slots`` slots give each ``node_slots // L`` copies.
* ``fixed_copies(cells_per_copy, max_copies)``: the kernel the library had before it shared its
  slots out, the same copies for every level: ``cells_per_copy // nodes`` copies of every node
  slot, at least 1, at most ``max_copies`` (1024 and 32: 32 x 32 = 1024 node slots at depth 6,
  most of which the first levels leave zero, and clear and sum all the same).
* ``skip_empty``: the library's kernel behind a ``lax.cond`` on whether any row is summed: the
  last level of a tree's loop sums none, yet its scatter reads every row.
* ``fixed_point``: sums that do not depend on the order of the adds (repeatable runs, as
  XGBoost's GPU histograms): each row's ``g`` and ``h`` become int32 multiples of ``1 / scale``,
  with ``scale = 2^30 / (rows x max |value|)`` so that no sum passes 2^31, are scattered as
  integers into fixed copies (1024 cells a copy, at most 32), and turned back into float32.
* ``float_pieces(pieces)``: order-independent sums through float32 atomics, which a GPU adds
  several at once (presumably one vector atomic a cell's channels) where int32 ones go one channel at a
  time: each of ``g`` and ``h`` becomes ``pieces`` whole numbers of ``bits`` bits each,
  ``bits`` taken, every level, from the most rows one copy of a cell can get (the rows over the
  copies) so that no partial sum passes 2^22: float32 adds whole numbers below 2^24 exactly,
  in any order. The copies are then folded in int32 (at most 256 copies: below 2^30). The
  library's ``deterministic_histogram`` adopted these pieces after this study, with partial sums
  up to float32's 2^24 and as many pieces as keep 24 bits of a value (``jaxboost.fixed_point``).

``python experiments/scatter_variants.py`` checks every variant against a NumPy histogram (on any
backend).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxboost import histogram  # noqa: E402


def _kept_rows(node_index, row_mask, num_nodes):
    kept = (node_index >= 0) & (node_index < num_nodes)
    return kept & row_mask if row_mask.shape[0] else kept


def live_copies(node_slots: int):
    """The library's kernel with ``node_slots`` node slots shared out among a level's live nodes."""

    def kernel(*args, **sizes):
        saved = histogram._SCATTER_NODE_SLOTS
        histogram._SCATTER_NODE_SLOTS = node_slots  # read while tracing only
        try:
            return LIBRARY_KERNEL(*args, **sizes)
        finally:
            histogram._SCATTER_NODE_SLOTS = saved

    return kernel


def _fixed_copies_count(num_nodes, cells_per_copy, max_copies):
    return int(np.clip(cells_per_copy // num_nodes, 1, max_copies))


def fixed_copies(cells_per_copy: int, max_copies: int):
    """Every node slot of every level in the same number of copies (the library's kernel before)."""

    def kernel(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
               features_per_scatter=None):
        del features_per_scatter  # one scatter over all features (the study's shapes fit)
        n_features, n_rows = X_binned_T.shape
        copies = _fixed_copies_count(num_nodes, cells_per_copy, max_copies)
        cells = num_nodes * max_bin
        size = copies * n_features * cells
        kept = _kept_rows(node_index, row_mask, num_nodes)
        row_cell = node_index.astype(jnp.int32) * max_bin + (
            jnp.arange(n_rows, dtype=jnp.int32) % copies) * (n_features * cells)
        row_cell = jnp.where(kept, row_cell, size)
        index = jnp.arange(n_features, dtype=jnp.int32)[:, None] * cells + row_cell + X_binned_T.astype(jnp.int32)
        pairs = jnp.broadcast_to(jnp.stack([gradients, hessians], axis=-1), (n_features, n_rows, 2))
        sums = jnp.zeros((size, 2), jnp.float32).at[index.reshape(-1)].add(pairs.reshape(-1, 2), mode="drop")
        sums = sums.reshape(copies, n_features, num_nodes, max_bin, 2).sum(axis=0)
        return sums.transpose(1, 0, 2, 3)

    return kernel


def skip_empty(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
               features_per_scatter=None):
    """The library's kernel, skipped (zeros) when no row is summed."""
    kept = _kept_rows(node_index, row_mask, num_nodes)
    n_features = X_binned_T.shape[0]
    return jax.lax.cond(
        jnp.any(kept),
        lambda: LIBRARY_KERNEL(X_binned_T, node_index, gradients, hessians, row_mask, num_nodes=num_nodes,
                               max_bin=max_bin, features_per_scatter=features_per_scatter),
        lambda: jnp.zeros((num_nodes, n_features, max_bin, 2), jnp.float32))


def fixed_point(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
                features_per_scatter=None):
    """Order-independent sums: int32 fixed point scattered into the library's copies."""
    n_features, n_rows = X_binned_T.shape
    kept = _kept_rows(node_index, row_mask, num_nodes)
    del features_per_scatter  # one scatter over all features (the study's shapes fit)
    copies = _fixed_copies_count(num_nodes, 1024, 32)
    # max, not a sum, sets the scale: a maximum does not depend on the order it is taken in.
    scales = [2.0 ** 30 / (n_rows * jnp.maximum(jnp.max(jnp.where(kept, jnp.abs(v), 0.0)), 1e-30))
              for v in (gradients, hessians)]
    quantised = jnp.stack([jnp.round(jnp.where(kept, v, 0.0) * s).astype(jnp.int32)
                           for v, s in zip((gradients, hessians), scales)], axis=-1)
    cells = num_nodes * max_bin
    size = copies * n_features * cells
    row_cell = node_index.astype(jnp.int32) * max_bin + (jnp.arange(n_rows, dtype=jnp.int32) % copies) * (
        n_features * cells)
    row_cell = jnp.where(kept, row_cell, size)
    index = jnp.arange(n_features, dtype=jnp.int32)[:, None] * cells + row_cell + X_binned_T.astype(jnp.int32)
    pairs = jnp.broadcast_to(quantised, (n_features, n_rows, 2))
    sums = jnp.zeros((size, 2), jnp.int32).at[index.reshape(-1)].add(pairs.reshape(-1, 2), mode="drop")
    sums = sums.reshape(copies, n_features, num_nodes, max_bin, 2).sum(axis=0)
    sums = sums.astype(jnp.float32) / jnp.stack(scales)
    return sums.transpose(1, 0, 2, 3)


def _power_of_two(exponent):
    """float32 2**exponent for a traced int32 exponent in the normal range (exact)."""
    return jax.lax.bitcast_convert_type((exponent + 127).astype(jnp.int32) << 23, jnp.float32)


def float_pieces(pieces: int):
    """Order-independent sums: ``pieces`` whole-number float32 pieces of each of g and h, scattered
    into the library's live copies, folded in int32."""

    def kernel(X_binned_T, node_index, gradients, hessians, row_mask, *, num_nodes, max_bin,
               features_per_scatter=None):
        del features_per_scatter  # one scatter over all features (the study's shapes fit)
        n_features, n_rows = X_binned_T.shape
        slots = histogram.scatter_slots(num_nodes)
        cells = slots * max_bin
        size = n_features * cells
        kept = _kept_rows(node_index, row_mask, num_nodes)
        live = jnp.maximum(jnp.max(jnp.where(kept, node_index, -1)) + 1, 1)
        copies = jnp.maximum(slots // live, 1)
        most_rows = (n_rows + copies - 1) // copies  # rows one copy of a cell can get
        log_rows = 32 - jax.lax.clz(jnp.maximum(most_rows - 1, 1).astype(jnp.int32))  # ceil(log2), >= 1
        bits = jnp.maximum(23 - log_rows, 1)  # most_rows * 2**(bits - 1) <= 2**22
        channels = []
        scales = []
        for values in (gradients, hessians):
            _, exponent = jnp.frexp(jnp.max(jnp.where(kept, jnp.abs(values), 0.0)))
            scale = _power_of_two(bits - 1 - jnp.clip(exponent, -100, 100))
            rest = values * scale
            for _ in range(pieces):
                piece = jnp.round(rest)
                channels.append(piece)
                rest = (rest - piece) * _power_of_two(bits)
            scales.append(scale)
        per_row = jnp.stack(channels, axis=-1)
        width = per_row.shape[-1]
        slot = node_index.astype(jnp.int32) + live * (jnp.arange(n_rows, dtype=jnp.int32) % copies)
        row_cell = jnp.where(kept, slot * max_bin, size)
        index = jnp.arange(n_features, dtype=jnp.int32)[:, None] * cells + row_cell + X_binned_T.astype(jnp.int32)
        updates = jnp.broadcast_to(per_row, (n_features, n_rows, width))
        sums = jnp.zeros((size, width), jnp.float32).at[index.reshape(-1)].add(updates.reshape(-1, width),
                                                                               mode="drop")
        sums = sums.astype(jnp.int32).reshape(n_features, slots, max_bin, width)
        owner = jnp.arange(slots, dtype=jnp.int32) % live
        sums = jnp.zeros((n_features, num_nodes, max_bin, width), jnp.int32).at[:, owner].add(sums)
        results = []
        for k, scale in enumerate(scales):
            value = jnp.zeros(sums.shape[:-1], jnp.float32)
            for j in reversed(range(pieces)):  # the smallest pieces first
                value = value * _power_of_two(-bits) + sums[..., k * pieces + j].astype(jnp.float32)
            results.append(value / scale)
        return jnp.stack(results, axis=-1).transpose(1, 0, 2, 3)

    return kernel


LIBRARY_KERNEL = histogram._pair_scatter_histogram
VARIANTS = {
    "live copies 128": live_copies(128),
    "live copies 512": live_copies(512),
    "fixed copies 1024/32": fixed_copies(1024, 32),
    "skip empty": skip_empty,
    "fixed point": fixed_point,
    "float pieces 2": float_pieces(2),
    "float pieces 4": float_pieces(4),
}


def _numpy_histogram(X_binned, node_index, gradients, hessians, row_mask, num_nodes, max_bin):
    out = np.zeros((num_nodes, X_binned.shape[1], max_bin, 2))
    for i in range(X_binned.shape[0]):
        if row_mask[i] and 0 <= node_index[i] < num_nodes:
            for f in range(X_binned.shape[1]):
                out[node_index[i], f, X_binned[i, f]] += (gradients[i], hessians[i])
    return out


def check() -> None:
    """Every variant against NumPy: a root, a level of 5 live nodes in 32 slots, an empty level."""
    rng = np.random.default_rng(0)
    n_rows, n_features, max_bin = 3001, 4, 16
    X_binned = rng.integers(0, max_bin, (n_rows, n_features)).astype(np.uint8)
    gradients = rng.normal(size=n_rows).astype(np.float32)
    hessians = rng.uniform(0.1, 1.0, n_rows).astype(np.float32)
    for num_nodes, live, mask_share in [(1, 1, 1.0), (32, 5, 0.5), (32, 5, 0.0)]:
        node_index = rng.integers(0, live, n_rows).astype(np.int32)
        row_mask = rng.uniform(size=n_rows) < mask_share
        expected = _numpy_histogram(X_binned, node_index, gradients, hessians, row_mask, num_nodes, max_bin)
        scale = max(np.abs(expected).max(), 1.0)
        for name, kernel in VARIANTS.items():
            actual = jax.jit(lambda *a, kernel=kernel: kernel(*a, num_nodes=num_nodes, max_bin=max_bin))(
                jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians),
                jnp.asarray(row_mask))
            error = float(np.abs(np.asarray(actual) - expected).max()) / scale
            tolerance = {"fixed point": 1e-4, "float pieces 2": 1e-3}.get(name, 1e-5)
            status = "ok" if error <= tolerance else "WRONG"
            print(f"{num_nodes:3d} slots, {live} live, {mask_share:.0%} of rows: {name:18s} error/max {error:.1e} {status}")
            if status != "ok":
                raise SystemExit(f"{name} does not match NumPy")
            if name.startswith("float pieces"):
                order = rng.permutation(n_rows)
                again = jax.jit(lambda *a, kernel=kernel: kernel(*a, num_nodes=num_nodes, max_bin=max_bin))(
                    jnp.asarray(X_binned[order].T), jnp.asarray(node_index[order]), jnp.asarray(gradients[order]),
                    jnp.asarray(hessians[order]), jnp.asarray(row_mask[order]))
                if not np.array_equal(np.asarray(again), np.asarray(actual)):
                    raise SystemExit(f"{name}: the rows' order changed the sums")


if __name__ == "__main__":
    check()
