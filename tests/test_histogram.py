"""Tests of the histogram kernel and the depth-wise grower against naive NumPy versions written here.

The naive grower builds every node's histogram straight from the rows in that node (no sibling
subtraction) and scans every candidate split with XGBoost's ``loss_chg`` re-derived in NumPy.
"""

from __future__ import annotations

import os
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import each_kernel_simd, needs_repeatable_sums, shard_training_rows

from jaxboost import native
from jaxboost.grower import MIN_LOSS_CHANGE, GrowthParams, grow_tree
from jaxboost.histogram import (HISTOGRAM_TARGET, build_histogram, cumulative_over_bins, first_maximum, top_after,
                                route_and_build_histogram)
from jaxboost.regularizer import Regularization
from jaxboost.tree import num_heap_nodes

N_ROWS = 600
N_FEATURES = 4
MAX_BIN = 16


# --------------------------------------------------------------------------------------------
# build_histogram
# --------------------------------------------------------------------------------------------


def naive_histogram(X_binned, node_index, gradients, hessians, num_nodes, max_bin):
    """(num_nodes, d, max_bin, 2) by a plain loop-free scatter in float64."""
    n_rows, n_features = X_binned.shape
    histogram = np.zeros((num_nodes, n_features, max_bin, 2))
    for feature in range(n_features):
        np.add.at(histogram[:, feature, :, 0], (node_index, X_binned[:, feature]), gradients)
        np.add.at(histogram[:, feature, :, 1], (node_index, X_binned[:, feature]), hessians)
    return histogram


@partial(jax.jit, static_argnames=("num_nodes", "max_bin"))
def _jit_histogram(X_binned_T, node_index, gradients, hessians, num_nodes, max_bin):
    return build_histogram(X_binned_T, node_index, gradients, hessians, num_nodes, max_bin)


@pytest.mark.parametrize("num_nodes,max_bin", [(1, 2), (1, 256), (4, 16), (8, 64), (3, 7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_build_histogram_matches_numpy(num_nodes, max_bin, seed):
    rng = np.random.default_rng(seed)
    X_binned = rng.integers(0, max_bin, size=(N_ROWS, N_FEATURES)).astype(np.uint8)
    node_index = rng.integers(0, num_nodes, size=N_ROWS).astype(np.int32)
    gradients = rng.normal(size=N_ROWS).astype(np.float32)
    hessians = rng.uniform(0.0, 2.0, size=N_ROWS).astype(np.float32)
    expected = naive_histogram(X_binned, node_index, gradients.astype(np.float64), hessians.astype(np.float64),
                               num_nodes, max_bin)
    actual = _jit_histogram(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients),
                            jnp.asarray(hessians), num_nodes, max_bin)
    assert actual.shape == expected.shape, f"shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == jnp.float32, f"dtype {actual.dtype}, expected float32"
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4,
                               err_msg=f"histogram differs (num_nodes={num_nodes}, max_bin={max_bin})")
    # Every row is counted once per feature.
    np.testing.assert_allclose(np.asarray(actual).sum(axis=(0, 2)),
                               np.tile([gradients.sum(), hessians.sum()], (N_FEATURES, 1)), rtol=1e-4, atol=1e-3)


def test_build_histogram_zero_weight_rows_do_not_count():
    rng = np.random.default_rng(7)
    X_binned = rng.integers(0, 16, size=(N_ROWS, N_FEATURES)).astype(np.uint8)
    node_index = rng.integers(0, 4, size=N_ROWS).astype(np.int32)
    gradients = rng.normal(size=N_ROWS).astype(np.float32)
    hessians = rng.uniform(0.5, 1.5, size=N_ROWS).astype(np.float32)
    excluded = rng.uniform(size=N_ROWS) < 0.3
    gradients[excluded] = 0.0
    hessians[excluded] = 0.0
    node_index[excluded] = 3  # irrelevant for rows carrying zeros
    kept = ~excluded
    expected = naive_histogram(X_binned[kept], node_index[kept], gradients[kept].astype(np.float64),
                               hessians[kept].astype(np.float64), 4, 16)
    actual = _jit_histogram(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients),
                            jnp.asarray(hessians), 4, 16)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------------------------
# grow_tree vs a naive NumPy grower
# --------------------------------------------------------------------------------------------


def np_soft_threshold(G, alpha):
    return np.sign(G) * np.maximum(np.abs(G) - alpha, 0.0)


def np_score(G, H, reg_lambda, reg_alpha):
    """XGBoost's node score without max_delta_step: T_alpha(G)^2 / (H + lambda)."""
    return np_soft_threshold(G, reg_alpha) ** 2 / (H + reg_lambda)


def np_leaf_value(G, H, reg_lambda, reg_alpha):
    return -np_soft_threshold(G, reg_alpha) / (H + reg_lambda) if H + reg_lambda > 0 else 0.0


class NaiveTree:
    def __init__(self, num_nodes):
        self.feature = np.zeros(num_nodes, np.int64)
        self.threshold_bin = np.zeros(num_nodes, np.int64)
        self.default_left = np.zeros(num_nodes, bool)
        self.is_leaf = np.zeros(num_nodes, bool)
        self.value = np.zeros(num_nodes)
        self.loss_change = np.zeros(num_nodes)
        self.sum_hessians = np.zeros(num_nodes)
        self.reached = np.zeros(num_nodes, bool)


def naive_best_split(X_binned, g, h, max_bin, reg_lambda, reg_alpha, min_child_weight):
    """Best (loss_chg, feature, threshold_bin, default_left) of the rows given, from the rows themselves.

    Candidates are visited in the library's tie order: feature, then missing-left before
    missing-right, then bin; only a strictly larger loss_chg replaces the incumbent.
    """
    missing_bin = max_bin - 1
    G, H = g.sum(), h.sum()
    parent_score = np_score(G, H, reg_lambda, reg_alpha)
    best = (-np.inf, 0, 0, True)
    for feature in range(X_binned.shape[1]):
        codes = X_binned[:, feature].astype(np.int64)
        missing = codes == missing_bin
        for default_left in (True, False):
            for threshold in range(max_bin - 1):
                left = (~missing & (codes <= threshold)) | (missing & default_left)
                GL, HL = g[left].sum(), h[left].sum()
                GR, HR = g[~left].sum(), h[~left].sum()
                if not (HL >= min_child_weight and HR >= min_child_weight and HL > 0 and HR > 0):
                    continue
                gain = np_score(GL, HL, reg_lambda, reg_alpha) + np_score(GR, HR, reg_lambda, reg_alpha) - parent_score
                if gain > best[0]:
                    best = (gain, feature, threshold, default_left)
    return best


def goes_left(X_binned_rows, feature, threshold_bin, default_left):
    codes = X_binned_rows[:, feature].astype(np.int64)
    return np.where(codes == MAX_BIN - 1, default_left, codes <= threshold_bin)


def naive_grow(X_binned, g, h, max_depth, max_bin, reg_lambda, reg_alpha, min_child_weight, learning_rate,
               library_tree=None):
    """Depth-wise tree from direct per-node sums.

    Candidates that cut a node's rows into the same two sets (thresholds across bins holding
    none of its rows, two features ordering its rows alike, or "missing left, lowest bin" versus
    "missing right, last bin" when only missing rows go one way) tie in exact arithmetic; the
    library's float32 sums (sibling histograms by subtraction, per-feature summation order) break
    such ties by rounding. Given ``library_tree``, such a tie is resolved the way the library did,
    so that the rest of the trees stay comparable; the nodes where that happened are returned.
    """
    num_nodes = num_heap_nodes(max_depth)
    tree = NaiveTree(num_nodes)
    row_leaf = np.full(X_binned.shape[0], -1)
    adopted = []

    def visit(node, rows, depth):
        tree.reached[node] = True
        G, H = g[rows].sum(), h[rows].sum()
        tree.value[node] = learning_rate * np_leaf_value(G, H, reg_lambda, reg_alpha)
        tree.sum_hessians[node] = H
        if depth < max_depth:
            gain, feature, threshold, default_left = naive_best_split(
                X_binned[rows], g[rows], h[rows], max_bin, reg_lambda, reg_alpha, min_child_weight)
            if gain > MIN_LOSS_CHANGE:
                choice = (feature, threshold, default_left)
                if library_tree is not None and not library_tree.is_leaf[node]:
                    library_choice = (int(library_tree.feature[node]), int(library_tree.threshold_bin[node]),
                                      bool(library_tree.default_left[node]))
                    left = goes_left(X_binned[rows], *choice)
                    library_left = goes_left(X_binned[rows], *library_choice)
                    if library_choice != choice and (np.array_equal(left, library_left)
                                                     or np.array_equal(left, ~library_left)):
                        choice = library_choice
                        adopted.append(node)
                tree.feature[node], tree.threshold_bin[node], tree.default_left[node] = choice
                tree.loss_change[node] = gain
                left = goes_left(X_binned[rows], *choice)
                visit(2 * node + 1, rows[left], depth + 1)
                visit(2 * node + 2, rows[~left], depth + 1)
                return
        tree.is_leaf[node] = True
        row_leaf[rows] = node

    visit(0, np.arange(X_binned.shape[0]), 0)
    return tree, row_leaf, adopted


@partial(jax.jit, static_argnames=("max_depth", "max_bin"))
def _jit_grow(X_binned_T, gradients, hessians, params, max_depth, max_bin):
    feature_allowed = jnp.ones(X_binned_T.shape[0], bool)
    tree, row_leaves, _, _ = grow_tree(X_binned_T, gradients, hessians, feature_allowed, jax.random.PRNGKey(0), params,
                                    max_depth, max_bin, axis_name=None)
    return tree, row_leaves.heap_index()


def make_params(reg_lambda, reg_alpha, min_child_weight, learning_rate, gamma=0.0, max_delta_step=0.0):
    f32 = jnp.float32
    return GrowthParams(
        reg=Regularization(f32(reg_lambda), f32(reg_alpha), f32(max_delta_step)),
        learning_rate=f32(learning_rate), gamma=f32(gamma), min_child_weight=f32(min_child_weight),
        colsample_bylevel=f32(1.0), colsample_bynode=f32(1.0))


