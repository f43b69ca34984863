"""Tests of the host-side binning (``fit_bin_edges`` / ``apply_bins``) against NumPy expectations."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jaxboost.binning import BinEdges, apply_bins, fit_bin_edges


def _column(X: np.ndarray) -> np.ndarray:
    return np.asarray(X, dtype=np.float32).reshape(-1, 1)


def _real_edges(bin_edges: BinEdges, feature: int = 0) -> np.ndarray:
    return bin_edges.edges[feature, : bin_edges.n_edges[feature]]


def _check_edge_layout(bin_edges: BinEdges, max_bin: int, n_features: int) -> None:
    assert bin_edges.edges.dtype == np.float32, f"edges dtype {bin_edges.edges.dtype}, expected float32"
    # The code width is max_bin, or a narrower power of two that still holds every feature's
    # value bins plus the missing code.
    width = bin_edges.max_bin
    assert width == max_bin or (width & (width - 1) == 0 and width >= 16 and width < max_bin), width
    assert int(bin_edges.n_edges.max(initial=0)) + 2 <= width, "a feature's bins do not fit the code width"
    assert bin_edges.edges.shape == (n_features, width - 1), f"edges shape {bin_edges.edges.shape}"
    assert bin_edges.missing_bin == width - 1
    for feature in range(n_features):
        count = int(bin_edges.n_edges[feature])
        real = bin_edges.edges[feature, :count]
        assert np.all(np.isfinite(real)), f"feature {feature}: non-finite real edges {real}"
        assert np.all(np.diff(real) > 0), f"feature {feature}: edges not strictly increasing: {real}"
        assert np.all(np.isposinf(bin_edges.edges[feature, count:])), f"feature {feature}: padding is not +inf"


@pytest.mark.parametrize("max_bin", [8, 64, 256])
def test_few_distinct_values_get_one_bin_each(max_bin):
    rng = np.random.default_rng(0)
    distinct = np.sort(rng.normal(size=max_bin - 1).astype(np.float32) * 10)  # exactly max_bin - 1 values
    values = rng.choice(distinct, size=3000)
    values[:len(distinct)] = distinct  # every value occurs
    bin_edges = fit_bin_edges(_column(values), max_bin=max_bin)
    _check_edge_layout(bin_edges, max_bin, 1)
    assert bin_edges.n_edges[0] == len(distinct) - 1, (
        f"{len(distinct)} distinct values need {len(distinct) - 1} edges, got {bin_edges.n_edges[0]}")
    codes = apply_bins(_column(values), bin_edges)[:, 0]
    expected = np.searchsorted(distinct, values)  # the rank of the value among the distinct values
    np.testing.assert_array_equal(codes, expected, err_msg="each distinct value should have its own bin (its rank)")
    edges = _real_edges(bin_edges)
    assert np.all((distinct[:-1] < edges) & (edges <= distinct[1:])), "an edge is not between its neighbours"


@pytest.mark.parametrize("max_bin", [2, 5, 17, 256])
def test_many_distinct_values_give_equal_count_bins(max_bin):
    rng = np.random.default_rng(1)
    n = 20_000
    values = rng.standard_normal(n).astype(np.float32) ** 3  # skewed, all distinct in practice
    bin_edges = fit_bin_edges(_column(values), max_bin=max_bin)
    _check_edge_layout(bin_edges, max_bin, 1)
    n_value_bins = max_bin - 1
    assert bin_edges.n_edges[0] == n_value_bins - 1, f"expected {n_value_bins - 1} edges, got {bin_edges.n_edges[0]}"
    codes = apply_bins(_column(values), bin_edges)[:, 0]
    counts = np.bincount(codes, minlength=max_bin)
    assert counts[max_bin - 1] == 0 or max_bin == 2, "no value is missing, the missing bin must be empty"
    target = n / n_value_bins
    worst = np.max(np.abs(counts[:n_value_bins] - target)) / target
    assert worst < 0.05, f"bin counts {counts[:n_value_bins]} deviate from {target:.1f} by {worst:.2%}"


def test_sample_weights_move_the_quantile_edges():
    rng = np.random.default_rng(2)
    n, max_bin = 4000, 21
    values = rng.uniform(0.0, 1.0, n).astype(np.float32)
    heavy = values < 0.2
    weights = np.where(heavy, 20.0, 1.0)
    unweighted = _real_edges(fit_bin_edges(_column(values), max_bin=max_bin))
    weighted_edges = fit_bin_edges(_column(values), max_bin=max_bin, sample_weight=weights)
    _check_edge_layout(weighted_edges, max_bin, 1)
    weighted = _real_edges(weighted_edges)
    heavy_share = weights[heavy].sum() / weights.sum()
    n_value_bins = max_bin - 1
    bins_in_heavy_unweighted = np.sum(unweighted < 0.2) + 1
    bins_in_heavy_weighted = np.sum(weighted < 0.2) + 1
    assert bins_in_heavy_weighted > bins_in_heavy_unweighted + 5, (
        f"the heavy region [0, 0.2) holds {heavy_share:.0%} of the weight but gets {bins_in_heavy_weighted} bins "
        f"(unweighted: {bins_in_heavy_unweighted})")
    assert abs(bins_in_heavy_weighted - heavy_share * n_value_bins) <= 2, (
        f"expected about {heavy_share * n_value_bins:.1f} bins in the heavy region, got {bins_in_heavy_weighted}")
    # Every bin carries about the same weight.
    codes = apply_bins(_column(values), weighted_edges)[:, 0]
    bin_weight = np.bincount(codes, weights=weights, minlength=n_value_bins)[:n_value_bins]
    target = weights.sum() / n_value_bins
    worst = np.max(np.abs(bin_weight - target)) / target
    assert worst < 0.1, f"weighted bin masses {np.round(bin_weight)} deviate from {target:.1f} by {worst:.1%}"


def test_zero_weight_rows_do_not_place_edges():
    rng = np.random.default_rng(3)
    values = rng.uniform(0.0, 1.0, 2000).astype(np.float32)
    weights = np.where(values < 0.5, 0.0, 1.0)
    edges = _real_edges(fit_bin_edges(_column(values), max_bin=16, sample_weight=weights))
    assert np.all(edges > 0.49), f"edges placed among zero-weight rows: {edges}"


def test_binning_in_row_blocks_matches_one_block(monkeypatch):
    """``apply_bins`` works through rows in blocks: blocks that do not divide the rows give the
    same codes as one block (searchsorted per column in NumPy), row-major or as a feature-major
    table (zeros past the rows, in an aligned buffer); ``has_missing_code`` finds a missing
    code anywhere."""
    from jaxboost import binning

    rng = np.random.default_rng(7)
    X = rng.normal(size=(1000, 4)).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.05] = np.nan
    bin_edges = fit_bin_edges(X, max_bin=32)
    expected = np.stack([np.where(np.isnan(X[:, f]), bin_edges.missing_bin,
                                  np.searchsorted(_real_edges(bin_edges, f), X[:, f], side="right"))
                         for f in range(4)], axis=1)
    monkeypatch.setattr(binning, "ROW_BLOCK", 300)
    codes = apply_bins(X, bin_edges)
    np.testing.assert_array_equal(codes, expected)
    assert binning.has_missing_code(codes, bin_edges.missing_bin)
    table = apply_bins(X, bin_edges, table_width=1100)
    assert table.shape == (4, 1100) and table.dtype == np.uint8 and table.ctypes.data % 64 == 0
    np.testing.assert_array_equal(table[:, :1000], expected.T)
    assert not table[:, 1000:].any()
    assert binning.has_missing_code(table, bin_edges.missing_bin)
    with pytest.raises(ValueError, match="less than the 1000 rows"):
        apply_bins(X, bin_edges, table_width=999)
    # The only missing value in the last block, then none at all.
    X_last = np.nan_to_num(X, nan=0.0)
    X_last[999, 2] = np.nan
    assert binning.has_missing_code(apply_bins(X_last, bin_edges), bin_edges.missing_bin)
    assert not binning.has_missing_code(apply_bins(np.nan_to_num(X, nan=0.0), bin_edges), bin_edges.missing_bin)


def test_threaded_and_serial_binning_agree(monkeypatch):
    """Binning takes the features in threads only above ``MIN_THREADED_VALUES`` values; both
    ways give the same edges (weighted too) and codes, and each way is actually taken."""
    from jaxboost import binning

    rng = np.random.default_rng(8)
    X = rng.normal(size=(3000, 7)).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.05] = np.nan
    weights = rng.uniform(0.5, 2.0, size=3000)
    pools = []
    real_pool = binning.ThreadPoolExecutor

    def counted_pool(*args, **kwargs):
        pools.append(kwargs.get("max_workers"))
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(binning, "ThreadPoolExecutor", counted_pool)
    results = {}
    for name, threshold in [("serial", 1 << 40), ("threaded", 0)]:
        monkeypatch.setattr(binning, "MIN_THREADED_VALUES", threshold)
        monkeypatch.setattr(binning, "available_cpu_cores", lambda: 3)
        edges, weighted = fit_bin_edges(X, max_bin=64), fit_bin_edges(X, max_bin=64, sample_weight=weights)
        results[name] = (edges, weighted, apply_bins(X, edges))
        assert pools == ([] if name == "serial" else [3, 3, 3]), (name, pools)
    (edges, weighted, codes), (threaded_edges, threaded_weighted, threaded_codes) = results["serial"], results["threaded"]
    for serial, threaded in [(edges, threaded_edges), (weighted, threaded_weighted)]:
        np.testing.assert_array_equal(serial.edges, threaded.edges)
        np.testing.assert_array_equal(serial.n_edges, threaded.n_edges)
    np.testing.assert_array_equal(codes, threaded_codes)


@pytest.mark.parametrize("order", ["C", "F"])
def test_float64_features_bin_as_their_float32_rounding(monkeypatch, order):
    """A Dataset of float64 features is binned without a float32 copy of the whole array, a
    block at a time: its edges (fit on a row sample, gathered in blocks) and codes are those of
    the same features rounded to float32 first, also for values that lie within float64's
    precision of an edge, where comparing in float64 would put them in the other bin."""
    from jaxboost import binning
    from jaxboost.dataset import Dataset

    monkeypatch.setattr(binning, "EDGE_SAMPLE_SIZE", 700)  # 900 rows: the edges come from a sample
    monkeypatch.setattr(binning, "ROW_BLOCK", 256)
    rng = np.random.default_rng(11)
    X = rng.normal(size=(900, 3))
    X[rng.uniform(size=X.shape) < 0.05] = np.nan
    reference = Dataset(X.astype(np.float32), max_bin=32)
    # Values a hair below and above float32 edges: float32 rounds them onto the edge.
    edges = reference.bin_edges.edges[:, :8].astype(np.float64)
    X[:8, :] = edges.T * (1.0 - 1e-12)
    X[8:16, :] = edges.T * (1.0 + 1e-12)
    X = np.asarray(X, order=order)
    rounded = X.astype(np.float32)
    assert any(np.any(np.searchsorted(edges[f], X[:16, f], side="right") != np.searchsorted(
        edges[f].astype(np.float32), rounded[:16, f], side="right")) for f in range(3)), "no value near an edge"
    expected, dataset = Dataset(rounded, max_bin=32), Dataset(X, max_bin=32)
    np.testing.assert_array_equal(dataset.bin_edges.edges, expected.bin_edges.edges)
    np.testing.assert_array_equal(dataset.bin_edges.n_edges, expected.bin_edges.n_edges)
    np.testing.assert_array_equal(dataset.X_binned_T, expected.X_binned_T)
    assert dataset.has_missing_values
    # Binned with the edges the values lie near, and edges fit on every row (no sample): the
    # same as the float32 rounding's.
    np.testing.assert_array_equal(Dataset(X, reference=reference).X_binned_T,
                                  Dataset(rounded, reference=reference).X_binned_T)
    unsampled, expected_unsampled = Dataset(X[:600], max_bin=32), Dataset(rounded[:600], max_bin=32)
    np.testing.assert_array_equal(unsampled.bin_edges.edges, expected_unsampled.bin_edges.edges)
    np.testing.assert_array_equal(unsampled.X_binned_T, expected_unsampled.X_binned_T)


def test_float64_features_are_not_copied_whole():
    """Binning a float64 X allocates less than a float32 copy of it would take alone (traced
    NumPy allocations: 1.6 MB here against the copy's 2.6 MB; 4.0 MB when it was copied)."""
    import tracemalloc

    from jaxboost.dataset import Dataset

    X = np.random.default_rng(13).normal(size=(20000, 32))
    Dataset(X[:100], max_bin=64)
    tracemalloc.start()
    try:
        Dataset(X, max_bin=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < X.size * np.dtype(np.float32).itemsize, f"binning allocated {peak} bytes"


def test_features_read_blockwise_are_kept_as_given():
    """``check_features(blockwise=True)`` returns float32 and float64 arrays as they are (no
    copy) and converts other types; float64 values beyond float32's range are named, with their
    place, as infinite values are."""
    from jaxboost.validation import check_features

    X = np.random.default_rng(12).normal(size=(50, 4))
    for array in (X, np.asfortranarray(X), X.astype(np.float32), X[:, ::2]):
        kept, _ = check_features(array, blockwise=True)
        assert kept is array, (array.dtype, array.flags)
    converted, _ = check_features(X.astype(np.int64), blockwise=True)
    assert converted.dtype == np.float32 and converted.flags.c_contiguous
    converted, _ = check_features(X)
    assert converted.dtype == np.float32 and converted.flags.c_contiguous
    for blockwise in (False, True):
        huge = X.copy()
        huge[:, 2] = np.nan
        huge[9, 2] = -1e39
        with pytest.raises(ValueError, match=r"X contains values beyond float32's range \(first at row 9, feature 2\)"):
            check_features(huge, blockwise=blockwise)
        huge[9, 2] = np.inf
        with pytest.raises(ValueError, match=r"X contains infinite values \(first at row 9, feature 2\)"):
            check_features(huge, blockwise=blockwise)
        # float16 is compared with float32's range without a warning of its own overflow.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            converted, _ = check_features(X.astype(np.float16), blockwise=blockwise)
            assert converted.dtype == np.float32
            with pytest.raises(ValueError, match=r"infinite values \(first at row 9, feature 2\)"):
                check_features(huge.astype(np.float16), blockwise=blockwise)


def test_nan_goes_to_the_missing_code():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(500, 3)).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.1] = np.nan
    X[:, 2] = np.nan  # a feature with no values at all
    for max_bin in (2, 16, 256):
        bin_edges = fit_bin_edges(X, max_bin=max_bin)
        _check_edge_layout(bin_edges, max_bin, 3)
        codes = apply_bins(X, bin_edges)
        assert codes.dtype == np.uint8, f"codes dtype {codes.dtype}, expected uint8"
        nan = np.isnan(X)
        assert np.all(codes[nan] == max_bin - 1), f"max_bin={max_bin}: NaN must map to {max_bin - 1}"
        assert np.all(codes[~nan] < max_bin - 1), f"max_bin={max_bin}: a present value got the missing code"
        assert bin_edges.n_edges[2] == 0, "an all-NaN feature should get no edges"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_bin", [3, 16, 256])
