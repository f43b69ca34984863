"""Tests of the histogram kernel and the depth-wise grower against naive NumPy versions written here.

The naive grower builds every node's histogram straight from the rows in that node (no sibling
subtraction) and scans every candidate split with XGBoost's ``loss_chg`` re-derived in NumPy.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxboost.grower import MIN_LOSS_CHANGE, GrowthParams, grow_tree
from jaxboost.histogram import build_histogram
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
    return grow_tree(X_binned_T, gradients, hessians, feature_allowed, jax.random.PRNGKey(0), params, max_depth,
                     max_bin, axis_name=None)


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