def make_data(seed, missing_fraction=0.05):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N_ROWS, N_FEATURES))
    # A signal the tree can find, plus continuous noise so that no two candidates tie by accident.
    g = (np.where(X[:, 0] > 0.3, 1.0, -1.0) + 0.7 * np.sin(2 * X[:, 1]) * (X[:, 2] > 0)
         + rng.normal(size=N_ROWS)).astype(np.float32)
    h = rng.uniform(0.2, 1.5, size=N_ROWS).astype(np.float32)
    # Quantile codes 0..MAX_BIN-2 for values, MAX_BIN-1 for ~5% missing.
    ranks = np.argsort(np.argsort(X, axis=0), axis=0)
    X_binned = (ranks * (MAX_BIN - 1) // N_ROWS).astype(np.uint8)
    X_binned[rng.uniform(size=X_binned.shape) < missing_fraction] = MAX_BIN - 1
    # Missing values are informative on feature 1 so the learned default direction matters.
    g = g + np.where(X_binned[:, 1] == MAX_BIN - 1, 1.5, 0.0).astype(np.float32)
    return X_binned, g, h


REG_CASES = [
    # (lambda, alpha, min_child_weight, learning_rate)
    (1.0, 0.0, 1.0, 0.3),
    (5.0, 0.5, 0.0, 1.0),
    (0.5, 2.0, 10.0, 0.1),
    (0.0, 0.0, 0.0, 1.0),
]


@pytest.mark.parametrize("max_depth", [3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reg_case", REG_CASES)
def test_grow_tree_matches_naive_grower(max_depth, seed, reg_case):
    reg_lambda, reg_alpha, min_child_weight, learning_rate = reg_case
    X_binned, g, h = make_data(seed)
    assert np.mean(X_binned == MAX_BIN - 1) > 0.03, "the data should carry missing codes"
    tree, row_leaf = _jit_grow(jnp.asarray(X_binned.T), jnp.asarray(g), jnp.asarray(h),
                               make_params(reg_lambda, reg_alpha, min_child_weight, learning_rate), max_depth, MAX_BIN)
    tree = jax.tree.map(np.asarray, tree)
    row_leaf = np.asarray(row_leaf)
    expected, expected_row_leaf, tie_nodes = naive_grow(
        X_binned, g.astype(np.float64), h.astype(np.float64), max_depth, MAX_BIN, reg_lambda, reg_alpha,
        min_child_weight, learning_rate, library_tree=tree)
    reached = expected.reached
    split = reached & ~expected.is_leaf
    assert split.sum() >= 3, "the test data should give a tree with several splits"
    context = f"(depth={max_depth}, seed={seed}, reg={reg_case}, exact ties resolved as the library did at {tie_nodes})"

    np.testing.assert_array_equal(tree.is_leaf[reached], expected.is_leaf[reached],
                                  err_msg=f"is_leaf differs on reached nodes {context}")
    np.testing.assert_array_equal(tree.feature[split], expected.feature[split], err_msg=f"feature differs {context}")
    np.testing.assert_array_equal(tree.threshold_bin[split], expected.threshold_bin[split],
                                  err_msg=f"threshold_bin differs {context}")
    np.testing.assert_array_equal(tree.default_left[split], expected.default_left[split],
                                  err_msg=f"default_left differs {context}")
    np.testing.assert_allclose(tree.loss_change[reached], expected.loss_change[reached], rtol=1e-4, atol=1e-4,
                               err_msg=f"loss_change differs {context}")
    np.testing.assert_allclose(tree.value[reached], expected.value[reached], rtol=1e-4, atol=1e-6,
                               err_msg=f"value differs {context}")
    np.testing.assert_allclose(tree.sum_hessians[reached], expected.sum_hessians[reached], rtol=1e-5, atol=1e-4,
                               err_msg=f"sum_hessians differs {context}")
    np.testing.assert_array_equal(row_leaf, expected_row_leaf, err_msg=f"row_leaf differs {context}")
    assert np.all(tree.is_leaf[row_leaf]), f"a row ends in a node that is not a leaf {context}"
    # Nodes never reached keep zeros.
    unreached = ~reached
    assert not tree.is_leaf[unreached].any() and not tree.default_left[unreached].any(), f"unreached nodes {context}"
    assert np.all(tree.value[unreached] == 0) and np.all(tree.loss_change[unreached] == 0), f"unreached nodes {context}"


@pytest.mark.parametrize("n_features", [7, 28, 200])  # 200: past PAIRWISE_RANK_FEATURES, sorted
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("ties", [False, True])
def test_sample_features_keeps_the_allowed_features_of_smallest_scores(monkeypatch, n_features, fraction, ties):
    """Each row (a node) keeps max(1, floor(fraction * #allowed)) of its allowed features, those
    of the smallest uniform scores: the same subset as a stable NumPy sort of the same scores,
    also when scores tie (float32 uniforms do: a sort-path sample of 500 features once kept 251
    at a fraction of 0.5)."""
    from jaxboost import grower
    from jaxboost.grower import sample_features
    from jaxboost.sampling import uniform_scores

    key = jax.random.PRNGKey(n_features)
    rng = np.random.default_rng(n_features)
    allowed = rng.uniform(size=(16, n_features)) < 0.7
    allowed[0] = True
    allowed[1] = False
    allowed[1, 3] = True  # one allowed feature: kept whatever the fraction
    scores = np.asarray(uniform_scores(key, allowed.shape))
    if ties:  # eight distinct scores: many features tie at every cut
        scores = np.floor(scores * 8) / 8
        monkeypatch.setattr(grower, "uniform_scores", lambda _, shape: jnp.asarray(scores).reshape(shape))
    # A function of its own: jit would reuse the trace of sample_features with the true uniforms.
    kept = np.asarray(jax.jit(lambda *args: sample_features(*args))(key, jnp.asarray(allowed), jnp.float32(fraction)))
    for row in range(allowed.shape[0]):
        candidates = np.flatnonzero(allowed[row])
        keep = max(1, int(np.floor(np.float32(fraction) * np.float32(len(candidates)))))
        expected = np.zeros(n_features, bool)
        expected[candidates[np.argsort(scores[row, candidates], kind="stable")[:keep]]] = True
        np.testing.assert_array_equal(kept[row], expected, err_msg=f"row {row}")


def test_grow_tree_without_a_valid_split_is_a_single_leaf():
    X_binned, g, h = make_data(0)
    # min_child_weight above half the total Hessian: no split can satisfy it on both sides.
    min_child_weight = float(h.sum()) * 0.51
    tree, row_leaf = _jit_grow(jnp.asarray(X_binned.T), jnp.asarray(g), jnp.asarray(h),
                               make_params(1.0, 0.0, min_child_weight, 0.5), 3, MAX_BIN)
    assert bool(tree.is_leaf[0]), "the root should be a leaf"
    assert not np.asarray(tree.is_leaf[1:]).any(), "no other node should exist"
    np.testing.assert_array_equal(np.asarray(row_leaf), 0)
    expected_value = 0.5 * np_leaf_value(g.astype(np.float64).sum(), h.astype(np.float64).sum(), 1.0, 0.0)
    np.testing.assert_allclose(float(tree.value[0]), expected_value, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# native CPU kernel (XLA FFI) and its fallback
# --------------------------------------------------------------------------------------------

NATIVE_AVAILABLE = native.native_target(HISTOGRAM_TARGET) is not None
# The native kernels are CPU kernels: on a GPU the XLA kernel runs whatever the kernel asked for.
needs_native = pytest.mark.skipif(not NATIVE_AVAILABLE or jax.default_backend() != "cpu",
                                  reason="native kernel not built here (no C++ compiler, or JAXBOOST_NATIVE=0), "
                                         "or JAX's default backend is not the CPU")


def histogram_case(seed, n_rows, n_features, num_nodes, max_bin, mask_fraction=0.6):
    rng = np.random.default_rng(seed)
    X_binned = rng.integers(0, max_bin, size=(n_rows, n_features)).astype(np.uint8)
    node_index = rng.integers(0, num_nodes, size=n_rows).astype(np.int32)
    gradients = rng.normal(size=n_rows).astype(np.float32)
    hessians = rng.uniform(0.0, 2.0, size=n_rows).astype(np.float32)
    row_mask = rng.uniform(size=n_rows) < mask_fraction
    return X_binned, node_index, gradients, hessians, row_mask


def masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, num_nodes, max_bin):
    keep = np.ones(len(node_index), bool) if row_mask is None else row_mask
    return naive_histogram(X_binned[keep], node_index[keep], gradients[keep].astype(np.float64),
                           hessians[keep].astype(np.float64), num_nodes, max_bin)


def test_native_kernel_builds_where_a_compiler_exists():
    import shutil
    if not native.native_enabled():
        pytest.skip("JAXBOOST_NATIVE=0 turns the native kernel off")
    has_compiler = shutil.which(os.environ.get("CXX", "c++").split()[0]) is not None
    assert NATIVE_AVAILABLE == has_compiler, (
        f"native kernel available: {NATIVE_AVAILABLE}, C++ compiler present: {has_compiler}")


@needs_native
@pytest.mark.parametrize("num_nodes,max_bin,n_features", [(1, 256, 3), (1, 256, 9), (5, 256, 4), (8, 64, 5),
                                                         (3, 7, 2)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_native_histogram_matches_numpy(num_nodes, max_bin, n_features, with_mask):
    # 70,000 rows: more than two of the kernel's 32,768-row blocks, the last one partial. One
    # node without a mask is the root's path (rows read in order); 9 features take the kernel's
    # groups of four and a remainder.
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(3, 70_000, n_features, num_nodes, max_bin)
    row_mask = row_mask if with_mask else None
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, num_nodes, max_bin)
    build = jax.jit(partial(build_histogram, num_nodes=num_nodes, max_bin=max_bin, kernel="native"))
    actual = np.asarray(build(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients),
                              jnp.asarray(hessians), row_mask=None if row_mask is None else jnp.asarray(row_mask)))
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4,
                               err_msg=f"native histogram differs ({num_nodes} nodes, {max_bin} bins, mask {with_mask})")


def repeated_codes(n_rows: int, max_bin: int) -> np.ndarray:
    """Codes whose consecutive rows share a code as a pixel's or a count's do: a constant feature,
    long runs of each code, a dominant code with others scattered, then random ones."""
    rng = np.random.default_rng(5)
    runs = np.sort(rng.integers(0, max_bin, size=n_rows))
    mostly_zero = np.where(rng.uniform(size=n_rows) < 0.8, 0, rng.integers(1, max_bin, size=n_rows))
    columns = [np.full(n_rows, max_bin - 1), runs, mostly_zero] + [rng.integers(0, max_bin, size=n_rows)
                                                                   for _ in range(3)]
    return np.stack(columns, axis=1).astype(np.uint8)


def sequential_float32_histogram(X_binned, gradients, hessians, max_bin, channels=2):
    """The root's cells as float32 adds of the rows one after the other, in row order."""
    histogram = np.zeros((1, X_binned.shape[1], max_bin, channels), np.float32)
    for feature in range(X_binned.shape[1]):
        for channel, values in ((0, gradients), (1, hessians)):
            np.add.at(histogram[0, feature, :, channel], X_binned[:, feature], values)
    return histogram


@needs_native
@pytest.mark.parametrize("max_bin", [256, 17])
@pytest.mark.parametrize("used", [None, (0, 1, 2, 4, 5)])
def test_native_root_histogram_of_repeated_codes(max_bin, used):
    """The root's pass alternates rows between two copies of the cells, so that rows sharing a
    code do not wait on each other; the sums are the rows' (70,001 of them: blocks of 32,768, an
    odd last one), with and without a column sample. With ``row_order`` the rows add in row
    order, the channel kernel's: the float32 sums are exactly those of NumPy's adds in order."""
    n_rows = 70_001
    X_binned = repeated_codes(n_rows, max_bin)
    rng = np.random.default_rng(6)
    gradients = rng.normal(size=n_rows).astype(np.float32)
    hessians = rng.uniform(0.0, 2.0, size=n_rows).astype(np.float32)
    features_used = None if used is None else np.isin(np.arange(X_binned.shape[1]), used)
    expected = naive_histogram(X_binned, np.zeros(n_rows, np.int32), gradients.astype(np.float64),
                               hessians.astype(np.float64), 1, max_bin)
    in_order = sequential_float32_histogram(X_binned, gradients, hessians, max_bin)
    if features_used is not None:
        expected[:, ~features_used] = in_order[:, ~features_used] = 0.0
    arguments = (jnp.asarray(X_binned.T), jnp.zeros(n_rows, jnp.int32), jnp.asarray(gradients), jnp.asarray(hessians))
    for row_order in (False, True):
        build = jax.jit(partial(build_histogram, num_nodes=1, max_bin=max_bin, kernel="native", row_order=row_order,
                                features_used=None if used is None else jnp.asarray(features_used)))
        actual = np.asarray(build(*arguments))
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-3, err_msg=f"row order {row_order}")
        if row_order:
            np.testing.assert_array_equal(actual, in_order)


@needs_native
def test_native_root_histogram_of_repeated_codes_into_wider_cells(monkeypatch):
    """Pairs added into cells of four channels (the second pair into the first's result) alternate
    a root's rows alike: each channel holds its sums, the same bit for bit from every variant of
    the kernel's feature pass this CPU runs (AVX-512, AVX2, the baseline)."""
    n_rows = 40_001
    X_binned = repeated_codes(n_rows, 256)
    rng = np.random.default_rng(7)
    values = rng.normal(size=(4, n_rows)).astype(np.float32)
    arguments = (jnp.asarray(X_binned.T), jnp.zeros(n_rows, jnp.int32))

    @jax.jit
    def four_channels(values):
        first = build_histogram(*arguments, values[0], values[1], 1, 256, kernel="native", channels=4, channel=0)
        return build_histogram(*arguments, values[2], values[3], 1, 256, kernel="native", channels=4, channel=2,
                               into=first)

    actual = np.asarray(four_channels(jnp.asarray(values)))
    for pair in (0, 2):
        expected = naive_histogram(X_binned, np.zeros(n_rows, np.int32), values[pair].astype(np.float64),
                                   values[pair + 1].astype(np.float64), 1, 256)
        np.testing.assert_allclose(actual[..., pair:pair + 2], expected, rtol=1e-5, atol=1e-3, err_msg=f"pair {pair}")
    for simd in each_kernel_simd(monkeypatch):
        np.testing.assert_array_equal(np.asarray(four_channels(jnp.asarray(values))), actual, err_msg=simd or "widest")


@pytest.mark.parametrize("kernel,max_bin,threads,result_features", [
    pytest.param("native", 256, 1, 9, marks=needs_native), pytest.param("native", 64, 2, 12, marks=needs_native),
    ("xla", 64, 1, 12)])
def test_feature_major_padded_histograms_hold_the_same_sums(kernel, max_bin, threads, result_features):
    """Laid out feature by feature in memory and padded with zero features (for sums over
    devices scattered by feature), the kernels' histograms hold the same sums: the root's path,
    a masked build and a routed level, with and without the scratch buffer of fewer than 256
    bins; the XLA kernel pads alike."""
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(12, 40_000, 9, 5, max_bin)
    args = (jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    options = dict(max_bin=max_bin, kernel=kernel, threads=threads, feature_major=True, result_features=result_features)

    def padded(histogram):
        return np.pad(histogram, ((0, 0), (0, result_features - 9), (0, 0), (0, 0)))

    for nodes, mask in [(1, None), (5, row_mask)]:
        build = jax.jit(partial(build_histogram, num_nodes=nodes, **options))
        actual = np.asarray(build(*args[:1], jnp.minimum(args[1], nodes - 1), *args[2:],
                                  row_mask=None if mask is None else jnp.asarray(mask)))
        expected = masked_naive_histogram(X_binned, np.minimum(node_index, nodes - 1), gradients, hessians, mask,
                                          nodes, max_bin)
        np.testing.assert_allclose(actual, padded(expected), rtol=1e-5, atol=1e-4)
    _, _, _, _, level = route_case(12, 40_000, 9, 5, max_bin)
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    child, smaller = jax.jit(partial(route_and_build_histogram, **options))(
        *args, **{k: jnp.asarray(v) for k, v in level.items()})
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller, 5, max_bin)
    assert_split_nodes_close(smaller, padded(expected), level["splits"], kernel, rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("max_bin,threads,feature_major", [(256, 1, False), (256, 2, True), (64, 2, False)])
def test_native_kernels_zero_the_cells_they_write_in_a_reused_buffer(max_bin, threads, feature_major):
    """In a loop XLA hands the kernels the same output buffer every step, holding the last
    step's sums: the cells written must be zeroed first, including by a call whose rows all
    have zero gradient and Hessian (no pass over rows runs) and in the zero features that pad
    the result (each thread zeroes its features just before its first pass with 256 bins)."""
    n_rows, n_features, result_features, num_nodes = 40_000, 9, 12, 5  # two row blocks
    X_binned, node_index, gradients, hessians, level = route_case(21, n_rows, n_features, num_nodes, max_bin)
    row_mask = np.random.default_rng(22).uniform(size=n_rows) < 0.6
    scales = np.array([1.0, 0.0, 2.0], np.float32)  # step 1: every row adds nothing
    options = dict(max_bin=max_bin, kernel="native", threads=threads, feature_major=feature_major,
                   result_features=result_features)
    X_T, nodes, mask = jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(row_mask)
    split_level = {k: jnp.asarray(v) for k, v in level.items()}

    @jax.jit
    def every_step(g, h):
        def step(i, results):
            scale = jnp.asarray(scales)[i]
            scaled_g, scaled_h = g * scale, h * scale
            root = build_histogram(X_T, jnp.zeros_like(nodes), scaled_g, scaled_h, 1, **options)
            masked = build_histogram(X_T, nodes, scaled_g, scaled_h, num_nodes, row_mask=mask, **options)
            _, smaller = route_and_build_histogram(X_T, nodes, scaled_g, scaled_h, **split_level, **options)
            return tuple(jax.lax.dynamic_update_index_in_dim(whole, part, i, 0)
                         for whole, part in zip(results, (root, masked, smaller)))

        shapes = [(1, result_features), (num_nodes, result_features), (num_nodes, result_features)]
        results = tuple(jnp.full((len(scales), n, d, max_bin, 2), jnp.nan, jnp.float32) for n, d in shapes)
        return jax.lax.fori_loop(0, len(scales), step, results)

    roots, masked, smaller = every_step(jnp.asarray(gradients), jnp.asarray(hessians))
    _, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    pad = ((0, 0), (0, result_features - n_features), (0, 0), (0, 0))
    for i, scale in enumerate(scales):
        g, h = gradients * scale, hessians * scale
        np.testing.assert_allclose(np.asarray(roots[i]), np.pad(masked_naive_histogram(
            X_binned, np.zeros_like(node_index), g, h, None, 1, max_bin), pad), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(np.asarray(masked[i]), np.pad(masked_naive_histogram(
            X_binned, node_index, g, h, row_mask, num_nodes, max_bin), pad), rtol=1e-5, atol=1e-3)
        assert_split_nodes_close(smaller[i], np.pad(masked_naive_histogram(
            X_binned, node_index, g, h, in_smaller, num_nodes, max_bin), pad), level["splits"], "native",
            rtol=1e-5, atol=1e-3)


@needs_native
def test_native_and_xla_kernels_agree_with_threads_and_masks():
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(4, 3000, 7, 6, 32, mask_fraction=0.3)
    args = (jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, 6, 32)
    for kernel, threads in [("xla", 1), ("native", 1), ("native", 3), ("native", 16)]:
        build = jax.jit(partial(build_histogram, num_nodes=6, max_bin=32, kernel=kernel, threads=threads))
        actual = build(*args, row_mask=jnp.asarray(row_mask))
        np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4,
                                   err_msg=f"kernel={kernel}, threads={threads}")


@needs_native
def test_native_histogram_skips_rows_outside_the_mask_and_the_node_range():
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(5, 2000, 3, 4, 16)
    # Rows outside the mask carry huge values and out-of-range nodes: they must not be read.
    gradients[~row_mask] = 1e30
    node_index[~row_mask] = 1_000_000
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, 4, 16)
    actual = jax.jit(lambda *a: build_histogram(*a[:4], 4, 16, row_mask=a[4], kernel="native"))(
        jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians),
        jnp.asarray(row_mask))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_histogram_under_vmap(kernel):
    # Several models at once: per-model gradients and masks, shared codes and nodes.
    X_binned, node_index, _, _, _ = histogram_case(6, 1500, 3, 4, 16)
    rng = np.random.default_rng(6)
    gradients = rng.normal(size=(3, 1500)).astype(np.float32)
    hessians = rng.uniform(0.1, 1.0, size=(3, 1500)).astype(np.float32)
    masks = rng.uniform(size=(3, 1500)) < 0.5
    build = jax.jit(jax.vmap(lambda g, h, m: build_histogram(jnp.asarray(X_binned.T), jnp.asarray(node_index), g, h,
                                                             4, 16, row_mask=m, kernel=kernel)))
    actual = np.asarray(build(jnp.asarray(gradients), jnp.asarray(hessians), jnp.asarray(masks)))
    assert actual.shape == (3, 4, 3, 16, 2)
    for model in range(3):
        expected = masked_naive_histogram(X_binned, node_index, gradients[model], hessians[model], masks[model], 4, 16)
        np.testing.assert_allclose(actual[model], expected, rtol=1e-5, atol=1e-4, err_msg=f"model {model}")


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two JAX devices (jaxboost sets one per CPU core)")
@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_histogram_under_shard_map_on_two_devices(kernel):
    from jax.sharding import Mesh, PartitionSpec

    X_binned, node_index, gradients, hessians, row_mask = histogram_case(7, 4000, 4, 8, 64)
    mesh = Mesh(np.array(jax.devices()[:2]), ("rows",))
    rows = PartitionSpec("rows")

    def local(X_T, nodes, g, h, mask):
        return jax.lax.psum(build_histogram(X_T, nodes, g, h, 8, 64, row_mask=mask, kernel=kernel), "rows")

    build = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(None, "rows"), rows, rows, rows, rows),
                                  out_specs=PartitionSpec()))
    actual = build(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians),
                   jnp.asarray(row_mask))
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, 8, 64)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)