def test_bin_convention_holds_for_every_value_and_edge(seed, max_bin):
    rng = np.random.default_rng(seed)
    n = 3000
    X = np.stack([
        rng.normal(size=n),
        np.round(rng.normal(size=n) * 4) / 4,  # many repeats, more distinct values than bins for small max_bin
        rng.integers(0, 5, size=n),  # few distinct values
        rng.exponential(size=n) * 1e6,
        rng.normal(size=n) * 1e-6 + 1.0,  # tightly clustered around 1
    ], axis=1).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.05] = np.nan
    # A second, unseen sample binned with the same edges (values between and beyond the fitted ones).
    X_new = (X + rng.normal(size=X.shape).astype(np.float32) * np.nanstd(X, axis=0)).astype(np.float32)
    weights = rng.uniform(0.1, 3.0, size=n)
    bin_edges = fit_bin_edges(X, max_bin=max_bin, sample_weight=weights)
    _check_edge_layout(bin_edges, max_bin, X.shape[1])
    for data in (X, X_new):
        codes = apply_bins(data, bin_edges).astype(np.int64)
        for feature in range(X.shape[1]):
            present = ~np.isnan(data[:, feature])
            x = data[present, feature]
            code = codes[present, feature]
            edges = bin_edges.edges[feature]  # padded with +inf: a padded edge sends every value left
            bins = np.arange(max_bin - 1)
            goes_left = code[:, None] <= bins[None, :]
            below_edge = x[:, None] < edges[None, :]
            mismatch = np.argwhere(goes_left != below_edge)
            assert mismatch.size == 0, (
                f"feature {feature}: bin <= b <=> x < edges[b] fails for x={x[mismatch[0, 0]]!r}, "
                f"code={code[mismatch[0, 0]]}, b={mismatch[0, 1]}, edge={edges[mismatch[0, 1]]!r}")
            assert np.all(code <= bin_edges.n_edges[feature]), f"feature {feature}: code beyond the real edges"


