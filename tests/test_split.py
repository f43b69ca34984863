"""Tests of the split scan, the leaf regularizer and gamma pruning against brute force in NumPy.

``find_best_splits`` is checked against an enumeration of every candidate (feature, threshold
bin, missing direction) whose children are summed straight from the rows, and so is the CPU's
native scan of a level, which must also match the XLA scan (bit for bit in the closed form); the regularizer
against a dense grid search of the leaf objective; ``prune_by_gamma`` against XGBoost's
``min_split_loss`` rule applied to the unpruned tree in NumPy.
"""

from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import each_kernel_simd

from jaxboost.grower import GrowthParams, grow_tree, prune_by_gamma
from jaxboost.regularizer import Regularization, leaf_value, node_score
from jaxboost.split import NodeBounds, find_best_splits, find_best_splits_of_live_nodes
from jaxboost.tree import Tree, num_heap_nodes

F32 = jnp.float32
NUM_NODES, N_FEATURES, MAX_BIN = 4, 3, 8
MISSING_BIN = MAX_BIN - 1


def make_reg(reg_lambda, reg_alpha=0.0, max_delta_step=0.0, form_known=False):
    """``form_known``: whether leaves are bounded is static (as training sets it), so scores are
    compiled in the one form that applies; otherwise both are computed and one picked."""
    reg = Regularization(F32(reg_lambda), F32(reg_alpha), F32(max_delta_step))
    return reg.with_max_delta_step(max_delta_step) if form_known else reg


# --------------------------------------------------------------------------------------------
# NumPy reference of the regularised leaf objective
# --------------------------------------------------------------------------------------------


def np_leaf_objective(w, G, H, reg_lambda, reg_alpha):
    return G * w + 0.5 * (H + reg_lambda) * w * w + reg_alpha * np.abs(w)


def np_leaf_value(G, H, reg_lambda, reg_alpha, max_delta_step):
    if H + reg_lambda <= 0:
        return 0.0
    w = -np.sign(G) * max(abs(G) - reg_alpha, 0.0) / (H + reg_lambda)
    return float(np.clip(w, -max_delta_step, max_delta_step)) if max_delta_step > 0 else w


def np_score(G, H, reg_lambda, reg_alpha, max_delta_step):
    """-2 x the objective at the optimal (clipped) leaf value."""
    w = np_leaf_value(G, H, reg_lambda, reg_alpha, max_delta_step)
    return -2.0 * np_leaf_objective(w, G, H, reg_lambda, reg_alpha)


# --------------------------------------------------------------------------------------------
# find_best_splits vs brute force over the rows
# --------------------------------------------------------------------------------------------


def np_histogram(X_binned, node_index, g, h):
    histogram = np.zeros((NUM_NODES, N_FEATURES, MAX_BIN, 2))
    for feature in range(N_FEATURES):
        np.add.at(histogram[:, feature, :, 0], (node_index, X_binned[:, feature]), g)
        np.add.at(histogram[:, feature, :, 1], (node_index, X_binned[:, feature]), h)
    return histogram.astype(np.float32)


def brute_force_candidates(X_binned, g, h, rows, allowed, reg_lambda, reg_alpha, max_delta_step, min_child_weight):
    """Every candidate of one node in the library's tie order, as (gain, choice, left_mask, sums)."""
    codes_all = X_binned[rows].astype(np.int64)
    g_node, h_node = g[rows], h[rows]
    parent = np_score(g_node.sum(), h_node.sum(), reg_lambda, reg_alpha, max_delta_step)
    candidates = []
    for feature in range(N_FEATURES):
        codes = codes_all[:, feature]
        missing = codes == MISSING_BIN
        for default_left in (True, False):
            for threshold in range(MAX_BIN - 1):
                left = (~missing & (codes <= threshold)) | (missing & default_left)
                GL, HL = g_node[left].sum(), h_node[left].sum()
                GR, HR = g_node[~left].sum(), h_node[~left].sum()
                valid = allowed[feature] and HL >= min_child_weight and HR >= min_child_weight and HL > 0 and HR > 0
                gain = (np_score(GL, HL, reg_lambda, reg_alpha, max_delta_step)
                        + np_score(GR, HR, reg_lambda, reg_alpha, max_delta_step) - parent) if valid else -np.inf
                candidates.append((gain, (feature, threshold, default_left), left, (GL, HL, GR, HR)))
    return candidates


def first_best(candidates):
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate[0] > best[0]:
            best = candidate
    return best


# The split scans: XLA's (every backend), and the native kernel that scans a level on a CPU.
SCANS = ["xla", "native"]


@partial(jax.jit, static_argnames="scan")
def _jit_find_best_splits(histograms, feature_allowed, reg, min_child_weight, scan="xla"):
    if scan == "xla":
        return find_best_splits(histograms, feature_allowed, reg, min_child_weight)
    return find_best_splits_of_live_nodes(histograms, feature_allowed, reg, min_child_weight, kernel="native")


def make_split_data(seed):
    rng = np.random.default_rng(seed)
    # Nodes of different sizes; node 3 is small so that large min_child_weight leaves it unsplittable.
    sizes = [220, 150, 90, 15]
    node_index = np.repeat(np.arange(NUM_NODES), sizes).astype(np.int32)
    n = len(node_index)
    X_binned = rng.integers(0, MAX_BIN - 1, size=(n, N_FEATURES))
    X_binned[rng.uniform(size=X_binned.shape) < 0.08] = MISSING_BIN
    X_binned = X_binned.astype(np.uint8)
    g = (rng.normal(size=n) + 0.8 * (X_binned[:, seed % N_FEATURES] >= 3)
         + 1.2 * (X_binned[:, 1] == MISSING_BIN)).astype(np.float32)
    h = rng.uniform(0.1, 2.0, size=n).astype(np.float32)
    return X_binned, node_index, g, h


SPLIT_CASES = list(itertools.product([0.5, 1.0, 5.0], [0.0, 0.5], [0.0, 1.0, 10.0], [0.0, 0.3]))


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("seed,form_known", [(0, False), (1, False), (0, True)])
@pytest.mark.parametrize("reg_lambda,reg_alpha,min_child_weight,max_delta_step", SPLIT_CASES)
def test_find_best_splits_matches_brute_force(seed, form_known, reg_lambda, reg_alpha, min_child_weight,
                                              max_delta_step, scan):
    X_binned, node_index, g, h = make_split_data(seed)
    g64, h64 = g.astype(np.float64), h.astype(np.float64)
    allowed = np.ones((NUM_NODES, N_FEATURES), bool)
    split = _jit_find_best_splits(jnp.asarray(np_histogram(X_binned, node_index, g64, h64)), jnp.asarray(allowed),
                                  make_reg(reg_lambda, reg_alpha, max_delta_step, form_known), F32(min_child_weight),
                                  scan=scan)
    split = jax.tree.map(np.asarray, split)
    context = f"(lambda={reg_lambda}, alpha={reg_alpha}, mcw={min_child_weight}, mds={max_delta_step}, seed={seed})"
    for node in range(NUM_NODES):
        rows = np.flatnonzero(node_index == node)
        candidates = brute_force_candidates(X_binned, g64, h64, rows, allowed[node], reg_lambda, reg_alpha,
                                            max_delta_step, min_child_weight)
        best = first_best(candidates)
        best_gain = best[0]
        if best_gain == -np.inf:
            assert split.loss_change[node] == -np.inf, (
                f"node {node}: no valid candidate, expected -inf, got {split.loss_change[node]} {context}")
            continue
        tolerance = 1e-4 * max(1.0, abs(best_gain))
        assert abs(split.loss_change[node] - best_gain) <= tolerance, (
            f"node {node}: loss_change {split.loss_change[node]}, brute-force maximum {best_gain} {context}")
        choice = (int(split.feature[node]), int(split.threshold_bin[node]), bool(split.default_left[node]))
        chosen = next(candidate for candidate in candidates if candidate[1] == choice)
        assert abs(chosen[0] - best_gain) <= tolerance, (
            f"node {node}: chosen {choice} has brute-force gain {chosen[0]}, the maximum is {best_gain} at {best[1]} "
            f"{context}")
        np.testing.assert_allclose(
            [split.left_gradients[node], split.left_hessians[node], split.right_gradients[node],
             split.right_hessians[node]], chosen[3], rtol=1e-5, atol=1e-4,
            err_msg=f"node {node}: children sums of {choice} differ from the rows' sums {context}")
        # Where no other cut of the rows comes close, the choice is exactly the first best in tie order.
        other_cuts = [c[0] for c in candidates if not np.array_equal(c[2], best[2])]
        runner_up = max(other_cuts, default=-np.inf)
        if best_gain - runner_up > 10 * tolerance:
            assert choice == best[1], f"node {node}: chose {choice}, expected {best[1]} {context}"