def test_histogram_rejects_bad_arguments():
    X_T, nodes = jnp.zeros((2, 10), jnp.uint8), jnp.zeros(10, jnp.int32)
    g = h = jnp.ones(10)
    with pytest.raises(ValueError, match="kernel must be one of"):
        build_histogram(X_T, nodes, g, h, 1, 4, kernel="fast")
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        build_histogram(X_T, nodes, g, h, 1, 4, threads=0)
    with pytest.raises(ValueError, match="row_mask must hold one flag per row"):
        build_histogram(X_T, nodes, g, h, 1, 4, row_mask=jnp.ones(9, bool))
    with pytest.raises(ValueError, match="uint8 codes"):
        build_histogram(X_T.astype(jnp.uint16), nodes, g, h, 1, 4, kernel="native")


def test_fallback_to_xla_when_native_is_turned_off(monkeypatch):
    monkeypatch.setenv("JAXBOOST_NATIVE", "0")
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(8, 1000, 3, 2, 16)
    args = (jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    with pytest.raises(RuntimeError, match="native histogram kernel is unavailable"):
        build_histogram(*args, 2, 16, kernel="native")
    lowered = jax.jit(lambda *a: build_histogram(*a, 2, 16, row_mask=jnp.asarray(row_mask))).lower(*args).as_text()
    assert HISTOGRAM_TARGET not in lowered, "JAXBOOST_NATIVE=0 should leave the native kernel out"
    actual = jax.jit(lambda *a: build_histogram(*a, 2, 16, row_mask=jnp.asarray(row_mask)))(*args)
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, 2, 16)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)


@needs_native
def test_auto_kernel_uses_the_native_kernel_on_cpu_with_and_without_a_mask():
    args = (jnp.zeros((2, 10), jnp.uint8), jnp.zeros(10, jnp.int32), jnp.ones(10), jnp.ones(10))
    masked = jax.jit(lambda *a: build_histogram(*a, 1, 4, row_mask=a[2] > 0)).lower(*args).as_text()
    assert HISTOGRAM_TARGET in masked
    every_row = jax.jit(lambda *a: build_histogram(*a, 1, 4)).lower(*args).as_text()
    assert HISTOGRAM_TARGET in every_row
    xla = jax.jit(lambda *a: build_histogram(*a, 1, 4, kernel="xla")).lower(*args).as_text()
    assert HISTOGRAM_TARGET not in xla


def test_code_lowered_for_another_platform_neither_builds_nor_calls_the_native_kernels(monkeypatch):
    """A GPU's round is lowered for the GPU alone (``native.lowering_for``): its kernels must not
    ask for the native ones, whose first use builds them (a C++ compile of seconds on a fresh
    machine, for a branch the lowering drops)."""
    from jaxboost.line_search import segment_sums
    from jaxboost.predictor import add_position_values

    def no_build():
        raise AssertionError("the native kernels were asked for")

    monkeypatch.setattr(native, "_registered_targets", no_build)
    monkeypatch.setenv("JAXBOOST_NATIVE", "1")  # asked for even where the suite runs without them
    codes, nodes, ones = jnp.zeros((2, 10), jnp.uint8), jnp.zeros(10, jnp.int32), jnp.ones(10)

    def kernels(codes, nodes, ones):
        histogram = build_histogram(codes, nodes, ones, ones, 1, 4)
        return (cumulative_over_bins(histogram), first_maximum(histogram[0]), segment_sums(ones, nodes, 2),
                add_position_values(ones[:, None], jnp.ones((1, 2)), nodes[None]))

    with native.lowering_for("gpu"):
        assert native.native_target(HISTOGRAM_TARGET) is None
        lowered = jax.jit(kernels).lower(codes, nodes, ones).as_text()
    assert "jaxboost_" not in lowered  # no native custom call
    # For the CPU the same code asks for them.
    with native.lowering_for("cpu"), pytest.raises(AssertionError, match="asked for"):
        native.native_target(HISTOGRAM_TARGET)