@pytest.mark.parametrize("max_bin", [4, 32])
def test_equal_values_never_straddle_an_edge(max_bin):
    rng = np.random.default_rng(5)
    # Heavily repeated values, including a value holding half of the rows, and adjacent float32 numbers.
    base = np.float32(1.0)
    neighbours = np.array([base, np.nextafter(base, np.float32(2)), np.nextafter(np.nextafter(base, np.float32(2)),
                                                                                 np.float32(2))], np.float32)
    values = np.concatenate([
        np.full(2000, 0.5, np.float32),
        rng.choice(neighbours, 600),
        np.round(rng.normal(size=1400), 1).astype(np.float32),
    ])
    rng.shuffle(values)
    bin_edges = fit_bin_edges(_column(values), max_bin=max_bin)
    _check_edge_layout(bin_edges, max_bin, 1)
    codes = apply_bins(_column(values), bin_edges)[:, 0]
    distinct = np.unique(values)
    for value in distinct:
        value_codes = np.unique(codes[values == value])
        assert len(value_codes) == 1, f"value {value!r} is spread over bins {value_codes}"
    # Bins are ordered like the values.
    per_value = np.array([codes[values == value][0] for value in distinct])
    assert np.all(np.diff(per_value.astype(int)) >= 0), "codes are not monotone in the value"
    edges = _real_edges(bin_edges)
    # No edge equals a value's lower neighbour: x < edge for the value below, x >= edge for the one above.
    for edge in edges:
        below, above = distinct[distinct < edge], distinct[distinct >= edge]
        assert len(below) and len(above), f"edge {edge!r} does not separate two present values"


