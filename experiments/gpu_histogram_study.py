"""Study: which XLA formulation of the histogram is fastest on a GPU.

Run from the repository root on a machine with a GPU: ``python experiments/gpu_histogram_study.py``
(``--rows``, ``--features``, ``--repeats``; on a CPU it runs too, to check the variants). Every
variant computes the same ``(nodes, features, bins, 2)`` float32 histogram of gradient and Hessian
sums; each is checked against a float64 NumPy histogram before it is timed (median of
``--repeats`` calls after a warm-up, each call synchronised). Shapes are those of the benchmark's
classification task (800k training rows x 28 features, 256 bins): the root (1 node, every row) and
a deep level (16 parents, the smaller children's rows, about 45% of them, are summed).

Variants:

* ``library``: what ``build_histogram(kernel="xla")`` runs on the platform (on CPU the complex
  scatter below; elsewhere, since this study, a flat float32 scatter into copies of the histogram:
  at first ``flat_pair_copies`` with 8 copies for 1 to 8 nodes and 4 for 16, now 256 node slots
  shared out among the live nodes, ``gpu_level_copies.py``);
* ``complex_per_feature``: the CPU's XLA kernel, and before this study every platform's: a
  ``segment_sum`` of complex64 (g, h) per feature (``lax.map``), rows outside the mask adding zeros;
* ``flat_complex_drop``: one complex64 ``segment_sum`` over all features at once; rows outside
  the mask go to an out-of-range segment, which XLA drops before any atomic add;
* ``flat_pair_drop``: the same with float32 ``(g, h)`` pairs as the scattered window;
* ``map_pair_drop``: per feature (``lax.map``) float32 pairs, masked rows dropped;
* ``map_pair_copies16`` / ``flat_pair_copies8``: per feature / all features at once, float32
  pairs scattered into 16 / 8 copies of the histogram (row ``i`` into copy ``i % copies``), summed
  after: fewer atomic adds contend for one address;
* ``flat_two_drop``: two float32 scatters (g, then h) over all features, masked rows dropped;
* ``onehot_bf16x3``: per feature, a one-hot ``(rows, bins)`` bf16 matrix times the rows'
  ``(g, h)`` placed in their node's columns, split into three bf16 parts (hi, mid, lo) so that
  the float32 accumulation of exact products keeps float32 precision: matrix units instead of
  atomics;
* ``int_pair_drop`` (speed reference only; it rounds): float32 pairs quantised to int32 with one
  scale, scattered as integers (atomics on integers are native everywhere).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxboost.histogram import _complex_scatter_histogram, build_histogram

MAX_BIN = 256


def _dropped_index(X_binned_T, node_index, row_mask, num_nodes):
    """Flat ``(features, rows)`` segment index feature-major over ``(feature, node, bin)``; rows
    outside the mask get the out-of-range index ``features * num_nodes * MAX_BIN``."""
    n_features = X_binned_T.shape[0]
    per_row = node_index * MAX_BIN
    index = (jnp.arange(n_features, dtype=jnp.int32)[:, None] * (num_nodes * MAX_BIN) + per_row[None, :]
             + X_binned_T.astype(jnp.int32))
    return jnp.where(row_mask[None, :], index, n_features * num_nodes * MAX_BIN)


def _as_histogram(flat, n_features, num_nodes):
    """``(features * nodes * bins, 2)`` -> ``(nodes, features, bins, 2)``."""
    return flat.reshape(n_features, num_nodes, MAX_BIN, 2).transpose(1, 0, 2, 3)


def library(X_binned_T, node_index, g, h, row_mask, num_nodes):
    return build_histogram(X_binned_T, node_index, g, h, num_nodes, MAX_BIN, row_mask=row_mask, kernel="xla")


def complex_per_feature(X_binned_T, node_index, g, h, row_mask, num_nodes):
    return _complex_scatter_histogram(X_binned_T, node_index, g, h, row_mask, num_nodes=num_nodes, max_bin=MAX_BIN)


def flat_complex_drop(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    index = _dropped_index(X_binned_T, node_index, row_mask, num_nodes).reshape(-1)
    packed = jnp.broadcast_to(lax.complex(g, h)[None, :], X_binned_T.shape).reshape(-1)
    sums = jax.ops.segment_sum(packed, index, num_segments=n_features * num_nodes * MAX_BIN)
    return _as_histogram(jnp.stack([sums.real, sums.imag], axis=-1), n_features, num_nodes)


def flat_pair_drop(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    index = _dropped_index(X_binned_T, node_index, row_mask, num_nodes).reshape(-1)
    pairs = jnp.broadcast_to(jnp.stack([g, h], axis=-1)[None], (n_features, g.shape[0], 2)).reshape(-1, 2)
    sums = jnp.zeros((n_features * num_nodes * MAX_BIN, 2), jnp.float32).at[index].add(pairs, mode="drop")
    return _as_histogram(sums, n_features, num_nodes)


def map_pair_drop(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    pairs = jnp.stack([g, h], axis=-1)
    per_row = jnp.where(row_mask, node_index * MAX_BIN, num_nodes * MAX_BIN)

    def one_feature(codes):
        index = jnp.where(row_mask, per_row + codes.astype(jnp.int32), num_nodes * MAX_BIN)
        return jnp.zeros((num_nodes * MAX_BIN, 2), jnp.float32).at[index].add(pairs, mode="drop")

    return _as_histogram(lax.map(one_feature, X_binned_T), n_features, num_nodes)


def _replicated(copies: int, flat: bool):
    """Pairs scattered into ``copies`` histograms (row ``i`` into copy ``i % copies``) then summed:
    the same number of atomic adds spread over ``copies`` times as many addresses, so fewer of
    them wait on one another (the root's 800k rows land on 256 bins a feature)."""
    def variant(X_binned_T, node_index, g, h, row_mask, num_nodes):
        n_features, n_rows = X_binned_T.shape
        size = num_nodes * MAX_BIN
        copy_offset = (jnp.arange(n_rows, dtype=jnp.int32) % copies) * (n_features * size if flat else size)
        pairs = jnp.stack([g, h], axis=-1)
        if flat:
            index = _dropped_index(X_binned_T, node_index, row_mask, num_nodes)
            index = jnp.where(row_mask[None, :], index + copy_offset[None, :], copies * n_features * size)
            updates = jnp.broadcast_to(pairs[None], (n_features, n_rows, 2)).reshape(-1, 2)
            sums = jnp.zeros((copies * n_features * size, 2), jnp.float32).at[index.reshape(-1)].add(
                updates, mode="drop")
            return _as_histogram(sums.reshape(copies, -1, 2).sum(axis=0), n_features, num_nodes)
        per_row = jnp.where(row_mask, node_index * MAX_BIN + copy_offset, copies * size)

        def one_feature(codes):
            index = jnp.where(row_mask, per_row + codes.astype(jnp.int32), copies * size)
            sums = jnp.zeros((copies * size, 2), jnp.float32).at[index].add(pairs, mode="drop")
            return sums.reshape(copies, size, 2).sum(axis=0)

        return _as_histogram(lax.map(one_feature, X_binned_T), n_features, num_nodes)
    return variant


def flat_two_drop(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    index = _dropped_index(X_binned_T, node_index, row_mask, num_nodes).reshape(-1)
    size = n_features * num_nodes * MAX_BIN
    sums = [jax.ops.segment_sum(jnp.broadcast_to(v[None, :], X_binned_T.shape).reshape(-1), index, num_segments=size)
            for v in (g, h)]
    return _as_histogram(jnp.stack(sums, axis=-1), n_features, num_nodes)


def onehot_bf16x3(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    # (rows, nodes * 2): each row's (g, h) in its own node's two columns.
    in_node = (node_index[:, None] == jnp.arange(num_nodes)[None, :]) & row_mask[:, None]
    placed = jnp.where(in_node[:, :, None], jnp.stack([g, h], axis=-1)[:, None, :], 0.0).reshape(-1, num_nodes * 2)
    high = placed.astype(jnp.bfloat16)
    rest = placed - high.astype(jnp.float32)
    middle = rest.astype(jnp.bfloat16)
    low = (rest - middle.astype(jnp.float32)).astype(jnp.bfloat16)
    parts = jnp.concatenate([high, middle, low], axis=1)  # (rows, 3 * nodes * 2)

    def one_feature(codes):
        one_hot = (codes[:, None] == jnp.arange(MAX_BIN, dtype=codes.dtype)[None, :]).astype(jnp.bfloat16)
        sums = jnp.dot(one_hot.T, parts, preferred_element_type=jnp.float32)  # (bins, 3 * nodes * 2)
        return sums.reshape(MAX_BIN, 3, num_nodes, 2).sum(axis=1)

    per_feature = lax.map(one_feature, X_binned_T)  # (features, bins, nodes, 2)
    return per_feature.transpose(2, 0, 1, 3)


def int_pair_drop(X_binned_T, node_index, g, h, row_mask, num_nodes):
    n_features = X_binned_T.shape[0]
    index = _dropped_index(X_binned_T, node_index, row_mask, num_nodes).reshape(-1)
    pairs = jnp.stack([g, h], axis=-1)
    scale = 2.0 ** 30 / (jnp.sum(jnp.abs(pairs), axis=0) + 1e-30)  # no bin can overflow
    quantised = jnp.round(pairs * scale).astype(jnp.int32)
    quantised = jnp.broadcast_to(quantised[None], (n_features, g.shape[0], 2)).reshape(-1, 2)
    sums = jnp.zeros((n_features * num_nodes * MAX_BIN, 2), jnp.int32).at[index].add(quantised, mode="drop")
    return _as_histogram(sums.astype(jnp.float32) / scale, n_features, num_nodes)


VARIANTS = {"library": library, "complex_per_feature": complex_per_feature, "flat_complex_drop": flat_complex_drop, "flat_pair_drop": flat_pair_drop,
            "map_pair_drop": map_pair_drop, "flat_two_drop": flat_two_drop,
            "map_pair_copies16": _replicated(16, flat=False), "flat_pair_copies8": _replicated(8, flat=True), "onehot_bf16x3": onehot_bf16x3,
            "int_pair_drop": int_pair_drop}


def reference(X_binned_T, node_index, g, h, row_mask, num_nodes):
    """float64 sums by ``np.bincount``, one feature and channel at a time."""
    n_features = X_binned_T.shape[0]
    result = np.zeros((num_nodes, n_features, MAX_BIN, 2))
    rows = np.flatnonzero(row_mask)
    cell_of_row = node_index[rows].astype(np.int64) * MAX_BIN
    for feature in range(n_features):
        cells = cell_of_row + X_binned_T[feature, rows]
        for channel, values in enumerate((g, h)):
            result[:, feature, :, channel] = np.bincount(cells, weights=values[rows].astype(np.float64),
                                                         minlength=num_nodes * MAX_BIN).reshape(num_nodes, MAX_BIN)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=800_000)
    parser.add_argument("--features", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"{args.rows:,} rows x {args.features} features, {MAX_BIN} bins; jax {jax.__version__} on {device}")
    print("| nodes | rows summed | variant | ms median | ms min | compile s | max error / max |abs| |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for num_nodes, fraction in [(1, 1.0), (16, 0.45)]:
        X_binned_T = rng.integers(0, MAX_BIN, size=(args.features, args.rows), dtype=np.uint8)
        node_index = rng.integers(0, num_nodes, size=args.rows).astype(np.int32)
        g = rng.normal(size=args.rows).astype(np.float32)
        h = rng.uniform(0.05, 0.25, size=args.rows).astype(np.float32)
        row_mask = rng.random(args.rows) < fraction
        expected = reference(X_binned_T, node_index, g, h, row_mask, num_nodes)
        scale = np.abs(expected).max()
        inputs = [jax.device_put(a, device) for a in (X_binned_T, node_index, g, h, row_mask)]
        for name in args.variants.split(","):
            function = jax.jit(VARIANTS[name], static_argnames="num_nodes")
            try:
                start = time.perf_counter()
                result = np.asarray(jax.block_until_ready(function(*inputs, num_nodes=num_nodes)))
                compile_s = time.perf_counter() - start
                error = np.abs(result - expected).max() / scale
                times = []
                for _ in range(args.repeats if compile_s < 1.0 else 3):  # the slowest take seconds a call
                    start = time.perf_counter()
                    jax.block_until_ready(function(*inputs, num_nodes=num_nodes))
                    times.append((time.perf_counter() - start) * 1e3)
                print(f"| {num_nodes} | {fraction:.0%} | {name} | {statistics.median(times):.3f} | {min(times):.3f} "
                      f"| {compile_s:.2f} | {error:.1e} |", flush=True)
            except Exception as exception:  # one failing variant must not hide the others' numbers
                print(f"| {num_nodes} | {fraction:.0%} | {name} | failed: {str(exception).splitlines()[0][:120]} |",
                      flush=True)


if __name__ == "__main__":
    main()