@pytest.mark.parametrize("max_delta_step", [0.0, 0.3])
def test_node_score_in_the_known_form_equals_the_run_time_choice(max_delta_step):
    """Training compiles one form of the split score; it must be the one the run-time choice
    picks, bit for bit, or trees would depend on how the regularizer was built."""
    G = jnp.asarray(LEAF_G)
    H = jnp.asarray(LEAF_H)
    for reg_alpha in (0.0, 0.5):
        chosen = jax.jit(node_score)(G, H, make_reg(1.0, reg_alpha, max_delta_step))
        known = jax.jit(node_score)(G, H, make_reg(1.0, reg_alpha, max_delta_step, form_known=True))
        np.testing.assert_array_equal(np.asarray(known), np.asarray(chosen),
                                      err_msg=f"max_delta_step={max_delta_step}, alpha={reg_alpha}")


def _exact_histogram_case():
    """Histograms (NUM_NODES, d, bins, 2) built from hand-placed rows, for the tie and validity checks."""
    histograms = np.zeros((NUM_NODES, N_FEATURES, MAX_BIN, 2), np.float32)
    # Node 0: feature 0 has rows only in bins 1 and 5 (bins 2..4 empty), no missing values;
    # feature 1 is identical to feature 0 (an exact duplicate); feature 2 puts every row in bin 3.
    for feature in (0, 1):
        histograms[0, feature, 1] = [-4.0, 3.0]
        histograms[0, feature, 5] = [5.0, 2.0]
    histograms[0, 2, 3] = [1.0, 5.0]
    # Node 1: every feature holds all rows in one bin, no missing: no split has two non-empty children.
    histograms[1, :, 2] = [3.0, 4.0]
    # Node 2: a good split exists, but the total Hessian (2.0) is below 2 x min_child_weight.
    histograms[2, :, 0] = [-3.0, 1.0]
    histograms[2, :, 4] = [3.0, 1.0]
    # Node 3: only missing values and one value bin; the cut is "missing vs present".
    histograms[3, :, 0] = [2.0, 3.0]
    histograms[3, :, MISSING_BIN] = [-2.0, 3.0]
    return histograms


@pytest.mark.parametrize("scan", SCANS)
def test_find_best_splits_tie_rules_and_invalid_nodes(scan):
    histograms = _exact_histogram_case()
    allowed = np.ones((NUM_NODES, N_FEATURES), bool)
    split = jax.tree.map(np.asarray, _jit_find_best_splits(jnp.asarray(histograms), jnp.asarray(allowed),
                                                           make_reg(1.0), F32(1.5), scan=scan))
    # Node 0: thresholds 1..4 cut alike, both directions are equal (no missing values), features
    # 0 and 1 are identical: the lowest feature, missing-left, the lowest bin.
    assert (split.feature[0], split.threshold_bin[0], bool(split.default_left[0])) == (0, 1, True), (
        f"tie order violated: got feature={split.feature[0]}, bin={split.threshold_bin[0]}, "
        f"default_left={split.default_left[0]}; expected (0, 1, True)")
    expected_gain = np_score(-4, 3, 1, 0, 0) + np_score(5, 2, 1, 0, 0) - np_score(1, 5, 1, 0, 0)
    np.testing.assert_allclose(split.loss_change[0], expected_gain, rtol=1e-6)
    np.testing.assert_allclose([split.left_gradients[0], split.left_hessians[0], split.right_gradients[0],
                                split.right_hessians[0]], [-4, 3, 5, 2], rtol=1e-6)
    assert split.loss_change[1] == -np.inf, f"a node with one occupied bin must give -inf, got {split.loss_change[1]}"
    assert split.loss_change[2] == -np.inf, (
        f"children below min_child_weight must give -inf, got {split.loss_change[2]}")
    # Node 3: the only cut is "present left, missing right".
    np.testing.assert_allclose(split.loss_change[3], np_score(2, 3, 1, 0, 0) + np_score(-2, 3, 1, 0, 0)
                               - np_score(0, 6, 1, 0, 0), rtol=1e-6)
    # min_child_weight = 0: node 2 becomes splittable, node 1 still is not (empty children).
    split = jax.tree.map(np.asarray, _jit_find_best_splits(jnp.asarray(histograms), jnp.asarray(allowed),
                                                           make_reg(1.0), F32(0.0), scan=scan))
    assert np.isfinite(split.loss_change[2]) and split.loss_change[2] > 0
    assert split.loss_change[1] == -np.inf, "an empty child is invalid even with min_child_weight = 0"


@pytest.mark.parametrize("scan", SCANS)
def test_missing_versus_present_cut_takes_the_first_equivalent_candidate(scan):
    histograms = _exact_histogram_case()
    allowed = np.ones((NUM_NODES, N_FEATURES), bool)
    split = jax.tree.map(np.asarray, _jit_find_best_splits(jnp.asarray(histograms), jnp.asarray(allowed),
                                                           make_reg(1.0), F32(0.0), scan=scan))
    # Node 3 holds rows in value bin 0 and missing rows. Sending missing values left puts every row
    # left (bin 0 is always on the left), so no missing-left candidate is valid; every missing-right
    # candidate of every feature cuts alike: the lowest feature and bin win.
    assert (split.feature[3], split.threshold_bin[3], bool(split.default_left[3])) == (0, 0, False), (
        f"got ({split.feature[3]}, {split.threshold_bin[3]}, {split.default_left[3]}), expected (0, 0, False)")


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("seed", [0, 1])
def test_masked_feature_is_never_chosen(seed, scan):
    X_binned, node_index, g, h = make_split_data(seed)
    g64, h64 = g.astype(np.float64), h.astype(np.float64)
    histograms = jnp.asarray(np_histogram(X_binned, node_index, g64, h64))
    reg = make_reg(1.0)
    all_allowed = np.ones((NUM_NODES, N_FEATURES), bool)
    unmasked = jax.tree.map(np.asarray, _jit_find_best_splits(histograms, jnp.asarray(all_allowed), reg, F32(1.0),
                                                              scan=scan))
    allowed = all_allowed.copy()
    allowed[np.arange(NUM_NODES), unmasked.feature] = False  # mask each node's favourite feature
    allowed[3, :] = False  # and every feature of node 3
    split = jax.tree.map(np.asarray, _jit_find_best_splits(histograms, jnp.asarray(allowed), reg, F32(1.0), scan=scan))
    for node in range(NUM_NODES):
        rows = np.flatnonzero(node_index == node)
        best = first_best(brute_force_candidates(X_binned, g64, h64, rows, allowed[node], 1.0, 0.0, 0.0, 1.0))
        if not allowed[node].any():
            assert split.loss_change[node] == -np.inf, f"node {node}: every feature masked, expected -inf"
            continue
        assert allowed[node, split.feature[node]], (
            f"node {node}: chose masked feature {split.feature[node]} (allowed {allowed[node]})")
        assert abs(split.loss_change[node] - best[0]) <= 1e-4 * max(1.0, abs(best[0])), (
            f"node {node}: loss_change {split.loss_change[node]}, best over allowed features {best[0]}")