def test_adjacent_float32_values_are_separated():
    a = np.float32(1.0)
    b = np.nextafter(a, np.float32(2))
    c = np.nextafter(b, np.float32(2))
    values = np.array([a, b, c] * 10, np.float32)
    bin_edges = fit_bin_edges(_column(values), max_bin=8)
    _check_edge_layout(bin_edges, 8, 1)
    assert bin_edges.n_edges[0] == 2, f"three adjacent float32 values need two edges, got {_real_edges(bin_edges)}"
    codes = apply_bins(_column(values), bin_edges)[:, 0]
    np.testing.assert_array_equal(codes[:3], [0, 1, 2], err_msg="adjacent float32 values should get their own bins")


@pytest.mark.parametrize("max_bin", [-1, 0, 1, 257, 1000])
def test_max_bin_out_of_range_raises(max_bin):
    X = np.arange(10, dtype=np.float32).reshape(-1, 1)
    with pytest.raises(ValueError, match="max_bin"):
        fit_bin_edges(X, max_bin=max_bin)


@pytest.mark.parametrize("max_bin", [2, 256])
def test_max_bin_limits_are_accepted(max_bin):
    X = np.arange(1000, dtype=np.float32).reshape(-1, 1)
    bin_edges = fit_bin_edges(X, max_bin=max_bin)
    _check_edge_layout(bin_edges, max_bin, 1)
    codes = apply_bins(X, bin_edges)
    assert codes.max() <= max_bin - 2, "a present value got the missing code"
    assert len(np.unique(codes)) == max_bin - 1, f"expected {max_bin - 1} value bins used, got {np.unique(codes)}"