def test_native_build_failures_are_reported_not_raised(monkeypatch, tmp_path):
    # No compiler: a clear error from the builder, and the registry reports no native kernel.
    monkeypatch.setenv("JAXBOOST_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native._build_library()
    # A compiler that fails: an error naming the command, and no partial file left behind.
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        native._build_library()
    assert list(tmp_path.iterdir()) == []

    def broken_loader():
        raise RuntimeError("simulated build failure")

    monkeypatch.setattr(native, "_load_library", broken_loader)
    monkeypatch.setattr(native, "_warned_unavailable", False)
    with pytest.warns(RuntimeWarning, match="simulated build failure"):
        assert native._registered_targets.__wrapped__() == frozenset()


def test_a_failed_native_build_is_tried_once_and_warned_once(monkeypatch):
    """Without native kernels training and prediction are several times slower: a process is
    told once, with the reason, and a failing compiler is not run again at every call."""
    attempts = []

    def failing_build():
        attempts.append(True)
        raise RuntimeError("simulated: the compiler failed\nits long output")

    def no_predictor():
        raise RuntimeError("simulated: no predictor")

    monkeypatch.setattr(native, "_build_library", failing_build)
    monkeypatch.setattr(native, "_warned_unavailable", False)
    native._library_or_failure.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(RuntimeError, match="the compiler failed"):
                native._load_library()
        assert len(attempts) == 1
        with pytest.warns(RuntimeWarning) as caught:
            assert native._registered_targets.__wrapped__() == frozenset()
        (warning,) = caught
        message = str(warning.message)
        assert "native CPU kernels are unavailable (simulated: the compiler failed)" in message
        assert "JAXBOOST_NATIVE=0" in message and "long output" not in message
        # Once a process: the predictor's fallback says nothing more.
        monkeypatch.setattr(native, "_forest_functions", no_predictor)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not native.feature_predictor_available()
        # The predictor alone unavailable warns too, and turned off on purpose nothing warns.
        monkeypatch.setattr(native, "_warned_unavailable", False)
        with pytest.warns(RuntimeWarning, match="no predictor"):
            assert not native.feature_predictor_available()
        monkeypatch.setattr(native, "_warned_unavailable", False)
        monkeypatch.setenv("JAXBOOST_NATIVE", "0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not native.feature_predictor_available()
            assert native.native_target(HISTOGRAM_TARGET) is None
    finally:
        native._library_or_failure.cache_clear()  # the next caller builds (finds) the real library


def train_with_patches(monkeypatch, patches, X, y, settings, train=None):
    """``jb.train`` (or ``train``, e.g. ``jb.train_many``) with ``(owner, name, value)`` attributes
    replaced while its round is traced."""
    import jaxboost as jb
    from jaxboost import boosting

    for owner, name, value in patches:
        monkeypatch.setattr(owner, name, value)
    # Kernels are chosen when a round's programs are traced: every compiled one is forgotten
    # (clearing only the whole round's cache had left a fit's statistics and trees programs,
    # compiled apart, to the first fit of a process, whatever the later ones patched).
    boosting.clear_compiled_rounds()
    try:
        return (train or jb.train)(X, y, **settings)
    finally:
        monkeypatch.undo()
        boosting.clear_compiled_rounds()


def train_with_kernel(monkeypatch, X, y, settings, kernel):
    from jaxboost import grower, histogram

    # Every histogram the grower builds goes through these three, called by the statistics
    # wrappers it uses, and every children's subtraction through the fourth: all go to the
    # chosen kernel.
    names = ("build_histogram", "route_and_build_histogram", "build_channels_histogram")
    patches = [(histogram, name, partial(getattr(histogram, name), kernel=kernel)) for name in names]
    patches.append((grower, "children_histograms_over_parents",
                    partial(grower.children_histograms_over_parents, kernel=kernel)))
    return train_with_patches(monkeypatch, patches, X, y, settings)


def kernel_training_data(settings):
    rng = np.random.default_rng(11)
    X = rng.normal(size=(3000, 6)).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.05] = np.nan
    signal = np.nan_to_num(X[:, 0]) + np.sin(np.nan_to_num(X[:, 1])) + 0.5 * rng.normal(size=3000)
    y = np.digitize(signal, [0.0] if settings["loss"] == "logistic" else [-0.5, 0.5]).astype(np.float32)
    return X, y


def assert_same_models(model, other, X, settings, agreeing_predictions=1.0):
    """The same splits (98% of the nodes), and the same predictions: every row's, or more than
    the fraction ``agreeing_predictions`` of the rows' (the rest swapped leaves at a near tie)."""
    same_structure = np.mean((model.trees.feature == other.trees.feature)
                             & (model.trees.threshold_bin == other.trees.threshold_bin))
    assert same_structure > 0.98, f"only {same_structure:.3f} of the nodes agree"
    if agreeing_predictions == 1.0:
        np.testing.assert_allclose(model.predict(X), other.predict(X), rtol=1e-4, atol=1e-5)
    else:
        same = np.isclose(model.predict(X), other.predict(X), rtol=1e-4, atol=1e-5).mean()
        assert same > agreeing_predictions, f"{same:.4f} of the predictions agree"
    assert int(np.sum(~model.trees.is_leaf)) > 64 or settings["max_depth"] < 8  # deep levels split


def assert_same_trees(trees, other):
    """The same trees bit for bit, field by field."""
    for field in trees._fields:
        np.testing.assert_array_equal(getattr(trees, field), getattr(other, field), err_msg=field)


# Fits that two ways of growing trees must grow alike.
GROWTH_CASES = [
    pytest.param({"loss": "logistic", "num_rounds": 8, "max_depth": 4, "learning_rate": 0.3, "max_bin": 64},
                 id="logistic-depth4"),
    # The deep levels' loop, with the extra statistic pairs of vector leaves (3 classes).
    pytest.param({"loss": "softmax", "num_rounds": 2, "max_depth": 8, "learning_rate": 0.3, "max_bin": 64,
                  "multi_strategy": "multi_output_tree"}, id="softmax-vector-depth8"),
    # 3000 rows at depth 9: most deep slots hold no split (skipped), 256 bins (no scratch buffer),
    # monotone bounds carried through the skipped chunks.
    pytest.param({"loss": "logistic", "num_rounds": 3, "max_depth": 9, "learning_rate": 0.3, "max_bin": 256,
                  "monotone_constraints": [1, 0, 0, 0, 0, 0]}, id="logistic-monotone-depth9"),
    # A tree's column sample: compact histograms of its 3 features.
    pytest.param({"loss": "logistic", "num_rounds": 6, "max_depth": 5, "learning_rate": 0.3, "max_bin": 256,
                  "colsample_bytree": 0.5}, id="logistic-column-sample"),
]


@needs_native
@pytest.mark.parametrize("settings", GROWTH_CASES)
def test_training_with_native_kernel_matches_xla_kernel(monkeypatch, settings):
    """The native kernels and XLA's sum the rows in different orders, so two candidates whose
    gains tie to a few units in the last place may swap: at depth 9 with monotone bounds one node
    of 511 in the first tree did (gains 0.0113676 and 0.0113673), and 8 of 3000 predictions moved.
    That case asks for the same splits elsewhere and 99% of the predictions; the others for every
    prediction."""
    X, y = kernel_training_data(settings)
    agreeing = 0.99 if settings.get("max_depth", 0) >= 9 else 1.0
    assert_same_models(train_with_kernel(monkeypatch, X, y, settings, "native"),
                       train_with_kernel(monkeypatch, X, y, settings, "xla"), X, settings,
                       agreeing_predictions=agreeing)


@needs_native
@pytest.mark.parametrize("settings", GROWTH_CASES)
def test_native_sibling_subtraction_grows_the_trees_of_xlas(monkeypatch, settings):
    """On one device the children's histograms (the smaller child's, and the parent's minus it)
    are written by a native kernel, which leaves the slots of parents that do not split as they
    were; XLA's steps write zeros there. Both grow the same trees, bit for bit, with the native
    histogram kernel either way (with vector leaves on CPU each step builds its own smaller
    children, and XLA's steps remain)."""
    from jaxboost import grower

    X, y = kernel_training_data(settings)
    trees = {kernel: train_with_patches(monkeypatch, [(grower, "children_histograms_over_parents",
                                                       partial(grower.children_histograms_over_parents, kernel=kernel))],
                                        X, y, settings).trees
             for kernel in ("native", "xla")}
    assert_same_trees(trees["native"], trees["xla"])


@pytest.mark.parametrize("settings,sharded", [
    ({"loss": "logistic", "num_rounds": 3, "max_depth": 7, "learning_rate": 0.3, "max_bin": 64}, False),
    ({"loss": "logistic", "num_rounds": 3, "max_depth": 9, "learning_rate": 0.3, "max_bin": 256,
      "colsample_bynode": 0.8, "monotone_constraints": [1, 0, 0, 0, 0, -1]}, True),
    ({"loss": "softmax", "num_rounds": 2, "max_depth": 7, "learning_rate": 0.3, "max_bin": 64,
      "multi_strategy": "multi_output_tree"}, False),
])
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's one loop against the accelerators' two, on CPU")
def test_one_level_loop_grows_the_trees_of_two(monkeypatch, settings, sharded):
    """On CPU one loop runs every level over the widest level's slots; off it (a level handled
    whole) the shallow levels keep 32 slots and a second loop runs the deeper ones
    (``grower.looped_level_nodes``). Both grow the same trees, bit for bit, here both on CPU:
    one device, rows sharded over two, and vector leaves."""
    import jaxboost as jb
    from jaxboost import boosting, grower

    if sharded:
        if jax.default_backend() != "cpu" or len(jax.devices()) < 2:
            pytest.skip("needs two CPU devices")
        shard_training_rows(monkeypatch)
    X, y = kernel_training_data(settings)
    settings = dict(settings)
    if settings["loss"] == "softmax":
        settings["num_outputs"] = 3
    one_loop = grower.looped_level_nodes
    trees = {}
    for name, loop_nodes in [("one loop", lambda max_depth, platform: 2 ** (max_depth - 1)),
                             ("two loops", lambda max_depth, platform: min(grower.LOOPED_LEVEL_NODES,
                                                                           2 ** (max_depth - 1)))]:
        monkeypatch.setattr(grower, "looped_level_nodes", loop_nodes)
        boosting.clear_compiled_rounds()
        try:
            trees[name] = jb.train(X, y, **settings).trees
        finally:
            boosting.clear_compiled_rounds()
    monkeypatch.setattr(grower, "looped_level_nodes", one_loop)
    assert one_loop(settings["max_depth"], "cpu") == 2 ** (settings["max_depth"] - 1)
    assert one_loop(settings["max_depth"], "gpu") == grower.LOOPED_LEVEL_NODES
    assert_same_trees(trees["one loop"], trees["two loops"])
    # The levels past the first loop's 32 slots split.
    from jaxboost.node_list import reached_nodes
    is_leaf = np.asarray(trees["one loop"].is_leaf)
    splits = ~is_leaf & reached_nodes(is_leaf)
    assert np.sum(splits[..., 2 ** 6 - 1:]) > 10


@needs_native
@pytest.mark.parametrize("settings,sharded", [
    ({"loss": "logistic", "num_rounds": 6, "max_depth": 4, "learning_rate": 0.3, "colsample_bytree": 0.5}, False),
    ({"loss": "logistic", "num_rounds": 4, "max_depth": 9, "learning_rate": 0.3, "max_bin": 256,
      "colsample_bytree": 0.7, "colsample_bylevel": 0.8}, False),  # the deep levels' loop
    ({"loss": "softmax", "num_rounds": 2, "max_depth": 4, "learning_rate": 0.3, "colsample_bytree": 0.5,
      "multi_strategy": "multi_output_tree"}, False),  # the channel kernel
    ({"loss": "logistic", "num_rounds": 4, "max_depth": 5, "learning_rate": 0.3, "colsample_bytree": 0.5}, True),
    ({"loss": "logistic", "num_rounds": 4, "max_depth": 5, "learning_rate": 0.3, "colsample_bytree": 0.7,
      "colsample_bynode": 0.8, "monotone_constraints": [1, 0, 0, 0, 0, 0, 0, 0, 0, -1, 0],
      "interaction_constraints": [[0, 1, 2, 3, 4, 5], [1, 6, 7, 8, 9, 10]],
      "split_cost": [0.0] * 10 + [0.5]}, True),  # per-feature settings in the slots of 7 features (4 a device)
])
def test_a_trees_column_sample_grows_the_same_trees_when_only_its_features_are_summed(monkeypatch, settings,
                                                                                      sharded):
    """The native kernels sum only the features of a tree's column sample, into compact
    histograms (its features' cells only, ``grower.tree_feature_slots``) that the sums over
    devices, the subtraction and the split scan read; the trees are those grown from
    histograms of every feature, bit for bit (the levels' and nodes' samples draw from the
    tree's; the root's totals come from its first sampled feature either way), on one device
    and with rows sharded over two, with constraints and per-feature split costs."""
    import jaxboost as jb
    from jaxboost import boosting, grower, training

    settings = dict(settings)
    if "split_cost" in settings:
        settings["regularizer"] = jb.regularizers.l2(1.0, split_cost=settings.pop("split_cost"))

    if sharded:
        if len(jax.devices()) < 2:
            pytest.skip("needs two CPU devices")
        shard_training_rows(monkeypatch)
    X, y = kernel_training_data(settings)
    X = np.column_stack([X, np.random.default_rng(12).normal(size=(len(X), 5)).astype(np.float32)])
    boosting.clear_compiled_rounds()
    summed_sample = jb.train(X, y, **settings)
    for name in ("build_statistics_histogram", "route_and_build_statistics_histogram"):
        def every_feature(*args, _build=getattr(grower, name), **kwargs):
            assert kwargs.pop("features_used") is not None
            return _build(*args, **kwargs)
        monkeypatch.setattr(grower, name, every_feature)
    monkeypatch.setattr(training, "tree_feature_slots", lambda fraction, n_features: None)
    boosting.clear_compiled_rounds()
    try:
        summed_all = jb.train(X, y, **settings)
    finally:
        boosting.clear_compiled_rounds()
    assert_same_trees(summed_sample.trees, summed_all.trees)
    # Not every feature was sampled for every tree, and the trees split.
    assert np.sum(~summed_sample.trees.is_leaf) > 4 * settings["num_rounds"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compares the CPU's XLA kernel with the GPU's, on CPU")
@pytest.mark.parametrize("settings", [
    {"loss": "logistic", "num_rounds": 8, "max_depth": 4, "learning_rate": 0.3, "max_bin": 64},
    {"loss": "logistic", "num_rounds": 3, "max_depth": 9, "learning_rate": 0.3, "max_bin": 256,
     "monotone_constraints": [1, 0, 0, 0, 0, 0]},
    {"loss": "softmax", "num_rounds": 4, "max_depth": 6, "learning_rate": 0.3, "max_bin": 64,
     "multi_strategy": "multi_output_tree"},
    {"loss": "logistic", "num_rounds": 6, "max_depth": 5, "learning_rate": 0.3, "max_bin": 256,
     "colsample_bytree": 0.5},
], ids=["logistic-depth4", "logistic-monotone-depth9", "softmax-vector-depth6", "logistic-column-sample"])
def test_training_with_the_accelerators_kernel_matches_the_cpus_xla_kernel(monkeypatch, settings):
    """The float32-pair scatter that GPUs and TPUs run, here on CPU in place of the complex one."""
    from jaxboost import histogram

    X, y = kernel_training_data(settings)
    with_complex = train_with_kernel(monkeypatch, X, y, settings, "xla")
    monkeypatch.setattr(histogram, "_complex_scatter_histogram", histogram._pair_scatter_histogram)
    with_pairs = train_with_kernel(monkeypatch, X, y, settings, "xla")
    if settings["loss"] == "logistic":
        # A tie at depth 9 may go the other way: the pair kernel folds its copies in another
        # order, and the first tree's node 100 has two splits of the same loss change (0.0279)
        # to float32's last bit; the later trees then differ (40 rows of 3000 in other leaves,
        # the log loss 0.39210 against 0.39206: measured).
        assert_same_models(with_pairs, with_complex, X, settings, agreeing_predictions=0.98)
        log_loss = [-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
                    for p in (with_pairs.predict(X), with_complex.predict(X))]
        np.testing.assert_allclose(log_loss[0], log_loss[1], rtol=1e-3)
        return
    # Full-Hessian vector leaves are a chain of near ties: 1e-7 relative noise on the complex
    # kernel's histograms moves 8% of these splits and the log loss by up to 0.2% (measured), and
    # the two kernels round differently (0.5% apart). Their fits agree.
    log_loss = [-np.mean(np.log(model.predict(X)[np.arange(len(y)), y.astype(int)]))
                for model in (with_pairs, with_complex)]
    np.testing.assert_allclose(log_loss[0], log_loss[1], rtol=1e-2)
    assert log_loss[0] < 0.8 * np.log(3), f"log loss {log_loss[0]:.4f}: the model barely fits"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compares the CPU's level steps with the GPU's, on CPU")
@pytest.mark.parametrize("settings", GROWTH_CASES)
def test_levels_split_at_once_as_on_an_accelerator_grow_the_cpus_trees(monkeypatch, settings):
    """Off the CPU a level's split scan and sibling subtraction run in one masked step rather
    than in steps over the live nodes (``devices.in_steps_on_cpu``); here on CPU, with the same
    XLA histograms, both grow the same trees."""
    from jaxboost import grower, split

    X, y = kernel_training_data(settings)
    in_steps = train_with_kernel(monkeypatch, X, y, settings, "xla")
    for module in (grower, split):
        monkeypatch.setattr(module, "in_steps_on_cpu", lambda in_steps, all_at_once: all_at_once())
    at_once = train_with_kernel(monkeypatch, X, y, settings, "xla")  # undoes the patches when done
    assert_same_models(at_once, in_steps, X, settings)


@pytest.mark.parametrize("num_nodes,live_nodes,max_bin,n_features,features_per_scatter", [
    (1, 1, 256, 3, None),     # the root: 256 copies
    (32, 5, 16, 4, None),     # 5 live nodes of 32 slots: 51 copies each, one slot left over
    (32, 32, 32, 3, None),    # every slot live: 8 copies each
    (300, 299, 4, 2, None),   # more nodes than the default slots: one copy each
    (3, 2, 7, 5, 2),          # features in groups of 2, the last padded
])
@pytest.mark.parametrize("with_mask", [False, True])
def test_pair_scatter_histogram_matches_numpy(num_nodes, live_nodes, max_bin, n_features, features_per_scatter,
                                              with_mask):
    """The accelerators' scatter shares its node slots out among the live nodes (those below the
    highest node index summed) and folds the copies back; rows of nodes outside [0, num_nodes)
    are dropped like masked rows."""
    from jaxboost.histogram import _pair_scatter_histogram, scatter_slots

    X_binned, node_index, gradients, hessians, row_mask = histogram_case(5, 3001, n_features, num_nodes, max_bin)
    node_index = node_index % live_nodes
    node_index[::97] = -1
    node_index[1::101] = num_nodes + 3
    mask = row_mask if with_mask else np.ones(len(node_index), bool)
    mask = mask & (node_index >= 0) & (node_index < num_nodes)
    expected = masked_naive_histogram(X_binned, np.clip(node_index, 0, num_nodes - 1), gradients, hessians, mask,
                                      num_nodes, max_bin)
    kernel = jax.jit(partial(_pair_scatter_histogram, num_nodes=num_nodes, max_bin=max_bin,
                             features_per_scatter=features_per_scatter))
    actual = kernel(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians),
                    jnp.asarray(row_mask if with_mask else np.zeros(0, bool)))
    assert actual.shape == expected.shape and actual.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)
    assert scatter_slots(num_nodes) == max(256, num_nodes)


def test_pair_scatter_histogram_under_vmap_shares_each_models_slots_by_its_own_live_nodes():
    """``train_many`` vmaps the kernel over models: each model's rows fill their own number of
    live nodes (here 2 and 7 of 8), so each shares the slots out its own way."""
    from jaxboost.histogram import _pair_scatter_histogram

    num_nodes, max_bin, n_features = 8, 16, 3
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(7, 2001, n_features, num_nodes, max_bin)
    node_indices = np.stack([node_index % 2, node_index % 7])
    gradient_sets = np.stack([gradients, -2.0 * gradients])
    kernel = jax.jit(jax.vmap(partial(_pair_scatter_histogram, num_nodes=num_nodes, max_bin=max_bin),
                              in_axes=(None, 0, 0, None, None)))
    actual = kernel(jnp.asarray(X_binned.T), jnp.asarray(node_indices), jnp.asarray(gradient_sets),
                    jnp.asarray(hessians), jnp.asarray(row_mask))
    for model in range(2):
        expected = masked_naive_histogram(X_binned, node_indices[model], gradient_sets[model], hessians, row_mask,
                                          num_nodes, max_bin)
        np.testing.assert_allclose(np.asarray(actual[model]), expected, rtol=1e-5, atol=1e-4)