# --------------------------------------------------------------------------------------------
# leaf_value and node_score
# --------------------------------------------------------------------------------------------

GRID_G = np.array([-10.0, -2.0, -0.3, 0.0, 0.2, 0.45, 0.7, 5.0, 40.0])
GRID_H = np.array([0.0, 0.5, 3.0, 20.0])
LEAF_G, LEAF_H = (a.ravel().astype(np.float32) for a in np.meshgrid(GRID_G, GRID_H, indexing="ij"))


@jax.jit
def _jit_leaf(G, H, reg):
    return leaf_value(G, H, reg), node_score(G, H, reg)


@pytest.mark.parametrize("reg_lambda", [0.0, 0.5, 1.0, 5.0])
@pytest.mark.parametrize("reg_alpha", [0.0, 0.5])
@pytest.mark.parametrize("max_delta_step", [0.0, 0.3])
def test_leaf_value_minimises_the_penalised_objective(reg_lambda, reg_alpha, max_delta_step):
    values, scores = (np.asarray(a, np.float64) for a in _jit_leaf(jnp.asarray(LEAF_G), jnp.asarray(LEAF_H),
                                                                    make_reg(reg_lambda, reg_alpha, max_delta_step)))
    for G, H, w, score in zip(LEAF_G.astype(np.float64), LEAF_H.astype(np.float64), values, scores):
        context = f"(G={G}, H={H}, lambda={reg_lambda}, alpha={reg_alpha}, max_delta_step={max_delta_step})"
        if H + reg_lambda == 0:
            assert w == 0.0 and score == 0.0, f"no curvature: expected value 0 and score 0, got {w}, {score} {context}"
            continue
        unclipped = -np.sign(G) * max(abs(G) - reg_alpha, 0.0) / (H + reg_lambda)
        bound = max_delta_step if max_delta_step > 0 else 2 * abs(unclipped) + 1.0
        # Dense grid over the feasible interval (step ~ bound / 1e5), plus its end points.
        grid = np.concatenate([np.linspace(-bound, bound, 200_001), [0.0]])
        objective = np_leaf_objective(grid, G, H, reg_lambda, reg_alpha)
        grid_min = objective.min()
        step = 2 * bound / 200_000
        assert abs(w - grid[np.argmin(objective)]) <= step + 1e-6 * max(1.0, abs(w)), (
            f"leaf value {w}, grid minimiser {grid[np.argmin(objective)]} {context}")
        value_objective = np_leaf_objective(w, G, H, reg_lambda, reg_alpha)
        assert value_objective <= grid_min + 1e-6 * max(1.0, abs(grid_min)), (
            f"objective at the leaf value {value_objective} exceeds the grid minimum {grid_min} {context}")
        if max_delta_step > 0:
            assert abs(w) <= max_delta_step * (1 + 1e-7), f"leaf value {w} exceeds max_delta_step {context}"
        np.testing.assert_allclose(w, np.clip(unclipped, -bound, bound), rtol=1e-6, atol=1e-9, err_msg=context)
        if max_delta_step == 0 or abs(unclipped) < max_delta_step:
            # The subdifferential G + (H + lambda) w + alpha d|w| contains 0.
            residual = G + (H + reg_lambda) * w
            if w == 0:
                assert abs(G) <= reg_alpha + 1e-6, f"w = 0 but |G| > alpha {context}"
            else:
                assert abs(residual + reg_alpha * np.sign(w)) <= 1e-5 * max(1.0, abs(G)), (
                    f"the subgradient at {w} does not contain 0: {residual + reg_alpha * np.sign(w)} {context}")
        else:
            # Clipped at the bound: the objective still decreases towards the unclipped minimiser.
            direction = np.sign(unclipped)
            assert w == pytest.approx(direction * max_delta_step, rel=1e-6), f"value not clipped {context}"
            slope_outward = direction * (G + (H + reg_lambda) * w + reg_alpha * np.sign(w))
            assert slope_outward <= 1e-6, f"clipped value is not a constrained minimum {context}"
        np.testing.assert_allclose(score, -2.0 * value_objective, rtol=1e-5, atol=1e-6,
                                   err_msg=f"node_score is not -2 x the objective at the leaf value {context}")
        if max_delta_step == 0:
            soft = max(abs(G) - reg_alpha, 0.0)
            np.testing.assert_allclose(score, soft ** 2 / (H + reg_lambda), rtol=1e-5, atol=1e-6,
                                       err_msg=f"node_score != T_alpha(G)^2 / (H + lambda) {context}")


# --------------------------------------------------------------------------------------------
# gamma pruning
# --------------------------------------------------------------------------------------------


def growth_params(gamma, reg_lambda=1.0, min_child_weight=0.0, learning_rate=1.0):
    return GrowthParams(reg=make_reg(reg_lambda), learning_rate=F32(learning_rate), gamma=F32(gamma),
                        min_child_weight=F32(min_child_weight), colsample_bylevel=F32(1.0),
                        colsample_bynode=F32(1.0))


@partial(jax.jit, static_argnames=("max_depth", "max_bin"))
def _jit_grow(X_binned_T, gradients, hessians, params, max_depth, max_bin):
    tree, row_leaves, _, _ = grow_tree(X_binned_T, gradients, hessians, jnp.ones(X_binned_T.shape[0], bool),
                                    jax.random.PRNGKey(0), params, max_depth, max_bin, axis_name=None)
    return tree, row_leaves.heap_index()


PRUNE_ROWS, PRUNE_FEATURES, PRUNE_DEPTH, PRUNE_BINS = 400, 3, 4, 16  # one shape: one compile of the grower


def xor_data():
    """Four groups of 100 rows on two binary features (a third is constant), an XOR-like target
    with asymmetric sides and a constant gradient per group.

    The root's best split (on feature 1) gains little, but both its children gain a lot (left
    about 218, right about 208); the four groups are pure, so nothing below them splits.
    """
    f0 = np.repeat([0, 0, 1, 1], 100)
    f1 = np.repeat([0, 1, 0, 1], 100)
    g = np.repeat([1.0, -1.0, -1.1, 1.05], 100).astype(np.float32)
    X_binned = np.stack([f0, f1, np.zeros_like(f0)], axis=1).astype(np.uint8)
    return X_binned, g, np.ones_like(g)


def np_prune(tree, gamma):
    """XGBoost's rule on the unpruned tree: repeatedly turn a split whose children are both leaves
    and whose loss_chg < gamma into a leaf."""
    is_leaf = np.asarray(tree.is_leaf).copy()
    loss_change = np.asarray(tree.loss_change)
    num_nodes = len(is_leaf)
    reached = np.zeros(num_nodes, bool)
    reached[0] = True
    for node in range(num_nodes):
        if reached[node] and not is_leaf[node] and 2 * node + 2 < num_nodes:
            reached[2 * node + 1] = reached[2 * node + 2] = True
    changed = True
    while changed:
        changed = False
        for node in range(num_nodes):
            if (reached[node] and not is_leaf[node] and is_leaf[2 * node + 1] and is_leaf[2 * node + 2]
                    and loss_change[node] < gamma):
                is_leaf[node] = True
                changed = True
                # Its former children are no longer part of the tree.
                stack = [2 * node + 1, 2 * node + 2]
                while stack:
                    child = stack.pop()
                    reached[child] = False
                    is_leaf[child] = False
                    if 2 * child + 2 < num_nodes:
                        stack += [2 * child + 1, 2 * child + 2]
    return is_leaf & reached, reached