def test_constant_feature_gets_no_edges():
    X = np.full((100, 2), 3.25, np.float32)
    X[::7, 1] = np.nan
    bin_edges = fit_bin_edges(X, max_bin=16)
    _check_edge_layout(bin_edges, 16, 2)
    np.testing.assert_array_equal(bin_edges.n_edges, [0, 0], err_msg="a constant feature should get zero edges")
    assert np.all(np.isposinf(bin_edges.edges)), "a constant feature's edges should all be +inf padding"
    codes = apply_bins(X, bin_edges)
    assert np.all(codes[:, 0] == 0), "every row of a constant feature should be in bin 0"
    nan = np.isnan(X[:, 1])
    assert np.all(codes[~nan, 1] == 0) and np.all(codes[nan, 1] == 15), "constant + NaN: bin 0 and missing code"
    # Values not seen at fit time still fall in bin 0.
    new = np.array([[-1e30, 1e30], [0.0, 3.25]], np.float32)
    assert np.all(apply_bins(new, bin_edges) == 0)


def test_apply_bins_rejects_a_different_feature_count():
    bin_edges = fit_bin_edges(np.zeros((5, 3), np.float32), max_bin=4)
    with pytest.raises(ValueError):
        apply_bins(np.zeros((5, 2), np.float32), bin_edges)