def test_pair_scatter_histogram_keeps_its_slots_within_the_cell_bound(monkeypatch):
    """Wide data: the slots of all features would pass the bound on a scatter's cells, so the
    features go in groups (the last padded) that keep the slots, and the sums stay exact."""
    from jaxboost import histogram

    num_nodes, max_bin, n_features = 3, 7, 5
    slots = histogram.scatter_slots(num_nodes)
    monkeypatch.setattr(histogram, "_MAX_SCATTER_CELLS", 2 * slots * max_bin + 1)
    assert histogram.scatter_layout(n_features, 3001, num_nodes, max_bin) == (256, 2)
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(6, 3001, n_features, num_nodes, max_bin)
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask, num_nodes, max_bin)
    kernel = jax.jit(partial(histogram._pair_scatter_histogram, num_nodes=num_nodes, max_bin=max_bin))
    actual = kernel(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians),
                    jnp.asarray(row_mask))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------------------------
# route_and_build_histogram: row routing fused with the smaller children's histograms
# --------------------------------------------------------------------------------------------

def route_case(seed, n_rows, n_features, num_nodes, max_bin):
    X_binned, node_index, gradients, hessians, _ = histogram_case(seed, n_rows, n_features, num_nodes, max_bin)
    rng = np.random.default_rng(seed + 100)
    level = {
        "split_feature": rng.integers(0, n_features, num_nodes).astype(np.int32),
        "split_threshold_bin": rng.integers(0, max_bin - 1, num_nodes).astype(np.int32),
        "split_default_left": rng.uniform(size=num_nodes) < 0.5,
        "splits": rng.uniform(size=num_nodes) < 0.75,
        "left_is_smaller": rng.uniform(size=num_nodes) < 0.5,
    }
    level["splits"][0] = True  # a level of one node splits too
    return X_binned, node_index, gradients, hessians, level


@pytest.mark.parametrize("kernel,max_bin,threads,feature_major,channels,by_pairs,first_columns", [
    pytest.param("native", 256, 1, False, 6, False, None, marks=needs_native),
    pytest.param("native", 256, 2, True, 5, False, None, marks=needs_native),  # odd: a zero channel pads the last pair
    pytest.param("native", 64, 1, True, 6, False, None, marks=needs_native),   # fewer bins: the scratch buffer's copy
    pytest.param("native", 64, 2, True, 5, True, None, marks=needs_native),    # the pair kernel, a pair per call
    pytest.param("native", 256, 1, False, 6, True, None, marks=needs_native),
    # Two blocks of columns: the channel kernel's channels from the first block and the second,
    # or (one column first) from the second alone, past its first column.
    pytest.param("native", 256, 2, False, 7, False, 3, marks=needs_native),
    pytest.param("native", 64, 1, True, 5, False, 1, marks=needs_native),
    # 35 channels past the route kernel's pair: whole vectors of 16, then a part of one.
    pytest.param("native", 256, 2, False, 37, False, 10, marks=needs_native),
    ("xla", 64, 1, False, 5, False, None),
    ("xla", 64, 1, False, 5, False, 1)])