def np_surviving_leaf(row_leaf, is_leaf):
    """For each row, the topmost leaf of the pruned tree on its path to its unpruned leaf."""
    result = np.empty_like(row_leaf)
    for i, leaf in enumerate(row_leaf):
        path = [int(leaf)]
        while path[-1] > 0:
            path.append((path[-1] - 1) // 2)
        result[i] = next(node for node in reversed(path) if is_leaf[node])
    return result


# A tree grown twice: on CPU its histograms add the rows in the same order both times; a GPU's
# atomic adds take them in a varying order (measured: gains 3.4e-6 apart on an H100).
REGROWN_RTOL = 1e-6 if jax.default_backend() == "cpu" else 2e-5


def test_gamma_pruning_on_designed_tree():
    X_binned, g, h = xor_data()
    args = (jnp.asarray(X_binned.T), jnp.asarray(g), jnp.asarray(h))
    grow = partial(_jit_grow, max_depth=PRUNE_DEPTH, max_bin=PRUNE_BINS)
    tree, row_leaf = jax.tree.map(np.asarray, grow(*args, growth_params(0.0)))
    full = np.zeros(num_heap_nodes(PRUNE_DEPTH), bool)
    full[3:7] = True
    np.testing.assert_array_equal(tree.is_leaf, full, err_msg="expected a full depth-2 tree (pure groups below)")
    assert tree.feature[0] == 1 and tree.feature[1] == 0 and tree.feature[2] == 0, f"features {tree.feature[:3]}"
    g64 = g.astype(np.float64)
    G = {f"{a}{b}": g64[(X_binned[:, 0] == a) & (X_binned[:, 1] == b)].sum() for a in (0, 1) for b in (0, 1)}

    def score(G_, H_):
        return np_score(G_, H_, 1, 0, 0)

    left_G, right_G = G["00"] + G["10"], G["01"] + G["11"]
    expected_gains = [score(left_G, 200) + score(right_G, 200) - score(left_G + right_G, 400),
                      score(G["00"], 100) + score(G["10"], 100) - score(left_G, 200),
                      score(G["01"], 100) + score(G["11"], 100) - score(right_G, 200)]
    np.testing.assert_allclose(tree.loss_change[:3], expected_gains, rtol=1e-4)
    assert expected_gains[0] < 1.0 < 200 < expected_gains[2] < 210 < expected_gains[1] < 300

    # gamma = 1: the root gains less than gamma, but its children are splits, so it is kept.
    pruned, pruned_row_leaf = jax.tree.map(np.asarray, grow(*args, growth_params(1.0)))
    np.testing.assert_array_equal(pruned.is_leaf, tree.is_leaf, err_msg="gamma=1 must not prune anything")
    np.testing.assert_array_equal(pruned_row_leaf, row_leaf)
    np.testing.assert_allclose(pruned.loss_change, tree.loss_change, rtol=REGROWN_RTOL)

    # gamma = 210: only the right child's split goes; its rows land in node 2.
    pruned, pruned_row_leaf = jax.tree.map(np.asarray, grow(*args, growth_params(210.0)))
    expected_is_leaf = np.zeros_like(full)
    expected_is_leaf[[2, 3, 4]] = True
    np.testing.assert_array_equal(pruned.is_leaf, expected_is_leaf,
                                  err_msg="gamma=210: node 2 should become a leaf, nodes 5 and 6 disappear")
    np.testing.assert_array_equal(pruned_row_leaf, np.where(X_binned[:, 1] == 1, 2, row_leaf),
                                  err_msg="rows of the pruned children must land in node 2")
    assert pruned.loss_change[2] == 0 and pruned.loss_change[0] == pytest.approx(expected_gains[0], rel=1e-4)
    np.testing.assert_allclose(pruned.value[2], np_leaf_value(right_G, 200, 1, 0, 0), rtol=1e-4,
                               err_msg="the surviving leaf's value is its own rows' leaf value")

    # gamma = 300: both child splits go, then the root is a split over two leaves below gamma: it goes too.
    pruned, pruned_row_leaf = jax.tree.map(np.asarray, grow(*args, growth_params(300.0)))
    np.testing.assert_array_equal(pruned.is_leaf, np.arange(len(full)) == 0, err_msg="gamma=300 should leave the root")
    np.testing.assert_array_equal(pruned_row_leaf, 0)
    assert pruned.loss_change[0] == 0, "the root is a leaf now: no loss_change"
    np.testing.assert_allclose(pruned.value[0], np_leaf_value(left_G + right_G, 400, 1, 0, 0), rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gamma_pruning_matches_numpy_rule_on_random_trees(seed):
    rng = np.random.default_rng(seed)
    n, max_depth, max_bin = PRUNE_ROWS, PRUNE_DEPTH, PRUNE_BINS
    X_binned = rng.integers(0, max_bin, size=(n, PRUNE_FEATURES)).astype(np.uint8)
    g = (rng.normal(size=n) + (X_binned[:, 0] > 7) - 0.7 * (X_binned[:, 2] < 4)).astype(np.float32)
    h = rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    # Multiples of 1/64: every sum of them is exact in float32, in any order, so the two grows
    # below split alike on a GPU too (its atomic adds take the rows in a varying order).
    g, h = np.round(g * 64) / 64, np.round(h * 64) / 64
    args = (jnp.asarray(X_binned.T), jnp.asarray(g), jnp.asarray(h))
    tree, row_leaf = jax.tree.map(np.asarray, _jit_grow(*args, growth_params(0.0), max_depth=max_depth,
                                                        max_bin=max_bin))
    gains = np.sort(tree.loss_change[~tree.is_leaf & (tree.loss_change > 0)])
    assert len(gains) >= 5, "the random tree should have several splits"
    # Gammas between consecutive gains (never equal to one): prune more and more.
    for gamma in [0.5 * (gains[i] + gains[i + 1]) for i in range(len(gains) - 1)] + [gains[-1] * 1.01]:
        expected_is_leaf, reached = np_prune(tree, gamma)
        pruned, pruned_row_leaf = jax.tree.map(np.asarray, _jit_grow(*args, growth_params(gamma), max_depth=max_depth,
                                                                     max_bin=max_bin))
        context = f"(seed={seed}, gamma={gamma:.4f})"
        np.testing.assert_array_equal(pruned.is_leaf, expected_is_leaf, err_msg=f"is_leaf after pruning {context}")
        kept_split = reached & ~expected_is_leaf
        np.testing.assert_allclose(pruned.loss_change[kept_split], tree.loss_change[kept_split], rtol=REGROWN_RTOL)
        assert np.all(pruned.loss_change[expected_is_leaf] == 0), f"new leaves keep a loss_change {context}"
        assert np.all(pruned.loss_change[kept_split] >= 0)
        np.testing.assert_array_equal(pruned_row_leaf, np_surviving_leaf(row_leaf, expected_is_leaf),
                                      err_msg=f"rows must land in the surviving leaf {context}")
        np.testing.assert_allclose(pruned.value[reached], tree.value[reached], rtol=REGROWN_RTOL,
                                   err_msg=f"pruning must not change node values {context}")


@partial(jax.jit, static_argnames="max_depth")
def _jit_prune(tree, max_depth, gamma):
    return prune_by_gamma(tree, max_depth, gamma)


def test_prune_by_gamma_on_hand_built_tree():
    # Depth 3 (15 nodes). Root splits; node 1 splits into leaves 3, 4 (gain 0.5); node 2 splits into
    # node 5 (splits into leaves 11, 12 with gain 10) and leaf 6, with gain 0.2.
    num_nodes = num_heap_nodes(3)
    is_leaf = np.zeros(num_nodes, bool)
    is_leaf[[3, 4, 6, 11, 12]] = True
    loss_change = np.zeros(num_nodes, np.float32)
    loss_change[[0, 1, 2, 5]] = [0.1, 0.5, 0.2, 10.0]
    zeros_i = jnp.zeros(num_nodes, jnp.int32)
    tree = Tree(zeros_i, zeros_i, jnp.zeros(num_nodes, bool), jnp.asarray(is_leaf),
                jnp.arange(num_nodes, dtype=jnp.float32), jnp.asarray(loss_change), jnp.ones(num_nodes, jnp.float32))
    row_leaves = np.array([3, 4, 6, 11, 12])

    pruned, surviving = jax.tree.map(np.asarray, _jit_prune(tree, 3, F32(1.0)))
    # Node 1 (gain 0.5 < 1, two leaf children) goes; node 5 (gain 10) stays, so node 2 and the root stay.
    expected_is_leaf = np.zeros(num_nodes, bool)
    expected_is_leaf[[1, 6, 11, 12]] = True
    np.testing.assert_array_equal(pruned.is_leaf, expected_is_leaf, err_msg="gamma=1 on the hand-built tree")
    np.testing.assert_array_equal(surviving[row_leaves], [1, 1, 6, 11, 12])
    np.testing.assert_allclose(pruned.loss_change[[0, 1, 2, 5]], [0.1, 0.0, 0.2, 10.0])
    reachable = np.isin(np.arange(num_nodes), [0, 1, 2, 5, 6, 11, 12])
    np.testing.assert_array_equal(pruned.value[reachable], np.arange(num_nodes)[reachable],
                                  err_msg="values of reachable nodes are untouched")
    assert not pruned.value[~reachable].any() and not pruned.loss_change[~reachable].any(), \
        "nodes below a leaf are cleared"

    pruned, surviving = jax.tree.map(np.asarray, _jit_prune(tree, 3, F32(11.0)))
    # Everything below gamma: node 5 goes, then node 2 and node 1, then the root.
    np.testing.assert_array_equal(pruned.is_leaf, np.arange(num_nodes) == 0,
                                  err_msg="gamma=11 should prune to the root")
    np.testing.assert_array_equal(surviving[row_leaves], 0)
    assert pruned.loss_change[0] == 0, "the root is a leaf now: no loss_change"

    pruned, surviving = jax.tree.map(np.asarray, _jit_prune(tree, 3, F32(0.05)))
    np.testing.assert_array_equal(pruned.is_leaf, is_leaf, err_msg="gamma below every gain prunes nothing")
    np.testing.assert_array_equal(surviving[row_leaves], row_leaves)


@pytest.mark.parametrize("seed", [0, 1])
def test_scan_without_missing_values_skips_a_direction_and_chooses_alike(seed):
    """With no missing values anywhere, both missing directions score alike, so scanning only
    "missing goes left" (``missing_values=False``) must give exactly the full scan's choice."""
    X_binned, node_index, g, h = make_split_data(seed)
    X_binned = np.where(X_binned == MISSING_BIN, 0, X_binned).astype(np.uint8)
    histograms = jnp.asarray(np_histogram(X_binned, node_index, g.astype(np.float64), h.astype(np.float64)))
    allowed = jnp.ones((NUM_NODES, N_FEATURES), bool)
    reg = make_reg(1.0, 0.5, 0.3)
    full = jax.tree.map(np.asarray, find_best_splits(histograms, allowed, reg, F32(1.0)))
    one_direction = jax.tree.map(np.asarray, find_best_splits(histograms, allowed, reg, F32(1.0),
                                                              missing_values=False))
    assert np.isfinite(full.loss_change).any()
    for name, expected, got in zip(full._fields, full, one_direction):
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("at_once", [False, True], ids=["cpu-steps", "accelerator-at-once"])
@pytest.mark.parametrize("n_features,max_bin,expected_chunk", [(28, 256, 2), (14, 256, 4), (3, 16, 64)])
def test_scan_of_live_nodes_scans_the_chunks_holding_active_nodes(monkeypatch, n_features, max_bin, expected_chunk,
                                                                  at_once):
    """``find_best_splits_of_live_nodes``: steps of ``scan_chunk_nodes`` slots (as many as fit
    ``SCAN_CHUNK_BYTES``: 2 nodes of 28 features of 256 bins); each chunk that holds one of the
    first ``live`` slots and an active node gets exactly the whole scan's choice, every other
    slot the empty choice (zeros), whatever its histogram holds. A level that fits one step is
    scanned whole. Off the CPU (``at_once``) every slot is scanned in one step: the active ones
    get the same choices."""
    from jaxboost import split
    from jaxboost.split import find_best_splits_of_live_nodes, scan_chunk_nodes

    # Either way on any backend (a GPU would take the one step by itself).
    monkeypatch.setattr(split, "in_steps_on_cpu",
                        lambda in_steps, all_at_once: all_at_once() if at_once else in_steps())

    slots, live = 64, 40
    rng = np.random.default_rng(n_features)
    gradients = rng.normal(size=(slots, n_features, max_bin))
    hessians = rng.uniform(0.0, 2.0, size=(slots, n_features, max_bin))
    histograms = np.stack([gradients, hessians], axis=-1).astype(np.float32)
    active = rng.uniform(size=slots) < 0.3
    active[8:24] = False  # whole chunks without an active node are skipped
    active[live:] = True  # past the live slots nothing is scanned
    chunk = scan_chunk_nodes(slots, n_features * max_bin * 2)
    assert chunk == expected_chunk
    histograms[~active] = np.nan  # cells of inactive nodes may hold anything
    allowed = jnp.ones((slots, n_features), bool)
    reg = make_reg(1.0, form_known=True)
    # The XLA scan's steps (on a CPU the native kernel would scan the level: tested below).
    scan = jax.jit(lambda hist, act: find_best_splits_of_live_nodes(hist, allowed, reg, F32(1.0),
                                                                    live_nodes=jnp.int32(live),
                                                                    active=act, kernel="xla"))
    got = jax.tree.map(np.asarray, scan(jnp.asarray(histograms), jnp.asarray(active)))
    whole = jax.tree.map(np.asarray, find_best_splits(jnp.asarray(histograms), allowed, reg, F32(1.0)))
    scanned = np.zeros(slots, bool)
    for start in range(0, -(-live // chunk) * chunk, chunk):
        scanned[start:start + chunk] = active[start:start + chunk].any()
    if chunk == slots or at_once:  # one step: the whole level is scanned
        scanned[:] = True
    else:
        assert scanned.any() and (~scanned).any()
    for name, expected, value in zip(whole._fields, whole, got):
        np.testing.assert_array_equal(value[scanned & active], expected[scanned & active], err_msg=name)
        np.testing.assert_array_equal(value[~scanned], 0, err_msg=name)


def _sparse_histograms(rng, shape, empty_fraction=0.5):
    """Random (nodes, d, bins, 2) histograms, about ``empty_fraction`` of their cells empty (as
    at the nodes of few rows), gradient sums of both signs, Hessian sums >= 0."""
    gradients = rng.normal(size=shape)
    hessians = rng.uniform(0.0, 2.0, size=shape)
    histograms = np.stack([gradients, hessians], axis=-1).astype(np.float32)
    histograms[rng.uniform(size=shape) < empty_fraction] = 0.0
    return histograms


# Sparse nodes: the kernel scans a node at its held bins alone where fewer than half (one
# direction) or two thirds (two) of them hold rows; the dense cases hold three quarters, the
# sparse ones 5%. 16 bins 95% empty leave too few valid candidates, so there the sparse case is
# 85% empty (about 15% held, asserted under a quarter).
def _empty_fraction(sparse: bool, max_bin: int) -> float:
    return 0.25 if not sparse else (0.95 if max_bin > 16 else 0.85)


@pytest.mark.parametrize("max_bin", [16, 43])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("missing_values", [True, False])
@pytest.mark.parametrize("reg_lambda,reg_alpha,max_delta_step,form_known",
                         [(1.0, 0.0, 0.0, True), (0.0, 0.0, 0.0, True), (2.0, 0.7, 0.0, True), (1.0, 0.5, 0.4, True),
                          (1.0, 0.5, 0.4, False), (1.0, 0.0, 0.0, False)])
def test_native_scan_equals_the_xla_scan_bit_for_bit(reg_lambda, reg_alpha, max_delta_step, form_known,
                                                    missing_values, sparse, max_bin, monkeypatch):
    """The native scan of a level (CPU) follows the XLA scan's arithmetic: the same choice, the
    same children's sums and, in the closed form of the score, the same gain bit for bit, with
    per-feature split costs, masked features, empty bins (each repeating the candidate before
    it: the first one must win), nodes with no valid candidate, and NaN sums (a NaN first gain
    holds candidate 0, any other NaN never wins), in nodes whose bins mostly hold rows and in
    nodes whose bins mostly do not (scanned at the bins that hold rows alone), with fewer values
    than a block of the kernel's lanes (16) and with whole blocks and a last one that overlaps
    them (43 bins: also whole blocks of 8 bins in the running sums and 3 past them), over 9
    features (the running sums take 8 features at once where 8 remain). Bounded leaves' scores
    (the objective at the clipped value) differ in their last bit where the compilers fuse a
    multiply and an add differently. Every variant of the kernel this CPU runs (AVX-512, AVX2,
    the baseline) gives the same."""
    rng = np.random.default_rng(7)
    nodes, n_features = 12, 9
    empty_fraction = _empty_fraction(sparse, max_bin)
    histograms = _sparse_histograms(rng, (nodes, n_features, max_bin), empty_fraction)
    if not missing_values:
        histograms[:, :, -1] = 0.0
    histograms[3] = 0.0  # no rows: every candidate invalid
    histograms[4, 0, 0] = [np.nan, 1.0]  # the node's very first gain is NaN
    histograms[5, 2, 3] = [np.nan, 1.0]  # a NaN among other features' valid gains
    allowed = rng.uniform(size=(nodes, n_features)) < 0.8
    allowed[4:6] = True
    allowed[6] = False
    reg = make_reg(reg_lambda, reg_alpha, max_delta_step, form_known).replace(
        split_cost=jnp.asarray(rng.uniform(0.0, 0.3, n_features), F32))

    def scans(histograms, allowed, kernel):
        return find_best_splits_of_live_nodes(histograms, allowed, reg, F32(0.5), missing_values=missing_values,
                                              kernel=kernel)

    xla_scan, native_scan = (jax.jit(partial(scans, kernel=kernel)) for kernel in ("xla", "native"))
    xla = jax.tree.map(np.asarray, xla_scan(histograms, allowed))
    assert np.isfinite(xla.loss_change).sum() >= nodes // 2, "most nodes should have a valid candidate"
    held = (histograms[..., :-1, :] != 0).any(axis=-1).mean(axis=(1, 2))
    assert ((held < (0.2 if max_bin > 16 else 0.25)) if sparse else (held > 2 / 3)).sum() >= nodes - 2
    assert np.isnan(xla.loss_change[4]) and np.isfinite(xla.loss_change[5]) and xla.loss_change[3] == -np.inf
    # vmapped (several models' levels at once): one call whose batch is more nodes.
    batch = np.stack([histograms, _sparse_histograms(rng, histograms.shape[:-1], empty_fraction)])
    xla_batch, native_batch = (jax.jit(jax.vmap(partial(scans, kernel=kernel), (0, None)))
                               for kernel in ("xla", "native"))
    xla_of_batch = jax.tree.map(np.asarray, xla_batch(batch, allowed))
    for simd in each_kernel_simd(monkeypatch):
        _assert_same_choices(jax.tree.map(np.asarray, native_scan(histograms, allowed)), xla,
                             bounded=max_delta_step > 0, variant=simd)
        _assert_same_choices(jax.tree.map(np.asarray, native_batch(batch, allowed)), xla_of_batch,
                             bounded=max_delta_step > 0, variant=simd)


def _assert_same_choices(got, expected, bounded, variant=""):
    """``variant``: the JAXBOOST_KERNEL_SIMD setting ``got`` came from, named in a failure."""
    for name, want, value in zip(expected._fields, expected, got):
        message = f"{name} ({variant or 'widest'})"
        if name in ("loss_change", "left_value", "right_value") and bounded:
            np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7, err_msg=message)
        else:
            np.testing.assert_array_equal(value, want, err_msg=message)


@pytest.mark.parametrize("max_bin", [16, 43])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("max_delta_step", [0.0, 0.4])
def test_native_scan_with_monotone_constraints_equals_the_xla_scan(max_delta_step, sparse, max_bin, monkeypatch):
    """Monotone constraints in the native scan: each node's values bounded (some bounds finite,
    some not), the candidates whose children's values go against their feature's direction
    left out, and the winner's children's values returned, as the XLA scan does (scores and
    values to the last bit of the fused multiply-adds)."""
    from jaxboost.split import NodeBounds

    rng = np.random.default_rng(11)
    nodes, n_features = 16, 6
    histograms = _sparse_histograms(rng, (nodes, n_features, max_bin), _empty_fraction(sparse, max_bin))
    monotone = jnp.asarray([1, -1, 0, 1, -1, 1], jnp.int32)
    lower = np.where(rng.uniform(size=nodes) < 0.5, rng.uniform(-1.0, 0.0, nodes), -np.inf).astype(np.float32)
    upper = np.where(rng.uniform(size=nodes) < 0.5, rng.uniform(0.0, 1.0, nodes), np.inf).astype(np.float32)
    bounds = NodeBounds(monotone, jnp.asarray(lower), jnp.asarray(upper))
    allowed = jnp.ones((nodes, n_features), bool)
    reg = make_reg(1.0, 0.2, max_delta_step, form_known=True)

    def scans(histograms, bounds, kernel):
        return find_best_splits_of_live_nodes(histograms, allowed, reg, F32(0.5), bounds, kernel=kernel)

    xla = jax.tree.map(np.asarray, jax.jit(partial(scans, kernel="xla"))(histograms, bounds))
    native_scan = jax.jit(partial(scans, kernel="native"))
    for simd in each_kernel_simd(monkeypatch):  # every variant of the kernel this CPU runs
        _assert_same_choices(jax.tree.map(np.asarray, native_scan(histograms, bounds)), xla, bounded=True,
                             variant=simd)
    free = jax.tree.map(np.asarray, scans(histograms, None, "xla"))
    assert (free.feature != xla.feature).any() or (free.threshold_bin != xla.threshold_bin).any(), (
        "the constraints should change some choices")
    valid = np.isfinite(xla.loss_change)
    assert valid.sum() >= nodes // 2
    direction = np.asarray(monotone)[xla.feature]
    assert not ((direction > 0) & (xla.left_value > xla.right_value) & valid).any()
    assert not ((direction < 0) & (xla.left_value < xla.right_value) & valid).any()
    assert (lower[valid] <= np.minimum(xla.left_value, xla.right_value)[valid]).all()


@pytest.mark.parametrize("empty_fraction", [0.3, 0.95], ids=["dense", "sparse"])
def test_native_scan_of_live_nodes_scans_the_live_active_nodes_alone(empty_fraction, monkeypatch):
    """On a CPU the native kernel scans a level in one call: the first ``live`` slots' active
    nodes get exactly the whole XLA scan's choice, every other slot the empty choice (zeros),
    whatever its histogram holds."""
    slots, live, n_features, max_bin = 64, 40, 28, 256
    rng = np.random.default_rng(3)
    histograms = _sparse_histograms(rng, (slots, n_features, max_bin), empty_fraction)
    active = rng.uniform(size=slots) < 0.4
    active[live:] = True  # past the live slots nothing is scanned
    histograms[~active] = np.nan
    allowed = jnp.ones((slots, n_features), bool)
    reg = make_reg(1.0, form_known=True)
    native_scan = jax.jit(
        lambda hist, act: find_best_splits_of_live_nodes(hist, allowed, reg, F32(1.0), live_nodes=jnp.int32(live),
                                                         active=act, kernel="native"))
    whole = jax.tree.map(np.asarray, find_best_splits(jnp.asarray(histograms), allowed, reg, F32(1.0)))
    scanned = active & (np.arange(slots) < live)
    assert 5 < scanned.sum() < live
    for simd in each_kernel_simd(monkeypatch):  # every variant of the kernel this CPU runs
        got = jax.tree.map(np.asarray, native_scan(histograms, active))
        for name, expected, value in zip(whole._fields, whole, got):
            np.testing.assert_array_equal(value[scanned], expected[scanned], err_msg=f"{name} ({simd or 'widest'})")
            np.testing.assert_array_equal(value[~scanned], 0, err_msg=f"{name} ({simd or 'widest'})")


def test_splittable_is_twice_min_child_weight_on_the_weight_the_scan_holds_to_it():
    """``splittable``: a node may split when its weight (the Hessian sum; for vector leaves the
    smallest diagonal entry) is positive and at least twice ``min_child_weight``, less a 0.1%
    slack for the scan's totals summing the same rows in another order; a node's children may
    when its weight is three times ``min_child_weight``, less the slack."""
    from jaxboost.regularizer import VectorLeaves
    from jaxboost.split import SPLITTABLE_SLACK, children_splittable, splittable

    assert SPLITTABLE_SLACK == 1e-3
    weights = jnp.asarray([0.0, 1.99, 1.999, 2.0, 5.0, -1.0], jnp.float32)
    np.testing.assert_array_equal(splittable(weights, None, F32(1.0)), [False, False, True, True, True, False])
    # min_child_weight 0: any node with weight.
    np.testing.assert_array_equal(splittable(weights, None, F32(0.0)), [False, True, True, True, True, False])
    # A child holds at most its parent's weight less min_child_weight (its sibling's least).
    np.testing.assert_array_equal(children_splittable(jnp.asarray([2.9, 2.999, 3.0, 0.0]), None, F32(1.0)),
                                  [False, True, True, False])
    # Vector leaves, full Hessians packed: the smallest diagonal entry is the weight, whatever
    # the off-diagonal ones (the trace of the second node is 4.5).
    hessians = jnp.asarray([[[3.0, -1.0], [-1.0, 2.5]], [[3.0, 0.5], [0.5, 1.5]], [[0.0, 0.0], [0.0, 4.0]]],
                           jnp.float32)
    for full in (True, False):
        leaves = VectorLeaves(num_outputs=2, full_hessian=full)
        np.testing.assert_array_equal(splittable(leaves.pack_hessian(hessians), leaves, F32(1.0)),
                                      [True, False, False])


@pytest.mark.parametrize("min_child_weight,root_splits", [(2.0, True), (2.01, False)])
def test_a_node_of_exactly_twice_min_child_weight_still_splits(min_child_weight, root_splits):
    """Four rows of squared error (Hessian 1 each) split two and two when ``min_child_weight``
    is 2 (each child holds exactly 2, as XGBoost allows), and not at all above it: the skip of
    nodes too light to split keeps the boundary."""
    import jaxboost as jb

    X = np.asarray([[0.0], [0.0], [1.0], [1.0]], np.float32)
    y = np.asarray([0.0, 0.0, 10.0, 10.0], np.float32)
    model = jb.train(X, y, loss="squared_error", num_rounds=1, max_depth=3, learning_rate=1.0, reg_lambda=0.0,
                     min_child_weight=min_child_weight)
    assert (not np.asarray(model.trees.is_leaf)[..., 0].item()) == root_splits  # the root
    predictions = model.predict(X)
    if root_splits:
        np.testing.assert_allclose(predictions, y, atol=1e-4)
    else:
        np.testing.assert_allclose(predictions, 5.0, atol=1e-4)


def _node_histograms(node_index, codes, g, h, max_bin):
    """Gradient and Hessian sums ``(nodes, features, max_bin, 2)`` of rows in nodes
    ``node_index`` with bin codes ``codes`` (rows x features), by NumPy."""
    histograms = np.zeros((node_index.max() + 1, codes.shape[1], max_bin, 2), np.float32)
    for feature in range(codes.shape[1]):
        np.add.at(histograms[:, feature], (node_index, codes[:, feature], 0), g)
        np.add.at(histograms[:, feature], (node_index, codes[:, feature], 1), h)
    return histograms


# Custom penalties whose split scans solve only the candidates that can win (the contenders).
_CUSTOM_PENALTIES = {
    "prior": (lambda w, p: 0.5 * p["strength"] * (w - p["center"]) ** 2, {"strength": 2.0, "center": 0.3}, 0.0, 0.0),
    "prior_l1": (lambda w, p: 0.5 * p["strength"] * (w - p["center"]) ** 2, {"strength": 2.0, "center": 0.3}, 0.0, 0.5),
    "smooth_l1": (lambda w, p: 1.5 * (jnp.sqrt(w * w + 0.01) - 0.1), (), 1.0, 0.0),
}


@pytest.mark.parametrize("contenders", [15, 1])
@pytest.mark.parametrize("name", sorted(_CUSTOM_PENALTIES))
@pytest.mark.parametrize("seed,min_child_weight,max_delta_step,monotone", [
    (0, 0.5, 0.0, False), (1, 0.5, 0.0, False), (2, 8.0, 0.0, False), (0, 0.5, 0.4, False), (1, 0.5, 0.4, False),
    (0, 0.5, 0.0, True), (1, 0.5, 0.4, True)])
def test_custom_penalty_scan_of_the_contenders_chooses_as_the_full_scan(monkeypatch, name, seed, min_child_weight,
                                                                         max_delta_step, monotone, contenders):
    """A custom penalty's split scan bounds every candidate's gain by one tangent of the penalty
    and solves only those of the highest bounds (15 a node, or 1, where the next bound more
    often reaches the best solved gain and the full scan runs): the same split, gain and
    children's sums as solving every candidate, bit for bit. The nodes hold 2000 to 12 rows (the smallest cannot split
    under the larger min_child_weight),
    values missing at random, two features alike (exact ties across features), features masked
    and a split cost per feature; with leaf values unbounded, within a max_delta_step that
    clips many of them, and under monotone constraints (directions by feature, value bounds by
    node): a bounded leaf's score is at most the unbounded one's, and a solved candidate whose
    children break its feature's direction is not valid, as in the full scan."""
    from jaxboost import regularizers, split as split_module

    monkeypatch.setattr(split_module, "CONTENDERS_PER_NODE", contenders)
    rng = np.random.default_rng(seed)
    n_features, max_bin, sizes = 8, 32, [2000, 600, 150, 40, 12]
    node_index = np.repeat(np.arange(len(sizes)), sizes)
    codes = rng.integers(0, max_bin - 1, size=(len(node_index), n_features))
    codes[rng.uniform(size=codes.shape) < 0.05] = max_bin - 1
    codes[:, 5] = codes[:, 2]
    g = (rng.normal(size=len(node_index)) + 1.5 * (codes[:, 2] > 12) - 2.0 * (codes[:, 6] < 5)
         + 3.0 * (node_index == 1)).astype(np.float32)
    h = rng.uniform(0.2, 1.0, size=len(node_index)).astype(np.float32)
    histograms = _node_histograms(node_index, codes, g, h, max_bin)
    allowed = rng.uniform(size=(len(sizes), n_features)) < 0.85
    allowed[:, 2] = True
    penalty, params, reg_lambda, reg_alpha = _CUSTOM_PENALTIES[name]
    reg = regularizers.custom(penalty, params, reg_lambda=reg_lambda, reg_alpha=reg_alpha,
                              split_cost=np.linspace(0.0, 0.5, n_features)).with_max_delta_step(max_delta_step)
    bounds = None
    if monotone:
        inf = np.inf
        bounds = NodeBounds(jnp.asarray([1, -1, 0, 1, 0, -1, 1, 0], jnp.int32),
                            jnp.asarray([-inf, -0.5, -inf, 0.0, -inf], jnp.float32),
                            jnp.asarray([inf, 0.3, 0.8, inf, inf], jnp.float32))
    scans = {prune: jax.jit(partial(find_best_splits, reg=reg, prune=prune, bounds=bounds)) for prune in (True, False)}
    pruned, full = (jax.tree.map(np.asarray, scans[prune](jnp.asarray(histograms), jnp.asarray(allowed),
                                                          min_child_weight=F32(min_child_weight)))
                    for prune in (True, False))
    for field, value in pruned._asdict().items():
        np.testing.assert_array_equal(value, getattr(full, field), err_msg=field)
    assert np.isfinite(full.loss_change[:3]).all()
    assert (full.loss_change[4] == -np.inf) == (min_child_weight > 4), "the smallest node splits unless its weight is too low"


def _nodes_with_a_signal(seed, n_features, sizes, signal, max_bin=32, code_step=1):
    """Histograms ``(nodes, n_features, max_bin, 2)`` of nodes of ``sizes`` rows: random bin
    codes (multiples of ``code_step``), gradients N(0, 1) plus ``signal(codes)``, Hessians in
    [0.2, 1]."""
    rng = np.random.default_rng(seed)
    node_index = np.repeat(np.arange(len(sizes)), sizes)
    codes = code_step * rng.integers(0, (max_bin - 1) // code_step, size=(len(node_index), n_features))
    g = (rng.normal(size=len(node_index)) + signal(codes)).astype(np.float32)
    h = rng.uniform(0.2, 1.0, size=len(node_index)).astype(np.float32)
    return jnp.asarray(_node_histograms(node_index, codes, g, h, max_bin))


def _custom_penalty(name):
    """``_CUSTOM_PENALTIES[name]`` as a regularizer with leaves known unbounded."""
    from jaxboost import regularizers

    penalty, params, reg_lambda, reg_alpha = _CUSTOM_PENALTIES[name]
    return regularizers.custom(penalty, params, reg_lambda=reg_lambda, reg_alpha=reg_alpha).with_max_delta_step(0.0)


def _contenders_give_the_full_scans_choice(monkeypatch, histograms, reg, bounds=None):
    """The full scan's choice (every feature allowed, no missing values) and the batches of
    contenders that the pruned scan solved, after checking that it gives that choice bit for
    bit (each batch's solve counted by a callback)."""
    from jaxboost import split as split_module

    arguments = (histograms, jnp.ones(histograms.shape[:2], bool))
    full = jax.jit(partial(find_best_splits, reg=reg, missing_values=False, bounds=bounds, prune=False))(
        *arguments, min_child_weight=F32(1.0))
    batches = []
    solve = split_module.value_and_score

    def counted_solve(*args, **kwargs):
        jax.debug.callback(lambda: batches.append(1))
        return solve(*args, **kwargs)

    monkeypatch.setattr(split_module, "value_and_score", counted_solve)
    pruned = jax.jit(partial(find_best_splits, reg=reg, missing_values=False, bounds=bounds))(
        *arguments, min_child_weight=F32(1.0))
    jax.effects_barrier()
    for field, value in pruned._asdict().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(full, field)), err_msg=field)
    return full, len(batches)


@pytest.mark.parametrize("value_ranges", ["bracketed", "unknown"])
def test_custom_penalty_contenders_keep_monotone_constraints(monkeypatch, value_ranges):
    """Under monotone constraints the strongest feature here is one whose split would break its
    direction, and one batch of contenders finds the best allowed one: with the children's
    value ranges, the candidates that certainly break it are never solved and 15 contenders a
    node suffice; with the ranges unknown, 63 contenders reach both features' best and the
    solved values rule out the breaking ones."""
    from jaxboost import split as split_module

    monkeypatch.setattr(split_module, "CONTENDERS_PER_NODE", 15 if value_ranges == "bracketed" else 63)
    if value_ranges == "unknown":
        monkeypatch.setattr(split_module, "leaf_value_range",
                            lambda g, *_: (jnp.full(g.shape, -jnp.inf), jnp.full(g.shape, jnp.inf)))
    # Higher gradients, so lower leaf values, with higher codes: both features' splits decrease,
    # feature 3's along a trend that many of its thresholds split about as well.
    histograms = _nodes_with_a_signal(4, 6, [3000, 1500], lambda codes: 2.0 * (codes[:, 1] > 15) + 0.25 * codes[:, 3])
    reg = _custom_penalty("smooth_l1")
    free = jax.jit(partial(find_best_splits, reg=reg, missing_values=False))(
        histograms, jnp.ones(histograms.shape[:2], bool), min_child_weight=F32(1.0))
    np.testing.assert_array_equal(np.asarray(free.feature), 3)  # without the constraints
    bounds = NodeBounds(jnp.asarray([0, -1, 0, 1, 0, 0], jnp.int32), jnp.full(2, -np.inf, jnp.float32),
                        jnp.full(2, np.inf, jnp.float32))
    choice, batches = _contenders_give_the_full_scans_choice(monkeypatch, histograms, reg, bounds)
    np.testing.assert_array_equal(np.asarray(choice.feature), 1)
    assert batches == 1


def test_custom_penalty_scan_solves_one_batch_of_contenders_where_a_split_stands_out(monkeypatch):
    """Where each node's best split stands out from the rest, one batch of contenders settles
    the scan."""
    histograms = _nodes_with_a_signal(3, 8, [3000, 800, 300], lambda codes: 3.0 * (codes[:, 1] > 15))
    choice, batches = _contenders_give_the_full_scans_choice(monkeypatch, histograms, _custom_penalty("prior"))
    np.testing.assert_array_equal(np.asarray(choice.feature), 1)
    assert batches == 1


def test_custom_penalty_contenders_take_the_node_score_solved_with_them(monkeypatch):
    """The contenders' bounds take a lower bound of the node's score (at the elastic net's leaf
    value); solved with the contenders, the node's score takes its place in the highest bound
    left unsolved. A linear penalty (its tangent exact, the children's bounds tight) moves the
    node's leaf value far from the elastic net's, and with one contender a node the next bound
    settles the scan at the first batch only with the node's solved score."""
    from jaxboost import regularizers, split as split_module

    monkeypatch.setattr(split_module, "CONTENDERS_PER_NODE", 1)
    histograms = _nodes_with_a_signal(6, 6, [3000, 900], lambda codes: 3.0 * (codes[:, 4] > 15))
    reg = regularizers.custom(lambda w, slope: slope * w, jnp.float32(300.0)).with_max_delta_step(0.0)
    choice, batches = _contenders_give_the_full_scans_choice(monkeypatch, histograms, reg)
    np.testing.assert_array_equal(np.asarray(choice.feature), [4, 2])
    assert batches == 1


def test_custom_penalty_contenders_skip_repeated_candidates_only(monkeypatch):
    """Rows only in every other bin: each threshold past an empty bin repeats the one before it,
    and the contenders' scan skips it. The best split is the first threshold, which repeats
    nothing, and the contenders find it, as the full scan does."""
    histograms = _nodes_with_a_signal(5, 4, [2000, 700], lambda codes: 4.0 * (codes[:, 1] == 0), code_step=2)
    choice, batches = _contenders_give_the_full_scans_choice(monkeypatch, histograms, _custom_penalty("smooth_l1"))
    np.testing.assert_array_equal(np.asarray(choice.feature), 1)
    np.testing.assert_array_equal(np.asarray(choice.threshold_bin), 0)
    assert batches == 1


def test_custom_penalty_contenders_walk_every_candidate_where_the_bounds_tell_nothing(monkeypatch):
    """Bounds that tell nothing (every candidate's the same, as a huge constant makes them):
    the batches take the candidates in index order, the lower index first among equal bounds,
    as top_k orders them, until every candidate is solved, and give the full scan's choice."""
    from jaxboost import split as split_module

    monkeypatch.setattr(split_module, "node_score_bounds", lambda g, *_: (jnp.full(g.shape, 1e30), jnp.zeros(g.shape)))
    n_features, max_bin = 6, 32
    histograms = _nodes_with_a_signal(7, n_features, [2000, 600], lambda codes: 1.0 * (codes[:, 3] > 20), max_bin)
    choice, batches = _contenders_give_the_full_scans_choice(monkeypatch, histograms, _custom_penalty("smooth_l1"))
    np.testing.assert_array_equal(np.asarray(choice.feature), 3)
    # Every threshold but the last (its right side empty) is valid in both nodes.
    candidates = n_features * (max_bin - 2)
    assert batches == -(-candidates // split_module.CONTENDERS_PER_NODE)
