"""Binning: raw feature values -> per-feature bin edges -> ``X_binned`` (uint8).

Host-side NumPy, done once per dataset. Each feature gets at most ``max_bin - 1`` value bins
and the last code is kept for missing values (NaN), so ``max_bin`` counts every code. When no
feature needs that many, the codes are narrower (``BinEdges.max_bin``, a power of two), which
makes histograms and split scans cheaper; the missing code is then ``BinEdges.max_bin - 1``.

Convention (the same as XGBoost's split condition): a value ``x`` falls in bin
``b = #{edges <= x}``, so "bin <= b goes left" is exactly "x < edges[b]". Bin edges are padded
with ``+inf`` to ``max_bin - 1`` entries per feature; a split on a padded edge sends every
non-missing value left.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import numpy as np

from .cores import available_cpu_cores
from .host_memory import aligned_empty

MAX_BIN_LIMIT = 256
MIN_CODE_WIDTH = 16
# Edges are fit on a row sample of this size when the data are larger (as LightGBM's
# bin_construct_sample_cnt): quantiles of 200k rows are within ~0.2% of rank of the full data.
EDGE_SAMPLE_SIZE = 200_000
# Rows per block where binning works through X in pieces, to keep its temporaries small.
ROW_BLOCK = 65_536


# Below this many values (rows x features), binning runs on the calling thread: starting a
# thread pool cost more than the work (1000 x 10 rows: 4.2 of a 1-round fit's 7.9 ms).
MIN_THREADED_VALUES = 1 << 18


def _for_each_feature(work: Callable[[int], None], n_features: int, n_rows: int) -> None:
    """Run ``work(feature)`` for every feature, on all cores when there are enough values
    (NumPy's sort and searchsorted release the GIL, so threads do run in parallel)."""
    threads = 1 if n_rows * n_features < MIN_THREADED_VALUES else min(available_cpu_cores(), n_features)
    if threads == 1:
        for feature in range(n_features):
            work(feature)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(work, range(n_features)))


class BinEdges(NamedTuple):
    """Per-feature bin edges, shape ``(n_features, max_bin - 1)``, padded with ``+inf``."""

    edges: np.ndarray  # float32 (n_features, max_bin - 1)
    n_edges: np.ndarray  # int32 (n_features,): how many edges are real (not padding)

    @property
    def max_bin(self) -> int:
        return self.edges.shape[1] + 1

    @property
    def missing_bin(self) -> int:
        return self.edges.shape[1]

    @property
    def n_features(self) -> int:
        return self.edges.shape[0]


def _weighted_quantile_edges(values: np.ndarray, weights: np.ndarray | None, n_value_bins: int) -> np.ndarray:
    """Edges splitting ``values`` into at most ``n_value_bins`` bins of about equal weight
    (``weights`` None: every value weighs 1).

    With no more distinct values than bins, every distinct value gets its own bin (edges at the
    midpoints); otherwise edges sit at weighted quantiles, snapped to midpoints between
    neighbouring distinct values so that equal values never straddle an edge.
    """
    if weights is None:
        # Unweighted, the weight below a value is its rank: a plain sort serves (a stable
        # argsort of 200k values took 15 ms, the sort 0.8).
        sorted_values = np.sort(values)
    else:
        order = np.argsort(values, kind="stable")
        sorted_values = values[order]
    # The values are sorted: each distinct one starts where it differs from the last.
    starts = np.empty(len(sorted_values), dtype=bool)
    starts[:1] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=starts[1:])
    first_index = np.flatnonzero(starts)
    distinct = sorted_values[first_index]
    if len(distinct) <= 1:
        return np.empty(0, dtype=np.float32)
    if len(distinct) <= n_value_bins:
        chosen = np.arange(1, len(distinct))
    else:
        if weights is None:
            weight_below_distinct, total = first_index.astype(np.float64), float(len(sorted_values))
        else:
            cumulative = np.cumsum(weights[order], dtype=np.float64)
            weight_below_distinct = np.concatenate([[0.0], cumulative])[first_index]
            total = cumulative[-1]
        targets = total * np.arange(1, n_value_bins) / n_value_bins
        # The distinct value whose cumulative weight first reaches each target starts a new bin.
        chosen = np.unique(np.searchsorted(weight_below_distinct, targets, side="left"))
        chosen = chosen[(chosen > 0) & (chosen < len(distinct))]
    midpoints = 0.5 * (distinct[chosen - 1].astype(np.float64) + distinct[chosen].astype(np.float64))
    edges = midpoints.astype(np.float32)
    # float32 rounding of a midpoint can land on the lower value; keep the lower value below it.
    edges = np.where(edges <= distinct[chosen - 1], np.nextafter(distinct[chosen - 1], np.float32(np.inf)), edges)
    return np.unique(edges)