def test_histograms_of_many_channels_are_built_into_one_buffer(monkeypatch, kernel, max_bin, threads, feature_major,
                                                               channels, by_pairs, first_columns):
    """Vector leaves' histograms, the root's, a masked build's and a routed level's smaller
    children, hold every channel's sums, laid out node- or feature-major and padded with zero
    features: built by the native kernel of many channels (after the route kernel's first pair)
    or a pair at a time (XLA, or ``by_pairs``: statistics given as column pairs only, for the
    native pair kernel), from one array of statistics or (``first_columns``) two blocks of
    columns, as vector leaves give them (gradients, then Hessians). Built in a loop, whose
    buffers hold the last step's sums, so each step must start its cells at zero."""
    from jaxboost import histogram
    from jaxboost.histogram import (StatisticPairs, build_statistics_histogram, route_and_build_statistics_histogram,
                                    statistic_pairs)

    for name in ("build_histogram", "route_and_build_histogram", "build_channels_histogram"):
        monkeypatch.setattr(histogram, name, partial(getattr(histogram, name), kernel=kernel))
    n_rows, n_features, result_features, num_nodes = 40_000, 9, 12, 5  # two row blocks
    X_binned, node_index, _, _, level = route_case(31, n_rows, n_features, num_nodes, max_bin)
    rng = np.random.default_rng(32)
    statistics = rng.normal(size=(n_rows, channels)).astype(np.float32)
    row_mask = rng.uniform(size=n_rows) < 0.6
    options = dict(max_bin=max_bin, threads=threads, feature_major=feature_major, result_features=result_features)
    X_T, nodes, mask = jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(row_mask)
    split_level = [jnp.asarray(level[k]) for k in ("split_feature", "split_threshold_bin", "split_default_left",
                                                   "splits", "left_is_smaller")]
    scales = np.array([1.0, -2.0], np.float32)

    @jax.jit
    def every_step(stats):
        def step(i, results):
            scaled = stats * jnp.asarray(scales)[i]
            scaled = statistic_pairs(scaled if first_columns is None
                                     else (scaled[:, :first_columns], scaled[:, first_columns:]))
            if by_pairs:
                scaled = StatisticPairs(scaled.pairs, scaled.channels)
            root = build_statistics_histogram(X_T, jnp.zeros_like(nodes), scaled, 1, **options)
            masked = build_statistics_histogram(X_T, nodes, scaled, num_nodes, row_mask=mask, **options)
            child, smaller = route_and_build_statistics_histogram(X_T, nodes, scaled, *split_level, **options)
            return tuple(jax.lax.dynamic_update_index_in_dim(whole, part, i, 0)
                         for whole, part in zip(results, (root, masked, smaller, child)))

        results = tuple(jnp.full((len(scales), n, result_features, max_bin, channels), jnp.nan, jnp.float32)
                        for n in (1, num_nodes, num_nodes)) + (jnp.zeros((len(scales), n_rows), jnp.int32),)
        return jax.lax.fori_loop(0, len(scales), step, results)

    def naive(node_of_row, rows, nodes_summed, scale):
        out = np.zeros((nodes_summed, result_features, max_bin, channels))
        for f in range(n_features):
            np.add.at(out, (node_of_row[rows], f, X_binned[rows, f].astype(int)), scale * statistics[rows])
        return out

    roots, masked, smaller, children = every_step(jnp.asarray(statistics))
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    for i, scale in enumerate(scales):
        np.testing.assert_allclose(roots[i], naive(np.zeros_like(node_index), np.ones(n_rows, bool), 1, scale),
                                   rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(masked[i], naive(node_index, row_mask, num_nodes, scale), rtol=1e-5, atol=1e-3)
        np.testing.assert_array_equal(np.asarray(children[i]), expected_child)
        assert_split_nodes_close(smaller[i], naive(node_index, in_smaller, num_nodes, scale), level["splits"], kernel,
                                 rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("feature_major", [False, True])
def test_pairs_built_apart_on_a_cpu_are_the_pairs_built_into_shared_cells_elsewhere(feature_major):
    """Narrow cells built a pair at a time: on a CPU each pair in cells of its own, joined after
    (the route's first pair too); lowered for an accelerator, each pair into the cells of every
    channel. The same sums, for the root, a masked build and a routed level's smaller children,
    laid out node- or feature-major, an odd number of channels padded."""
    from jaxboost.histogram import build_statistics_histogram, route_and_build_statistics_histogram, statistic_pairs

    n_rows, n_features, num_nodes, channels = 3000, 5, 4, 5
    X_binned, node_index, _, _, level = route_case(43, n_rows, n_features, num_nodes, 64)
    statistics = jnp.asarray(np.random.default_rng(44).normal(size=(n_rows, channels)), jnp.float32)
    row_mask = jnp.asarray(np.random.default_rng(45).uniform(size=n_rows) < 0.6)
    options = dict(max_bin=64, feature_major=feature_major, result_features=6, keep_padding=True)
    X_T, nodes = jnp.asarray(X_binned.T), jnp.asarray(node_index)
    split_level = [jnp.asarray(level[k]) for k in ("split_feature", "split_threshold_bin", "split_default_left",
                                                   "splits", "left_is_smaller")]

    def histograms(X_T, nodes, statistics, row_mask, *split_level):
        statistics = statistic_pairs(statistics)
        return (build_statistics_histogram(X_T, jnp.zeros_like(nodes), statistics, 1, **options),
                build_statistics_histogram(X_T, nodes, statistics, num_nodes, row_mask=row_mask, **options),
                route_and_build_statistics_histogram(X_T, nodes, statistics, *split_level, **options)[1])

    arguments = (X_T, nodes, statistics, row_mask, *split_level)
    # A program of its own for each (a jitted function's trace is cached whatever is lowered for).
    with native.lowering_for("cpu"):
        apart = jax.jit(lambda *a: histograms(*a))(*arguments)
    with native.lowering_for("gpu"):
        shared = jax.jit(lambda *a: histograms(*a))(*arguments)
    splits = np.asarray(level["splits"])
    for on_cpu, elsewhere in zip(apart[:2], shared[:2]):
        assert on_cpu.shape == elsewhere.shape and on_cpu.shape[-1] == channels + 1
        np.testing.assert_allclose(on_cpu, elsewhere, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(apart[2])[splits], np.asarray(shared[2])[splits], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(apart[1])[..., -1] == 0)  # the padding channel


@needs_native
@pytest.mark.parametrize("max_bin,threads,feature_major,channels", [
    (256, 1, False, 2), (256, 2, True, 2), (64, 1, True, 2),  # 64 bins: the scratch buffer's copy
    (256, 1, False, 5), (64, 2, True, 6)])                   # many channels: the channel kernel
def test_native_kernels_sum_only_the_features_used(max_bin, threads, feature_major, channels):
    """With ``features_used`` (a tree's column sample) the native kernels sum those features
    only, four listed features a pass, and leave every other feature's cells zero, also in a
    buffer that held all features' sums the step before (a loop's), and in the root's pass,
    a masked build and a routed level's smaller children."""
    from jaxboost.histogram import build_statistics_histogram, route_and_build_statistics_histogram, statistic_pairs

    n_rows, n_features, result_features, num_nodes = 40_000, 11, 12, 5  # two row blocks
    X_binned, node_index, _, _, level = route_case(41, n_rows, n_features, num_nodes, max_bin)
    rng = np.random.default_rng(42)
    statistics = rng.normal(size=(n_rows, channels)).astype(np.float32)
    row_mask = rng.uniform(size=n_rows) < 0.6
    used = np.zeros(n_features, bool)
    used[[0, 2, 3, 5, 6, 7, 8, 9, 10]] = True  # two listed groups of four (with gaps), then one more
    every = np.ones(n_features, bool)
    options = dict(max_bin=max_bin, threads=threads, feature_major=feature_major, result_features=result_features)
    X_T, nodes, mask = jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(row_mask)
    split_level = [jnp.asarray(level[k]) for k in ("split_feature", "split_threshold_bin", "split_default_left",
                                                   "splits", "left_is_smaller")]
    flags = jnp.asarray(np.stack([every, used]))

    @jax.jit
    def every_step(stats):
        def step(i, results):
            pairs = statistic_pairs(stats)
            root = build_statistics_histogram(X_T, jnp.zeros_like(nodes), pairs, 1, features_used=flags[i], **options)
            masked = build_statistics_histogram(X_T, nodes, pairs, num_nodes, row_mask=mask, features_used=flags[i],
                                                **options)
            _, smaller = route_and_build_statistics_histogram(X_T, nodes, pairs, *split_level, features_used=flags[i],
                                                              **options)
            return tuple(jax.lax.dynamic_update_index_in_dim(whole, part, i, 0)
                         for whole, part in zip(results, (root, masked, smaller)))

        results = tuple(jnp.full((2, n, result_features, max_bin, channels), jnp.nan, jnp.float32)
                        for n in (1, num_nodes, num_nodes))
        return jax.lax.fori_loop(0, 2, step, results)

    def naive(node_of_row, rows, nodes_summed, features):
        out = np.zeros((nodes_summed, result_features, max_bin, channels))
        for f in np.flatnonzero(features):
            np.add.at(out, (node_of_row[rows], f, X_binned[rows, f].astype(int)), statistics[rows])
        return out

    roots, masked, smaller = (np.asarray(result) for result in every_step(jnp.asarray(statistics)))
    _, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    splits = level["splits"]
    for i, features in enumerate((every, used)):
        np.testing.assert_allclose(roots[i], naive(np.zeros_like(node_index), np.ones(n_rows, bool), 1, features),
                                   rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(masked[i], naive(node_index, row_mask, num_nodes, features), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(smaller[i][splits], naive(node_index, in_smaller, num_nodes, features)[splits],
                                   rtol=1e-5, atol=1e-3)
    # The unused features' cells are zero, not the first step's sums.
    assert np.abs(roots[0][:, :n_features][:, ~used]).sum() > 0
    for result in (roots[1], masked[1], smaller[1][splits]):
        np.testing.assert_array_equal(result[:, :n_features][:, ~used], 0.0)


@pytest.mark.parametrize("kernel,max_bin,threads,feature_major,row_ranges", [
    ("native", 256, 1, False, 1), ("native", 256, 2, True, 1), ("native", 64, 2, False, 1),  # 64 bins: the scratch copy
    ("native", 256, 1, False, 2), ("native", 64, 1, False, 2), ("xla", 256, 1, False, 1)])
def test_compact_histograms_hold_the_features_used_in_feature_order(kernel, max_bin, threads, feature_major,
                                                                    row_ranges):
    """With fewer feature slots (``result_features``) than features, the kernels write the
    features of ``features_used`` into the first slots, in feature order, and zeros past them
    (a tree's column sample): the root's pass, a masked build, a routed level's smaller
    children and the channel kernel's cells, against NumPy sums of every feature; with the
    rows summed in ranges too (the channel kernel takes none)."""
    from jaxboost.histogram import build_channels_histogram, statistic_pairs
    if kernel == "native" and not (NATIVE_AVAILABLE and jax.default_backend() == "cpu"):
        pytest.skip("native kernel not built here, or JAX's default backend is not the CPU")
    n_rows, n_features, slots, num_nodes = 40_000, 11, 8, 5  # two row blocks
    X_binned, node_index, gradients, hessians, level = route_case(43, n_rows, n_features, num_nodes, max_bin)
    used = np.zeros(n_features, bool)
    used[[1, 2, 4, 5, 6, 9, 10]] = True  # a listed group of four with gaps, then three more; one slot to spare
    rng = np.random.default_rng(44)
    row_mask = rng.uniform(size=n_rows) < 0.6
    statistics = rng.normal(size=(n_rows, 6)).astype(np.float32)
    X_T, nodes, flags = jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(used)
    options = dict(kernel=kernel, threads=threads, feature_major=feature_major, result_features=slots,
                   features_used=flags)
    split_level = [jnp.asarray(level[k]) for k in ("split_feature", "split_threshold_bin", "split_default_left",
                                                   "splits", "left_is_smaller")]
    g, h = jnp.asarray(gradients), jnp.asarray(hessians)
    root = jax.jit(lambda: build_histogram(X_T, jnp.zeros_like(nodes), g, h, 1, max_bin, row_ranges=row_ranges,
                                           **options))()
    masked = jax.jit(lambda: build_histogram(X_T, nodes, g, h, num_nodes, max_bin, jnp.asarray(row_mask),
                                             row_ranges=row_ranges, **options))()
    _, smaller = jax.jit(lambda: route_and_build_histogram(X_T, nodes, g, h, *split_level, max_bin,
                                                           row_ranges=row_ranges, **options))()
    channels = jax.jit(lambda: build_channels_histogram(X_T, nodes, statistic_pairs(jnp.asarray(statistics)),
                                                        num_nodes, max_bin, jnp.asarray(row_mask), **options))()

    def compact(node_of_row, rows, nodes_summed, values):
        full = np.zeros((nodes_summed, n_features, max_bin, values.shape[1]))
        for f in range(n_features):
            np.add.at(full, (node_of_row[rows], f, X_binned[rows, f].astype(int)), values[rows])
        return np.concatenate([full[:, used], np.zeros((nodes_summed, slots - used.sum()) + full.shape[2:])], axis=1)

    pairs = np.stack([gradients, hessians], axis=1)
    every_row = np.ones(n_rows, bool)
    _, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    np.testing.assert_allclose(root, compact(np.zeros_like(node_index), every_row, 1, pairs), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(masked, compact(node_index, row_mask, num_nodes, pairs), rtol=1e-5, atol=1e-3)
    assert_split_nodes_close(smaller, compact(node_index, in_smaller, num_nodes, pairs), level["splits"], kernel,
                             rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(channels, compact(node_index, row_mask, num_nodes, statistics), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="needs features_used"):
        build_histogram(X_T, nodes, g, h, num_nodes, max_bin, kernel=kernel, result_features=slots)


@pytest.mark.skipif(not (NATIVE_AVAILABLE and jax.default_backend() == "cpu"),
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
@pytest.mark.parametrize("channels, num_nodes, narrow",
                         [(5, 1, True), (6, 1, True), (8, 1, True), (20, 1, False), (6, 4, True), (8, 4, False)])
def test_narrow_cells_channels_take_the_pair_kernel(channels, num_nodes, narrow):
    """A root's histogram (one node) of at most ``ROOT_PAIR_PASSES_MAX_WIDTH`` (8) channels, and
    several nodes' of at most ``CHILDREN_PAIR_PASSES_MAX_WIDTH`` (6), is built a pair of channels
    per pass of the pair kernel on CPU, wider ones by the channel kernel: the same sums bit for
    bit as the channel kernel's, rows in the same order (a row mask, a column sample, two
    threads), and NumPy's."""
    from jaxboost.histogram import CHANNEL_HISTOGRAM_TARGET, build_channels_histogram, statistic_pairs
    n_rows, n_features, max_bin = 9_000, 7, 256
    rng = np.random.default_rng(channels)
    X_binned = rng.integers(0, max_bin, (n_rows, n_features)).astype(np.uint8)
    statistics = rng.normal(size=(n_rows, channels)).astype(np.float32)
    row_mask = rng.uniform(size=n_rows) < 0.7
    used = np.ones(n_features, bool)
    used[3] = False
    node_of_row = rng.integers(0, num_nodes, n_rows)
    X_T, nodes = jnp.asarray(X_binned.T), jnp.asarray(node_of_row, jnp.int32)

    def build(kernel):
        return jax.jit(lambda s, m: build_channels_histogram(
            X_T, nodes, statistic_pairs(s), num_nodes, max_bin, m, kernel=kernel, threads=2, feature_major=True,
            features_used=jnp.asarray(used)))

    arguments = (jnp.asarray(statistics), jnp.asarray(row_mask))
    lowered = build("auto").lower(*arguments).as_text()
    assert (re.search(rf"@{HISTOGRAM_TARGET}\b", lowered) is not None) == narrow
    assert (re.search(rf"@{CHANNEL_HISTOGRAM_TARGET}\b", lowered) is not None) != narrow
    automatic, channel_kernel = (np.asarray(build(kernel)(*arguments)) for kernel in ("auto", "native"))
    np.testing.assert_array_equal(automatic, channel_kernel)
    expected = np.zeros((num_nodes, n_features, max_bin, channels))
    for f in np.flatnonzero(used):
        np.add.at(expected, (node_of_row[row_mask], f, X_binned[row_mask, f].astype(int)), statistics[row_mask])
    np.testing.assert_allclose(automatic[..., :channels], expected, rtol=1e-5, atol=1e-4)


def assert_split_nodes_close(actual, expected, splits, kernel, **tolerances):
    """A routed level's smaller-child histograms: the cells of the nodes that split equal the
    expected sums; the XLA kernel zeroes every other node's cells, the native kernel leaves them
    unwritten (a deep level's slots mostly hold no split), so only the XLA kernel's are checked."""
    actual, splits = np.asarray(actual), np.asarray(splits, bool)
    assert splits.any() and actual.shape == expected.shape
    np.testing.assert_allclose(actual[splits], expected[splits], **tolerances)
    if kernel == "xla":
        np.testing.assert_array_equal(actual[~splits], 0.0)


def naive_route(X_binned, node_index, level, max_bin):
    code = X_binned[np.arange(len(node_index)), level["split_feature"][node_index]]
    goes_right = np.where(code == max_bin - 1, ~level["split_default_left"][node_index],
                          code > level["split_threshold_bin"][node_index])
    in_smaller = level["splits"][node_index] & (goes_right != level["left_is_smaller"][node_index])
    return 2 * node_index + goes_right.astype(np.int32), in_smaller


@pytest.mark.parametrize("kernel,threads", [("xla", 1), pytest.param("native", 1, marks=needs_native),
                                            pytest.param("native", 2, marks=needs_native)])
@pytest.mark.parametrize("num_nodes,max_bin", [(1, 256), (6, 32)])
def test_route_and_build_histogram_matches_numpy(kernel, threads, num_nodes, max_bin):
    X_binned, node_index, gradients, hessians, level = route_case(9, 5000, 5, num_nodes, max_bin)
    X_binned[::7, 2] = max_bin - 1  # missing codes follow the default direction
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller, num_nodes, max_bin)
    route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, kernel=kernel, threads=threads))
    child, smaller = route(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients),
                           jnp.asarray(hessians), **{k: jnp.asarray(v) for k, v in level.items()})
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    assert_split_nodes_close(smaller, expected, level["splits"], kernel, rtol=1e-5, atol=1e-4)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return " avx2" in info.read()
    except OSError:
        return False


@needs_native
@pytest.mark.skipif(not _cpu_has_avx2(), reason="rows are routed by node passes only on a CPU with AVX2 or AVX-512; "
                    "elsewhere the route tests above check the one-row-at-a-time routing against NumPy")
@pytest.mark.parametrize("num_nodes,histogram_nodes,threads", [(1, None, 1), (6, None, 1), (16, 5, 2), (40, None, 1)])
def test_routing_by_node_passes_matches_routing_a_row_at_a_time(monkeypatch, num_nodes, histogram_nodes, threads):
    """On AVX-512 (and AVX2), a level whose rows are in its first 16 nodes is routed sixteen (eight)
    rows at a time by a pass a node, and a block of rows in more than four nodes by gathers
    (JAXBOOST_ROUTE_SIMD unset, or =avx2; =passes and =avx2-passes: passes alone): the children
    and the smaller children's sums are those of routing one row at a time
    (JAXBOOST_ROUTE_SIMD=none), bit for bit, and NumPy's. The rows cover what the passes and gathers treat apart: nodes out of range
    (negative, and past the level's nodes), missing codes, rows of zero gradient and Hessian, a
    row count no multiple of 16, histograms of the first nodes only, two threads, and more
    selected rows than a gathered block holds (32768); with passes alone, 40 nodes route the
    blocks whose rows reach node 16 a row at a time, with gathers by gathers."""
    from jaxboost.histogram import route_and_build_histogram

    n_rows, max_bin = 80_003, 64
    X_binned, node_index, gradients, hessians, level = route_case(21, n_rows, 5, num_nodes, max_bin)
    rng = np.random.default_rng(22)
    X_binned[::7, 2] = max_bin - 1  # missing codes follow the default direction
    outside = rng.uniform(size=n_rows) < 0.01
    node_index = np.where(outside, rng.choice([-1, num_nodes, num_nodes + 3], n_rows), node_index).astype(np.int32)
    empty = rng.uniform(size=n_rows) < 0.05
    gradients, hessians = np.where(empty, 0.0, gradients).astype(np.float32), np.where(empty, 0.0, hessians).astype(np.float32)
    level["splits"][:] = True
    # A row of a node out of range reads node 0's split, and is summed in no child.
    in_range = (node_index >= 0) & (node_index < num_nodes)
    expected_child, in_smaller = naive_route(X_binned, np.where(in_range, node_index, 0), level, max_bin)
    expected_child += np.where(in_range, 0, 2 * node_index)
    summed = num_nodes if histogram_nodes is None else histogram_nodes
    in_smaller &= in_range & (node_index < summed)
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller, summed, max_bin)
    arguments = (jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    levels = {k: jnp.asarray(v) for k, v in level.items()}
    results = {}
    for choice in ("gathers", "passes", "avx2", "avx2-passes", "none"):
        if choice == "gathers":
            monkeypatch.delenv("JAXBOOST_ROUTE_SIMD", raising=False)
        else:
            monkeypatch.setenv("JAXBOOST_ROUTE_SIMD", choice)
        route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, kernel="native", threads=threads,
                                histogram_nodes=histogram_nodes))
        child, smaller = route(*arguments, **levels)
        results[choice] = (np.asarray(child), np.asarray(smaller))
    np.testing.assert_array_equal(results["passes"][0], expected_child)
    for choice in ("gathers", "passes", "avx2", "avx2-passes"):
        np.testing.assert_array_equal(results[choice][0], results["none"][0], err_msg=choice)
        np.testing.assert_array_equal(results[choice][1], results["none"][1], err_msg=choice)
    np.testing.assert_allclose(results["passes"][1][:summed], expected[:summed], rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.skipif(not _cpu_has_avx2(), reason="rows are routed by gathers only on a CPU with AVX2 or AVX-512; "
                    "elsewhere the route tests above check the other routings against NumPy")
@pytest.mark.parametrize("num_nodes,n_features,route_only", [(24, 20, False), (40, 20, False), (64, 20, True),
                                                             (40, 5, True), (6, 20, True)])
def test_routing_by_gathers_reads_a_shared_table_as_a_row_at_a_time_does(monkeypatch, num_nodes, n_features,
                                                                         route_only):
    """Routing by gathers reads each row's code as the aligned 32-bit word that holds it: from a
    code table shared with other rows (the local rows from column 3 on, so the words start
    before a row's code), the children and the smaller children's sums are those of routing a
    row at a time, bit for bit, and the children NumPy's. Levels of more than 32 nodes that read
    16 columns or more route a row at a time with their prefetch, other levels by gathers; the
    last level's routing alone (no node splits) goes by gathers whatever its nodes, its columns
    prefetched when there are 16 or more."""
    from jaxboost.histogram import route_and_build_histogram

    n_rows, max_bin, offset = 20_011, 64, 3
    X_binned, node_index, gradients, hessians, level = route_case(23, n_rows, n_features, num_nodes, max_bin)
    X_binned[::5, 1] = max_bin - 1  # missing codes follow the default direction
    level["splits"][:] = not route_only
    table = np.random.default_rng(24).integers(0, max_bin, size=(n_features, offset + n_rows + 5)).astype(np.uint8)
    table[:, offset:offset + n_rows] = X_binned.T
    expected_child, _ = naive_route(X_binned, node_index, level, max_bin)
    arguments = (jnp.asarray(table), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    levels = {k: jnp.asarray(v) for k, v in level.items()}
    results = {}
    for choice in ("gathers", "avx2", "none"):
        if choice == "gathers":
            monkeypatch.delenv("JAXBOOST_ROUTE_SIMD", raising=False)
        else:
            monkeypatch.setenv("JAXBOOST_ROUTE_SIMD", choice)
        route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, kernel="native",
                                row_offset=jnp.int32(offset)))
        child, smaller = route(*arguments, **levels)
        results[choice] = (np.asarray(child), np.asarray(smaller))
    for choice in ("gathers", "avx2", "none"):
        np.testing.assert_array_equal(results[choice][0], expected_child, err_msg=choice)
    if not route_only:
        for choice in ("gathers", "avx2"):
            np.testing.assert_array_equal(results[choice][1], results["none"][1], err_msg=choice)


@needs_native
@pytest.mark.parametrize("max_bin,offset", [(256, 0), (64, 3)])
@pytest.mark.parametrize("ranges", [2, 3])
def test_kernels_that_sum_rows_in_ranges_match_numpy(max_bin, offset, ranges):
    """With ``row_ranges``, the native kernels sum a call's rows in ranges (each of at least
    16384 rows, and 1024 a node whose cells the call writes), each range into cells of its own
    on XLA's CPU threads, then add them up range by range. A tree's root, a masked histogram of
    several nodes, and a routed level (its children and its smaller children's sums) are NumPy's,
    read from a code table shared with other rows (the local rows from column ``offset`` on),
    with missing codes, rows of zero gradient and Hessian, fewer than 256 bins (a scratch
    buffer's cells) and a row count no multiple of 64; routing alone (no node splits) too. The
    ranges are summed apart (some cell differs in its last bits from the sum in one pass), and
    two calls give the same sums bit for bit."""
    from jaxboost.histogram import route_and_build_histogram

    n_rows, n_features, num_nodes = 50_003, 5, 6
    X_binned, node_index, gradients, hessians, level = route_case(31, n_rows, n_features, num_nodes, max_bin)
    rng = np.random.default_rng(32)
    X_binned[::7, 2] = max_bin - 1  # missing codes follow the default direction
    empty = rng.uniform(size=n_rows) < 0.1
    gradients = np.where(empty, 0.0, gradients).astype(np.float32)
    hessians = np.where(empty, 0.0, hessians).astype(np.float32)
    level["splits"][:] = True
    row_mask = rng.uniform(size=n_rows) < 0.6
    table = rng.integers(0, max_bin, size=(n_features, offset + n_rows + 5)).astype(np.uint8)
    table[:, offset:offset + n_rows] = X_binned.T
    codes, g, h = jnp.asarray(table), jnp.asarray(gradients), jnp.asarray(hessians)
    levels = {k: jnp.asarray(v) for k, v in level.items()}
    options = dict(kernel="native", row_offset=jnp.int32(offset))

    def histograms(row_ranges):
        root = jax.jit(partial(build_histogram, num_nodes=1, max_bin=max_bin, row_ranges=row_ranges, **options))
        masked = jax.jit(partial(build_histogram, num_nodes=num_nodes, max_bin=max_bin, row_ranges=row_ranges,
                                 **options))
        route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, row_ranges=row_ranges, **options))
        child, smaller = route(codes, jnp.asarray(node_index), g, h, **levels)
        route_only = route(codes, jnp.asarray(node_index), g, h, **levels | dict(splits=jnp.zeros(num_nodes, bool)))
        return (np.asarray(root(codes, jnp.zeros(n_rows, jnp.int32), g, h)),
                np.asarray(masked(codes, jnp.asarray(node_index), g, h, row_mask=jnp.asarray(row_mask))),
                np.asarray(child), np.asarray(smaller), np.asarray(route_only[0]))

    root, masked, child, smaller, routed_alone = histograms(ranges)
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    np.testing.assert_array_equal(child, expected_child)
    np.testing.assert_array_equal(routed_alone, expected_child)
    tolerances = dict(rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(root, masked_naive_histogram(X_binned, np.zeros(n_rows, np.int32), gradients,
                                                            hessians, None, 1, max_bin), **tolerances)
    np.testing.assert_allclose(masked, masked_naive_histogram(X_binned, node_index, gradients, hessians, row_mask,
                                                              num_nodes, max_bin), **tolerances)
    np.testing.assert_allclose(smaller, masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller,
                                                               num_nodes, max_bin), **tolerances)
    one_pass = histograms(1)
    for name, in_ranges, whole, again in zip(("root", "masked", "children", "smaller", "routed alone"),
                                             (root, masked, child, smaller, routed_alone), one_pass,
                                             histograms(ranges)):
        np.testing.assert_array_equal(again, in_ranges, err_msg=name)
        if name in ("children", "routed alone"):
            np.testing.assert_array_equal(whole, in_ranges, err_msg=name)
        else:
            assert not np.array_equal(whole, in_ranges), f"the {name} histogram was summed in one pass"