def test_few_distinct_values_get_narrow_codes_with_missing_last():
    rng = np.random.default_rng(0)
    X = rng.integers(0, 20, size=(500, 3)).astype(np.float32)  # 20 values -> 21 codes -> width 32
    X[::7, 1] = np.nan
    bin_edges = fit_bin_edges(X, max_bin=256)
    assert bin_edges.max_bin == 32 and bin_edges.missing_bin == 31
    codes = apply_bins(X, bin_edges)
    assert np.all(codes[::7, 1] == 31)
    present = ~np.isnan(X)
    for feature in range(3):
        # One bin per distinct value, in order.
        np.testing.assert_array_equal(codes[present[:, feature], feature], X[present[:, feature], feature])
    assert fit_bin_edges(X, max_bin=24).max_bin == 24, "never wider than max_bin"


@pytest.mark.parametrize("max_bin", [256, 32, 2])
def test_unweighted_edges_equal_those_of_equal_weights(max_bin):
    """Without weights the edges come from a plain sort (a value's weight below is its rank);
    with weights, from an argsort and running sums: equal weights give the same edges, on
    continuous values, heavy ties, few distinct values, a constant column and NaN."""
    rng = np.random.default_rng(7)
    X = rng.normal(size=(20_000, 4)).astype(np.float32)
    X[:, 1] = np.round(X[:, 1] * 30)  # ties: more distinct values than bins
    X[:, 2] = np.round(X[:, 2])  # a handful of distinct values
    X[:, 3] = 2.5
    X[rng.uniform(size=X.shape) < 0.1] = np.nan
    unweighted = fit_bin_edges(X, max_bin=max_bin)
    weighted = fit_bin_edges(X, max_bin=max_bin, sample_weight=np.full(len(X), 0.5))
    np.testing.assert_array_equal(unweighted.n_edges, weighted.n_edges)
    np.testing.assert_array_equal(unweighted.edges, weighted.edges)
    assert unweighted.n_edges[3] == 0 and unweighted.n_edges[0] == max_bin - 2


@pytest.mark.parametrize("max_bin", [2, 3, 100, 256])
def test_codes_count_the_edges_at_or_below_each_value(max_bin):
    """The fixed-step search gives searchsorted's codes (``#{real edges <= x}``) for values on
    every edge and one float32 step below it, for -inf and +inf (which passes the +inf
    padding: its code is still the real edge count), with NaN in the missing code; code
    widths that are not a power of two (100 bins) included."""
    rng = np.random.default_rng(11)
    X = rng.normal(size=(2000, 3)).astype(np.float32)
    X[:, 1] = np.round(X[:, 1] * 3)
    bin_edges = fit_bin_edges(X, max_bin=max_bin)
    probes = []
    for feature in range(3):
        real = _real_edges(bin_edges, feature)
        column = np.concatenate([real, np.nextafter(real, np.float32(-np.inf)), [np.inf, -np.inf, np.nan],
                                 rng.normal(size=50).astype(np.float32)])
        probes.append(np.resize(column, 3 * 260 + 50))
    X_probe = np.stack(probes, axis=1).astype(np.float32)
    codes = apply_bins(X_probe, bin_edges)
    for feature in range(3):
        column = X_probe[:, feature]
        expected = np.searchsorted(_real_edges(bin_edges, feature), column, side="right")
        expected[np.isnan(column)] = bin_edges.missing_bin
        np.testing.assert_array_equal(codes[:, feature], expected)