def fit_bin_edges(X: np.ndarray, max_bin: int = 256, sample_weight: np.ndarray | None = None,
                  seed: int = 0) -> BinEdges:
    """Fit per-feature bin edges from (sample-weighted) quantiles of ``X`` (NaN ignored): float32,
    or float64 rounded to float32 a feature at a time (the edges of the float32 array)."""
    if not 2 <= max_bin <= MAX_BIN_LIMIT:
        raise ValueError(f"max_bin must be in [2, {MAX_BIN_LIMIT}] (it counts the missing-value code); got {max_bin}")
    n_rows, n_features = X.shape
    weights = None if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    if n_rows > EDGE_SAMPLE_SIZE:
        rows = np.sort(np.random.default_rng(seed).choice(n_rows, EDGE_SAMPLE_SIZE, replace=False))
        # Gathered a block at a time into float32: a float64 sample is not held whole.
        sample = np.empty((len(rows), n_features), np.float32)
        for start in range(0, len(rows), ROW_BLOCK):
            sample[start:start + ROW_BLOCK] = X[rows[start:start + ROW_BLOCK]]
        X, weights = sample, None if weights is None else weights[rows]
    n_value_bins = max_bin - 1
    edges = np.full((n_features, max_bin - 1), np.inf, dtype=np.float32)
    n_edges = np.zeros(n_features, dtype=np.int32)

    def fit_feature(feature):
        column = X[:, feature].astype(np.float32, copy=False)
        present = ~np.isnan(column)
        if weights is not None:
            present &= weights > 0
        feature_edges = _weighted_quantile_edges(column[present], None if weights is None else weights[present],
                                                 n_value_bins)
        edges[feature, : len(feature_edges)] = feature_edges
        n_edges[feature] = len(feature_edges)

    _for_each_feature(fit_feature, n_features, len(X))
    # Histograms and the split scan cost as many bins as the code width, so features with few
    # distinct values (counts, categories coded as numbers, pre-binned data) get a narrower
    # width: a power of two holding every feature's value bins plus the missing code.
    needed = int(n_edges.max(initial=0)) + 2
    width = min(max_bin, max(MIN_CODE_WIDTH, 1 << (needed - 1).bit_length()))
    return BinEdges(edges=np.ascontiguousarray(edges[:, : width - 1]), n_edges=n_edges)


def _count_edges_at_or_below(table: np.ndarray, steps: int, values: np.ndarray) -> np.ndarray:
    """``#{edges <= x}`` for every value (uint8; NaN counts none), by a binary search of fixed
    steps over ``table``: ``2^steps - 1`` sorted edges. Each step moves every value's position
    at once, with no branch to mispredict (searchsorted took 43 ns a value on 255 edges, this
    7)."""
    position = np.zeros(len(values), np.uint8)
    at_or_below = np.empty(len(values), bool)
    for step in range(steps - 1, -1, -1):
        half = 1 << step
        np.less_equal(table.take(position.astype(np.intp) + (half - 1)), values, out=at_or_below)
        position += at_or_below.view(np.uint8) * np.uint8(half)
    return position


def apply_bins(X: np.ndarray, bin_edges: BinEdges, table_width: int | None = None) -> np.ndarray:
    """Map raw ``X`` (n, d) to ``X_binned`` (n, d) uint8 with the given edges; NaN -> missing bin.
    A float64 ``X`` is rounded to float32 a block at a time: its codes are the float32 array's.

    With ``table_width``, the codes come as a feature-major table ``(d, table_width)`` instead:
    row ``i``'s codes in column ``i``, zeros after the last row, in a 64-byte aligned buffer
    (the layout the training kernels read, in place on CPU devices; ``Dataset.X_binned_T``).
    """
    n_rows, n_features = X.shape
    if n_features != bin_edges.n_features:
        raise ValueError(f"X has {n_features} features but the bin edges were fit on {bin_edges.n_features}")
    if table_width is None:
        X_binned = np.empty((n_rows, n_features), dtype=np.uint8)
        feature_codes = X_binned.T
    else:
        if table_width < n_rows:
            raise ValueError(f"table_width {table_width} is less than the {n_rows} rows")
        feature_codes = aligned_empty((n_features, table_width), np.uint8)
        feature_codes[:, n_rows:] = 0

    # The edges padded with +inf to a power of two less one, for a search of fixed steps.
    steps = max(1, (bin_edges.edges.shape[1]).bit_length())
    table = np.full((n_features, (1 << steps) - 1), np.inf, np.float32)
    table[:, : bin_edges.edges.shape[1]] = bin_edges.edges

    def bin_feature(feature):
        n_real = int(bin_edges.n_edges[feature])
        # In blocks of rows, to keep the search's temporaries small.
        for start in range(0, n_rows, ROW_BLOCK):
            column = X[start:start + ROW_BLOCK, feature].astype(np.float32, copy=False)
            codes = _count_edges_at_or_below(table[feature], steps, column)
            # +inf passes the padding edges too; every real edge is below it.
            np.minimum(codes, n_real, out=codes)
            codes[np.isnan(column)] = bin_edges.missing_bin
            feature_codes[feature, start:start + len(codes)] = codes

    _for_each_feature(bin_feature, n_features, n_rows)
    return X_binned if table_width is None else feature_codes


def has_missing_code(codes: np.ndarray, missing_bin: int) -> bool:
    """Whether any entry of 2-D ``codes`` is the missing-value code, checked one line of the
    first axis at a time (a feature of a feature-major table: no (d, n) temporary)."""
    return any(np.any(line == missing_bin) for line in codes)