@pytest.mark.parametrize("histogram_nodes", [None, 3])
def test_route_to_children_routes_and_picks_the_smaller_childrens_rows(histogram_nodes):
    """The routing alone (a grower that builds the smaller children's histograms a few parents
    at a time): every row's child as NumPy routes it, and the rows in the smaller child of a
    node that splits, of the first ``histogram_nodes`` nodes."""
    from jaxboost.histogram import route_to_children, statistic_pairs

    num_nodes, max_bin = 6, 32
    X_binned, node_index, gradients, hessians, level = route_case(10, 5000, 5, num_nodes, max_bin)
    X_binned[::7, 2] = max_bin - 1  # missing codes follow the default direction
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    if histogram_nodes is not None:
        in_smaller &= node_index < histogram_nodes
    statistics = statistic_pairs(jnp.asarray(np.stack([gradients, hessians], axis=1)))
    route = jax.jit(partial(route_to_children, max_bin=max_bin, histogram_nodes=histogram_nodes))
    child, selected = route(jnp.asarray(X_binned.T), jnp.asarray(node_index), statistics,
                            **{k: jnp.asarray(v) for k, v in level.items()})
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    np.testing.assert_array_equal(np.asarray(selected), in_smaller)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("empty_fraction", [0.3, 0.7])
def test_native_kernels_skip_rows_of_zero_gradient_and_hessian_but_route_them(threads, empty_fraction):
    """Rows whose gradient and Hessian are both zero (out of a sample, weight 0, padding) add
    nothing: the native kernels leave them out (the root's pass stops after the last row that
    adds something, and gathers the others when about half the rows or more are empty) and the
    histograms still equal the naive sums over every row; such rows are still routed. Rows with
    only one of the two zero still count."""
    n_rows, n_features, num_nodes, max_bin = 70_000, 5, 6, 32  # more rows than a kernel block
    X_binned, node_index, gradients, hessians, level = route_case(3, n_rows, n_features, num_nodes, max_bin)
    rng = np.random.default_rng(4)
    zero = rng.uniform(size=n_rows) < empty_fraction
    zero[-5000:] = True  # a trailing run, as padding rows are
    gradients[zero], hessians[zero] = 0.0, 0.0
    hessians[-1] = 0.75  # the last row counts by its Hessian alone
    gradients[1::11] = 0.0  # zero gradient, positive Hessian: still counted
    hessians[2::13] = 0.0  # zero Hessian, nonzero gradient: still counted
    X_T, g, h = jnp.asarray(X_binned.T), jnp.asarray(gradients), jnp.asarray(hessians)

    root = jax.jit(partial(build_histogram, num_nodes=1, max_bin=max_bin, kernel="native", threads=threads))
    root_nodes = np.zeros(n_rows, np.int32)
    np.testing.assert_allclose(np.asarray(root(X_T, jnp.asarray(root_nodes), g, h)),
                               naive_histogram(X_binned, root_nodes, gradients.astype(np.float64),
                                               hessians.astype(np.float64), 1, max_bin), rtol=1e-5, atol=1e-3)

    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, kernel="native", threads=threads))
    child, smaller = route(X_T, jnp.asarray(node_index), g, h, **{k: jnp.asarray(v) for k, v in level.items()})
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    assert_split_nodes_close(smaller, masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller,
                                                             num_nodes, max_bin),
                             level["splits"], "native", rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_route_and_build_histogram_without_splits_only_routes(kernel):
    """A level whose children are leaves (the grower's looped last level) passes no splits:
    rows are still routed by every node's split fields; the XLA kernel's histogram is all
    zeros (the native kernel writes no cell: no node splits)."""
    X_binned, node_index, gradients, hessians, level = route_case(11, 3000, 5, 8, 32)
    X_binned[::5, 1] = 31
    expected_child, _ = naive_route(X_binned, node_index, level, 32)
    level["splits"] = np.zeros_like(level["splits"])
    route = jax.jit(partial(route_and_build_histogram, max_bin=32, kernel=kernel))
    child, smaller = route(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients),
                           jnp.asarray(hessians), **{k: jnp.asarray(v) for k, v in level.items()})
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    assert smaller.shape == (8, 5, 32, 2)
    if kernel == "xla":
        np.testing.assert_array_equal(np.asarray(smaller), np.zeros((8, 5, 32, 2), np.float32))


@pytest.mark.parametrize("kernel,threads", [("xla", 1), pytest.param("native", 1, marks=needs_native),
                                            pytest.param("native", 2, marks=needs_native)])
@pytest.mark.parametrize("max_bin", [256, 32])
def test_route_and_build_histogram_of_leading_nodes(kernel, threads, max_bin):
    """A level held in a wide buffer: every slot is routed, the histogram covers the first
    ``histogram_nodes`` slots, and with ``live_nodes`` the cells of the nodes holding rows are
    exact whatever the buffer held before. 200 nodes splitting on 24 features: a deep level's
    row reads spread over many code columns."""
    n_rows, n_features, num_nodes, histogram_nodes, live = 50_000, 24, 200, 100, 64
    X_binned, _, gradients, hessians, level = route_case(12, n_rows, n_features, num_nodes, max_bin)
    X_binned[::5, 1] = max_bin - 1
    rng = np.random.default_rng(13)
    node_index = rng.integers(0, live, n_rows).astype(np.int32)
    # A few rows in routed slots past the histogram's: routed, never summed.
    node_index[::97] = rng.integers(histogram_nodes, num_nodes, len(node_index[::97]))
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    in_smaller &= node_index < histogram_nodes
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller, histogram_nodes, max_bin)
    route = jax.jit(partial(route_and_build_histogram, max_bin=max_bin, kernel=kernel, threads=threads,
                            histogram_nodes=histogram_nodes))
    args = (jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    level = {k: jnp.asarray(v) for k, v in level.items()}
    child, smaller = route(*args, **level)
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    splits = np.asarray(level["splits"])
    assert_split_nodes_close(smaller, expected, splits[:histogram_nodes], kernel, rtol=1e-5, atol=1e-3)
    # live_nodes: the first `live` nodes exact (the XLA kernel also zeroes the rest).
    rows_live = node_index < live
    expected_child, in_smaller = naive_route(X_binned[rows_live], node_index[rows_live],
                                             {k: np.asarray(v) for k, v in level.items()}, max_bin)
    live_args = tuple(a[rows_live] if a.ndim == 1 else a[:, rows_live] for a in args)
    child, smaller = route(*live_args, **level, live_nodes=jnp.int32(live))
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    assert_split_nodes_close(np.asarray(smaller)[:live],
                             masked_naive_histogram(X_binned[rows_live], node_index[rows_live], gradients[rows_live],
                                                    hessians[rows_live], in_smaller, live, max_bin),
                             splits[:live], kernel, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="histogram_nodes must lie in"):
        route_and_build_histogram(*args, **level, max_bin=max_bin, histogram_nodes=num_nodes + 1)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_route_and_build_histogram_under_vmap_and_shard_map(kernel):
    from jax.sharding import Mesh, PartitionSpec

    X_binned, node_index, _, _, level = route_case(10, 2000, 3, 4, 16)
    rng = np.random.default_rng(10)
    gradients = rng.normal(size=(2, 2000)).astype(np.float32)
    hessians = rng.uniform(0.1, 1.0, size=(2, 2000)).astype(np.float32)
    expected_child, in_smaller = naive_route(X_binned, node_index, level, 16)
    splits = level["splits"]
    level = {k: jnp.asarray(v) for k, v in level.items()}

    def route(X_T, nodes, g, h):
        return route_and_build_histogram(X_T, nodes, g, h, **level, max_bin=16, kernel=kernel)

    # vmap over models (gradients), shared codes and nodes.
    children, smaller = jax.jit(jax.vmap(route, in_axes=(None, None, 0, 0)))(
        jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians))
    for model in range(2):
        np.testing.assert_array_equal(np.asarray(children[model]), expected_child)
        expected = masked_naive_histogram(X_binned, node_index, gradients[model], hessians[model], in_smaller, 4, 16)
        assert_split_nodes_close(smaller[model], expected, splits, kernel, rtol=1e-5, atol=1e-4)
    if len(jax.devices()) < 2:
        return
    mesh = Mesh(np.array(jax.devices()[:2]), ("rows",))
    rows = PartitionSpec("rows")

    def local(X_T, nodes, g, h):
        child, hist = route(X_T, nodes, g, h)
        return child, jax.lax.psum(hist, "rows")

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(None, "rows"), rows, rows, rows),
                                    out_specs=(rows, PartitionSpec())))
    child, smaller = sharded(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradients[0]),
                             jnp.asarray(hessians[0]))
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    expected = masked_naive_histogram(X_binned, node_index, gradients[0], hessians[0], in_smaller, 4, 16)
    assert_split_nodes_close(smaller, expected, splits, kernel, rtol=1e-5, atol=1e-4)


def test_route_and_build_histogram_rejects_mismatched_levels():
    X_T, nodes, g = jnp.zeros((2, 10), jnp.uint8), jnp.zeros(10, jnp.int32), jnp.ones(10)
    flags = jnp.ones(3, bool)
    with pytest.raises(ValueError, match="split_feature must have shape"):
        route_and_build_histogram(X_T, nodes, g, g, jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), flags, flags,
                                  flags, max_bin=4)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_cumulative_over_bins_matches_numpy(kernel):
    """Running sums over the bin axis, per channel, for histograms of any leading shape and
    under vmap (the split scan of several models at once)."""
    rng = np.random.default_rng(3)
    histograms = rng.normal(size=(2, 3, 4, 7, 3)).astype(np.float32)
    cumulative = jax.jit(partial(cumulative_over_bins, kernel=kernel))
    expected = np.cumsum(histograms.astype(np.float64), axis=-2)
    np.testing.assert_allclose(np.asarray(cumulative(jnp.asarray(histograms))), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cumulative(jnp.asarray(histograms[0, 0, 0]))), expected[0, 0, 0],
                               rtol=1e-5, atol=1e-5)
    batched = jax.vmap(jax.vmap(cumulative))(jnp.asarray(histograms))
    np.testing.assert_allclose(np.asarray(batched), expected, rtol=1e-5, atol=1e-5)
    # Many channels (full-Hessian vector leaves: 10 classes fill 65, padded to 66), 11 runs.
    wide = rng.normal(size=(11, 9, 66)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(cumulative(jnp.asarray(wide))), np.cumsum(wide.astype(np.float64), axis=-2),
                               rtol=1e-5, atol=1e-5)
    # Two channels (the scalar-leaf layout, summed eight runs at a time): 15 runs, not a multiple.
    pairs = rng.normal(size=(3, 5, 9, 2)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(cumulative(jnp.asarray(pairs))), np.cumsum(pairs.astype(np.float64), axis=-2),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bin and a channel axis"):
        cumulative_over_bins(jnp.zeros(5), kernel=kernel)


def _np_top_after(values, last_value, last_index, k):
    """NumPy's order of each row's values after (last value, last index): value descending,
    the lower index first; the others as -inf."""
    flat = values.reshape(-1, values.shape[-1])
    indices, tops = [], []
    for row, last, last_at in zip(flat, last_value.reshape(-1), last_index.reshape(-1)):
        position = np.arange(len(row))
        masked = np.where((row < last) | ((row == last) & (position > last_at)), row, -np.inf)
        order = np.lexsort((position, -masked))[:k]  # the last key sorts first
        indices.append(order)
        tops.append(masked[order])
    shape = values.shape[:-1] + (k,)
    return np.reshape(indices, shape), np.reshape(tops, shape)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_top_after_matches_numpy_order(kernel):
    """The k values after each row's last taken one, in lax.top_k's order (value descending,
    the lower index first): many ties, infinities, rows that start anew (last +inf) or continue
    after a tie, k of 1 and of every value, leading axes and vmap."""
    rng = np.random.default_rng(8)
    values = rng.integers(0, 6, size=(5, 50)).astype(np.float32)
    values[1, :10] = -np.inf
    values[2, 5] = np.inf
    values[3] = -np.inf
    last_value = np.array([np.inf, 3.0, 4.0, -np.inf, 2.0], np.float32)
    last_index = np.array([-1, 17, 30, 10, 49], np.int32)
    top = jax.jit(partial(top_after, kernel=kernel), static_argnums=3)
    for k in (1, 7, 32, 50):
        index, value = top(jnp.asarray(values), jnp.asarray(last_value), jnp.asarray(last_index), k)
        expected_index, expected_value = _np_top_after(values, last_value, last_index, k)
        np.testing.assert_array_equal(np.asarray(index), expected_index, err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(value), expected_value, err_msg=f"k={k}")
    stacked = np.stack([values, values[::-1]])  # (2, 5, 50): leading axes are rows
    lasts = np.stack([last_value, last_value[::-1]]), np.stack([last_index, last_index[::-1]])
    index, value = top(jnp.asarray(stacked), jnp.asarray(lasts[0]), jnp.asarray(lasts[1]), 9)
    np.testing.assert_array_equal(np.asarray(index), _np_top_after(stacked, *lasts, 9)[0])
    batched, _ = jax.vmap(lambda v, lv, li: top(v, lv, li, 9))(jnp.asarray(stacked), jnp.asarray(lasts[0]),
                                                                jnp.asarray(lasts[1]))
    np.testing.assert_array_equal(np.asarray(batched), _np_top_after(stacked, *lasts, 9)[0])
    with pytest.raises(ValueError, match="0 < k <= n"):
        top_after(jnp.asarray(values), jnp.asarray(last_value), jnp.asarray(last_index), 51, kernel=kernel)


@pytest.mark.parametrize("kernel", ["xla", pytest.param("native", marks=needs_native)])
def test_first_maximum_matches_numpy_argmax(kernel):
    """First index of each row's maximum (ties go to the lowest index, as in the split scan's
    tie rule), rows of -inf included, rows of several axes (the flat index in row-major order),
    and under vmap."""
    rng = np.random.default_rng(4)
    values = rng.integers(0, 5, size=(6, 40)).astype(np.float32)  # many ties
    values[2] = -np.inf
    values[3, :7] = -np.inf
    first = jax.jit(partial(first_maximum, kernel=kernel))
    index, maximum = first(jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(index), np.argmax(values, axis=1))
    np.testing.assert_array_equal(np.asarray(maximum), np.max(values, axis=1))
    # Lengths that leave a tail after the kernel's lanes, the maximum in it or tied across lanes.
    for n in (1, 7, 43):
        tail = rng.integers(0, 3, size=(5, n)).astype(np.float32)
        tail[0, -1] = 9.0
        index, maximum = first(jnp.asarray(tail))
        np.testing.assert_array_equal(np.asarray(index), np.argmax(tail, axis=1))
        np.testing.assert_array_equal(np.asarray(maximum), np.max(tail, axis=1))
    batched_index, _ = jax.vmap(first)(jnp.stack([jnp.asarray(values), jnp.asarray(values[::-1])]))
    np.testing.assert_array_equal(np.asarray(batched_index[1]), np.argmax(values[::-1], axis=1))
    # (rows, features, directions, bins), as the split scan passes its gains.
    gains = rng.integers(0, 4, size=(3, 5, 2, 7)).astype(np.float32)
    gains[1, :2] = -np.inf
    index, maximum = first(jnp.asarray(gains))
    np.testing.assert_array_equal(np.asarray(index), np.argmax(gains.reshape(3, -1), axis=1))
    np.testing.assert_array_equal(np.asarray(maximum), gains.reshape(3, -1).max(axis=1))
    batched_index, _ = jax.vmap(first)(jnp.stack([jnp.asarray(gains), jnp.asarray(gains[::-1])]))
    np.testing.assert_array_equal(np.asarray(batched_index[1]), np.argmax(gains[::-1].reshape(3, -1), axis=1))
    no_rows = first(jnp.zeros((0, 4, 5)))  # no rows: nothing to choose, not an error
    assert no_rows[0].shape == no_rows[1].shape == (0,)
    for empty in (jnp.zeros((3, 0)), jnp.zeros((3, 4, 0)), jnp.zeros((3,))):
        with pytest.raises(ValueError, match="non-empty row"):
            first_maximum(empty, kernel=kernel)


@pytest.mark.parametrize("kernel,threads", [("xla", 1), pytest.param("native", 1, marks=needs_native),
                                            pytest.param("native", 2, marks=needs_native)])
def test_kernels_read_the_local_rows_of_a_shared_code_table(kernel, threads):
    """Devices that share one code table each read the columns from their row offset on: the
    root histogram, a masked histogram, a routed level and the last level's routing over that
    window equal the naive results on those rows alone, whatever the codes around it hold."""
    n_rows, n_features, num_nodes, max_bin, offset, width = 40_000, 5, 6, 32, 12_345, 60_000
    X_binned, node_index, gradients, hessians, level = route_case(21, n_rows, n_features, num_nodes, max_bin)
    row_mask = np.random.default_rng(22).uniform(size=n_rows) < 0.5
    X_binned[::9, 3] = max_bin - 1
    table = np.random.default_rng(23).integers(0, max_bin, size=(n_features, width)).astype(np.uint8)
    table[:, offset:offset + n_rows] = X_binned.T
    args = dict(gradients=jnp.asarray(gradients), hessians=jnp.asarray(hessians))
    options = dict(max_bin=max_bin, kernel=kernel, threads=threads)

    @jax.jit
    def window_results(table, row_offset, node_index, row_mask):
        root = build_histogram(table, jnp.zeros_like(node_index), num_nodes=1, row_offset=row_offset, **args,
                               **options)
        masked = build_histogram(table, node_index, num_nodes=num_nodes, row_mask=row_mask, row_offset=row_offset,
                                 **args, **options)
        level_args = {k: jnp.asarray(v) for k, v in level.items()}
        routed = route_and_build_histogram(table, node_index, **args, **level_args, row_offset=row_offset,
                                           **options)
        # Routed without splits (a last level): the codes read are the window's too.
        no_splits = {**level_args, "splits": jnp.zeros_like(level_args["splits"])}
        last, _ = route_and_build_histogram(table, node_index, **args, **no_splits, row_offset=row_offset, **options)
        return root, masked, routed, last

    root, masked, (child, smaller), last = window_results(jnp.asarray(table), jnp.int32(offset),
                                                          jnp.asarray(node_index), jnp.asarray(row_mask))
    g64, h64 = gradients.astype(np.float64), hessians.astype(np.float64)
    np.testing.assert_allclose(np.asarray(root), naive_histogram(X_binned, np.zeros(n_rows, np.int32), g64, h64, 1,
                                                                 max_bin), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(masked), masked_naive_histogram(X_binned, node_index, gradients, hessians,
                                                                          row_mask, num_nodes, max_bin),
                               rtol=1e-5, atol=1e-3)
    expected_child, in_smaller = naive_route(X_binned, node_index, level, max_bin)
    np.testing.assert_array_equal(np.asarray(child), expected_child)
    np.testing.assert_array_equal(np.asarray(last), expected_child)
    assert_split_nodes_close(smaller, masked_naive_histogram(X_binned, node_index, gradients, hessians, in_smaller,
                                                             num_nodes, max_bin),
                             level["splits"], kernel, rtol=1e-5, atol=1e-3)


@needs_native
def test_native_kernels_refuse_a_window_outside_the_code_table():
    X_binned, node_index, gradients, hessians, _ = histogram_case(24, 1000, 3, 2, 16)
    table = jnp.asarray(np.zeros((3, 1500), np.uint8))
    build = jax.jit(lambda offset: build_histogram(table, jnp.asarray(node_index), jnp.asarray(gradients),
                                                   jnp.asarray(hessians), 2, 16, kernel="native", row_offset=offset))
    np.testing.assert_allclose(np.asarray(build(jnp.int32(500))).sum(axis=(0, 1, 2))[1],
                               hessians.sum() * 3, rtol=1e-4)  # the last possible window is accepted
    with pytest.raises(Exception, match="outside the code table"):
        np.asarray(build(jnp.int32(501)))
    with pytest.raises(ValueError, match="pass row_offset"):
        build_histogram(table, jnp.asarray(node_index), jnp.asarray(gradients), jnp.asarray(hessians), 2, 16)


# Two fits compared bit for bit: on a GPU only the fixed-point histograms add their rows in a
# repeatable order (on an H100 the others split near ties differently).
@pytest.mark.parametrize("settings,sharded,at_once", [
    pytest.param({"loss": "logistic", "num_rounds": 6, "max_depth": 8, "learning_rate": 0.3,
                  "min_child_weight": 1.0}, False, False, marks=needs_repeatable_sums, id="logistic-depth8"),
    pytest.param({"loss": "squared_error", "num_rounds": 4, "max_depth": 9, "learning_rate": 0.3,
                  "min_child_weight": 6.0, "monotone_constraints": [1, 0, 0, 0, 0, -1]}, True, False,
                 id="squared-monotone-sharded"),
    pytest.param({"loss": "softmax", "num_rounds": 3, "max_depth": 7, "learning_rate": 0.3, "min_child_weight": 0.5,
                  "multi_strategy": "multi_output_tree"}, False, False, marks=needs_repeatable_sums,
                 id="softmax-vector"),
    pytest.param({"loss": "logistic", "num_rounds": 4, "max_depth": 7, "learning_rate": 0.3, "min_child_weight": 2.0,
                  "deterministic_histogram": True, "colsample_bynode": 0.8}, False, False,
                 id="fixed-point-node-sample"),
    pytest.param({"loss": "logistic", "num_rounds": 4, "max_depth": 7, "learning_rate": 0.3,
                  "min_child_weight": 1.0}, False, True, marks=needs_repeatable_sums, id="accelerator-at-once"),
])
def test_nodes_too_light_to_split_are_skipped_and_the_trees_stay_the_same(monkeypatch, settings, sharded, at_once):
    """A node whose Hessian weight is under twice ``min_child_weight`` has no valid split: the
    grower leaves it out of the split scan, and builds no histograms for the children of a split
    of a node under three times ``min_child_weight``, which are both such (``split.splittable``,
    ``split.children_splittable``). The trees are those grown when every active node
    is scanned and every split's children get histograms, bit for bit: on one device, with rows
    sharded over two, with vector leaves (the smallest diagonal Hessian is the weight), with
    fixed-point sums, and with every slot scanned at once as accelerators do. The fits hold such
    nodes above the last level (else the test would not exercise the skip). The slots of the
    children that get no histograms hold stale sums that a scan would split on: no node is split
    on them."""
    import jaxboost as jb
    from jaxboost import boosting, grower, split

    if sharded:
        if len(jax.devices()) < 2:
            pytest.skip("needs two CPU devices")
        shard_training_rows(monkeypatch)
    if at_once:
        for module in (split, grower):
            monkeypatch.setattr(module, "in_steps_on_cpu", lambda in_steps, all_at_once: all_at_once())
    X, y = kernel_training_data(settings)
    X, y = X[:600], y[:600]
    if settings["loss"] == "squared_error":
        y = (y + np.nan_to_num(X[:, 2])).astype(np.float32)
    settings = dict(settings)
    if settings["loss"] == "softmax":
        settings["num_outputs"] = 3
    # The children of a parent whose children get no histograms hold whatever their slots held
    # (unspecified): here a histogram of large, varied sums, which a scan would split on.
    build_children = grower.children_histograms_over_parents

    def children_with_stale_slots(parent_histograms, local_smaller, left_is_smaller, parent_splits, *args):
        children = build_children(parent_histograms, local_smaller, left_is_smaller, parent_splits, *args)
        cells = np.arange(np.prod(children.shape[1:])).reshape(children.shape[1:])
        stale = np.where(cells % 2 == 0, 40.0 * np.sin(cells), 30.0 + 10.0 * np.cos(cells)).astype(np.float32)
        unbuilt = jnp.repeat(~parent_splits[:children.shape[0] // 2], 2, total_repeat_length=children.shape[0])
        return jnp.where(unbuilt.reshape((-1,) + (1,) * (children.ndim - 1)), jnp.asarray(stale), children)

    monkeypatch.setattr(grower, "children_histograms_over_parents", children_with_stale_slots)
    boosting.clear_compiled_rounds()
    try:
        skipping = jb.train(X, y, **settings)
        # Every active node scanned, every split's children histogrammed.
        def every_node(sums, leaves, min_child_weight):
            return jnp.ones(sums.shape[:1], bool)

        monkeypatch.setattr(grower, "splittable", every_node)
        monkeypatch.setattr(grower, "children_splittable", every_node)
        boosting.clear_compiled_rounds()
        scanning_all = jb.train(X, y, **settings)
    finally:
        boosting.clear_compiled_rounds()
    assert_same_trees(skipping.trees, scanning_all.trees)
    from jaxboost.node_list import reached_nodes
    trees = skipping.trees
    is_leaf = np.asarray(trees.is_leaf)
    reached = reached_nodes(is_leaf)
    weight = np.asarray(trees.sum_hessians)
    weight = weight if weight.ndim == is_leaf.ndim else weight.min(axis=-1)
    above_last_level = np.arange(is_leaf.shape[-1]) < 2 ** settings["max_depth"] - 1
    light = reached & is_leaf & above_last_level & (weight < 2 * settings["min_child_weight"])
    assert light.sum() > 10, "no node too light to split above the last level: the skip is not exercised"
    assert np.sum(reached & ~is_leaf) > 8 * settings["num_rounds"]
