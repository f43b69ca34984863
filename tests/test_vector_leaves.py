"""Vector leaves (``multi_strategy="multi_output_tree"``): the K x K Newton solve against a dense
NumPy solve, multi-channel histograms against NumPy, a grown tree's leaves against per-leaf
solves, whole models against XGBoost's ``multi_output_tree``, and the model machinery (save,
SHAP, importance) on a vector-leaf softmax model."""

import re
from functools import partial

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import xgboost as xgb

from conftest import assert_same_training, cpu_argument, each_kernel_simd, round_shape_and_arguments

import jaxboost as jb
from jaxboost.grower import GrowthParams, grow_tree
from jaxboost.histogram import build_statistics_histogram, route_and_build_statistics_histogram
from jaxboost.regularizer import MAX_FULL_TO_DIAGONAL_SCORE, VectorLeaves, packed_hessian_entries, vector_value_and_score

F32 = jnp.float32


def _dense_solution(G, H, reg_lambda):
    w = -np.linalg.solve(H + reg_lambda * np.eye(H.shape[-1]), G[..., None])[..., 0]
    return w, -np.einsum("...k,...k->...", G, w)  # score = G' (H + lambda I)^-1 G


def _random_psd(rng, batch, K):
    A = rng.normal(size=(batch, K, K))
    return np.einsum("bij,bkj->bik", A, A)


# The penalty as the user builds it (unbounded leaves not known when tracing: the score is the
# objective at the value) and as training passes it (known unbounded: the score read off the solve).
PENALTIES = [pytest.param(jb.regularizers.l2(1.0), id="bound-unknown"),
             pytest.param(jb.regularizers.l2(1.0).with_max_delta_step(0.0), id="unbounded")]


@pytest.mark.skipif(jb.native.native_target(jb.native.DAMPED_SOLVE_TARGET) is None,
                    reason="without the native kernels the full solve's own divisions are XLA code too")
def test_a_levels_diagonal_solution_compiles_to_loops_over_the_flattened_outputs():
    """A level's leaf values (few candidates): the diagonal solution's division runs over the
    candidates' outputs flattened into one axis, not over (candidates, K) arrays, whose short
    innermost loop LLVM unrolled in every fusion; the split scan's many candidates keep their
    shape (flattened, its rounds ran slower)."""
    from jaxboost.devices import compiler_options
    from jaxboost.regularizer import FLAT_CANDIDATES

    def divisions(candidates: int) -> set:
        K = 10
        leaves = VectorLeaves(K, solve_threads=1)
        G = cpu_argument((candidates, K), F32)
        packed = cpu_argument((candidates, leaves.hessian_channels), F32)
        text = jax.jit(lambda g, h: vector_value_and_score(g, h, jb.regularizers.l2(1.0), leaves),
                       compiler_options=compiler_options("cpu")).lower(G, packed).compile().as_text()
        return set(re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]*\} divide\(", text))

    assert divisions(96) == {"960"}, divisions(96)
    many = FLAT_CANDIDATES + 4
    assert f"{many},10" in divisions(many), divisions(many)


@pytest.mark.parametrize("K", [2, 5, 10])
def test_a_packed_hessian_holds_its_diagonal_first_and_every_entry_once(K):
    """The packed layout: the diagonal as the leading channels (``diagonal`` reads a slice), then
    the upper triangle's other entries; ``hessian_entries`` gives back every entry of the
    symmetric matrix, and the diagonal-only layout is the diagonal itself."""
    A = np.random.default_rng(K).normal(size=(3, K, K)).astype(np.float32)
    H = A + np.swapaxes(A, 1, 2)
    leaves = VectorLeaves(K)
    packed = np.asarray(leaves.pack_hessian(jnp.asarray(H)))
    assert packed.shape == (3, K * (K + 1) // 2)
    # The layout the native damped solve reads, written out as it walks it: the diagonal, then
    # each row's entries right of the diagonal (not the same index table the packing uses).
    entries = [(i, i) for i in range(K)] + [(i, j) for i in range(K) for j in range(i + 1, K)]
    assert list(zip(*(a.tolist() for a in packed_hessian_entries(K)))) == entries
    np.testing.assert_array_equal(packed, np.stack([H[:, i, j] for i, j in entries], axis=-1))
    np.testing.assert_array_equal(packed[:, :K], np.diagonal(H, axis1=1, axis2=2))
    np.testing.assert_array_equal(np.asarray(leaves.diagonal(jnp.asarray(packed))), np.diagonal(H, axis1=1, axis2=2))
    rebuilt = np.stack([np.stack([np.asarray(entry) for entry in row], axis=-1)
                        for row in leaves.hessian_entries(jnp.asarray(packed))], axis=-2)
    np.testing.assert_array_equal(rebuilt, H)
    assert sorted(np.abs(packed[0]).tolist()) == sorted(np.abs(H[0][np.triu_indices(K)]).tolist())
    diagonal_only = VectorLeaves(K, full_hessian=False)
    np.testing.assert_array_equal(np.asarray(diagonal_only.pack_hessian(jnp.asarray(H))),
                                  np.diagonal(H, axis1=1, axis2=2))


@pytest.mark.skipif(jb.native.native_target(jb.native.DAMPED_SOLVE_TARGET) is None or jax.default_backend() != "cpu",
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
@pytest.mark.parametrize("reg_lambda", [1.0, 0.0])
@pytest.mark.parametrize("K", [1, 2, 3, 10])
def test_native_damped_solve_is_the_element_wise_solve(K, reg_lambda, monkeypatch):
    """The CPU's native solve of full Hessians against the element-wise XLA one that the
    accelerators run: the same verdicts (positive definite, semi-definite only, indefinite,
    a zeroed row, no rows at all) and the same solutions up to rounding; candidates marked
    inactive come out 0 and not solvable; a vmapped call is the flat call. "auto" takes the
    native solve at every output count. Every variant of the kernel this CPU runs (AVX-512,
    AVX2, the baseline) solves alike."""
    from jaxboost.regularizer import PSD_TOLERANCE, damped_solve

    rng = np.random.default_rng(K)
    n = 300
    H = _random_psd(rng, n, K).astype(np.float32)
    H[:50] -= 2 * np.eye(K, dtype=np.float32)  # indefinite
    H[50:100, 0, :] = H[50:100, :, 0] = 0.0  # semi-definite with a null direction
    H[100:120] = 0.0  # no rows
    G = rng.normal(size=(n, K)).astype(np.float32)
    G[100:120] = 0.0
    leaves = VectorLeaves(K)
    packed = np.asarray(leaves.pack_hessian(jnp.asarray(H)))
    tolerance = (PSD_TOLERANCE * np.abs(np.diagonal(H, axis1=1, axis2=2)).max(axis=-1)).astype(np.float32)
    solve = lambda kernel, active=None: jax.jit(lambda g, p, t: damped_solve(g, p, reg_lambda, t, leaves, active,
                                                                            kernel=kernel))(G, packed, tolerance)
    assert jb.native.DAMPED_SOLVE_TARGET in jax.jit(
        lambda g, p, t: damped_solve(g, p, reg_lambda, t, leaves)).lower(G, packed, tolerance).as_text()
    w_xla, ok_xla = (np.asarray(a) for a in solve("xla"))
    assert 0 < ok_xla.sum() < n and ok_xla[100:120].all()
    # Rounding apart: on nearly singular systems (lambda 0) either path's solution is rounding.
    # Two float32 solves of a system of condition number c agree to about c x 6e-8 (10 outputs
    # at lambda 0 differ by up to 7e-5 of a value below c = 1e4).
    conditioned = ok_xla & (np.linalg.cond(H.astype(np.float64) + reg_lambda * np.eye(K)) < 1e4)
    assert conditioned.sum() > n // 3
    scale = np.abs(w_xla[conditioned]).max()
    for simd in each_kernel_simd(monkeypatch):
        w_native, ok_native = (np.asarray(a) for a in solve("native"))
        np.testing.assert_array_equal(ok_native, ok_xla, err_msg=simd or "widest")
        np.testing.assert_allclose(w_native[conditioned], w_xla[conditioned], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=simd or "widest")
    monkeypatch.delenv("JAXBOOST_KERNEL_SIMD")
    w_native, ok_native = (np.asarray(a) for a in solve("native"))
    active = rng.random(n) < 0.3
    active[:40] = False  # whole blocks of 16 skipped too
    w_some, ok_some = (np.asarray(a) for a in solve("native", jnp.asarray(active)))
    np.testing.assert_array_equal(w_some[active], w_native[active])
    np.testing.assert_array_equal(ok_some, ok_native & active)
    assert not w_some[~active].any()
    batched = jax.jit(jax.vmap(lambda g, p, t: damped_solve(g, p, reg_lambda, t, leaves, kernel="native")))
    w_batched, ok_batched = batched(G.reshape(3, 100, K), packed.reshape(3, 100, -1), tolerance.reshape(3, 100))
    np.testing.assert_array_equal(np.asarray(w_batched).reshape(n, K), w_native)
    np.testing.assert_array_equal(np.asarray(ok_batched).reshape(n), ok_native)


def _softmax_level_histograms(rng, K, num_nodes, n_features, max_bin):
    """A level's histograms of softmax rows' statistics (gradients, packed Hessians and the
    padding channel), summed by NumPy; each node holds its own rows, some with missing values."""
    leaves = VectorLeaves(K)
    width = K + leaves.hessian_channels
    histograms = np.zeros((num_nodes, n_features, max_bin, width + width % 2), np.float32)
    for node in range(num_nodes):
        rows = int(rng.integers(30, 600))
        p = np.exp(rng.normal(size=(rows, K)))
        p /= p.sum(axis=1, keepdims=True)
        g = p - np.eye(K)[rng.integers(0, K, rows)]
        H = np.einsum("nk,kl->nkl", p, np.eye(K)) - np.einsum("nk,nl->nkl", p, p)
        statistics = np.concatenate([g, np.asarray(leaves.pack_hessian(jnp.asarray(H)))], axis=1)
        for feature in range(n_features):
            codes = rng.integers(0, max_bin, rows)  # the last bin: missing values
            np.add.at(histograms[node, feature, :, :width], codes, statistics)
    return histograms


@pytest.mark.skipif(jb.native.native_target(jb.native.VECTOR_SPLIT_SCAN_TARGET) is None or jax.default_backend() != "cpu",
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
@pytest.mark.parametrize("K, bound, missing_values, per_feature_cost, threads", [
    (2, False, True, True, 1), (3, None, False, False, 2), (5, False, True, True, 1), (10, False, True, False, 1),
    (10, None, False, True, 3), (10, True, True, False, 1)])
def test_native_vector_split_scan_is_the_xla_scan(K, bound, missing_values, per_feature_cost, threads,
                                                 monkeypatch):
    """The native scan of a level of full-Hessian vector leaves chooses what the XLA scan around
    the native solve chooses (feature, bin, direction, and the children's sums bit for bit; the
    gain to float32 rounding, as the two sum a candidate's outputs in their own order), on nodes
    where min_child_weight and the column sample leave some candidates out and one node none;
    the nodes not scanned (past the live ones, or not active) are zeros, and a vmapped call is
    the calls one by one. Bounded leaves (max_delta_step) and unknown bounds score the full
    objective, known unbounded ones half its linear term. Threads share a level's (node,
    feature) pairs. Every output count takes the native kernels under "auto" (below 5 outputs
    the XLA code had compiled 0.4-0.8 s slower, and run no faster). Every variant of the kernel
    this CPU runs (AVX-512, AVX2, the baseline) chooses the same (their gains, summed over the
    outputs in vectors of their own widths, may differ in the last bit)."""
    from jaxboost.split import find_best_splits_of_live_nodes

    rng = np.random.default_rng(K)
    num_nodes, n_features, max_bin = 8, 5, 24
    histograms = _softmax_level_histograms(rng, K, num_nodes, n_features, max_bin)
    # Node 6: its first candidate valid (a heavy first bin), then NaN gradients there: a NaN first
    # gain is first_maximum's choice (NaN, the first candidate) whatever follows.
    histograms[6] *= 100
    histograms[6, 0, 0] = histograms[6, 0, :-1].sum(axis=0)
    histograms[6, 0, :, 0] = np.nan
    histograms = jnp.asarray(histograms)
    allowed = rng.random((num_nodes, n_features)) < 0.8
    allowed[6, 0] = True
    allowed[2] = False  # no candidate at all: -inf at the first one
    cost = np.linspace(0.0, 0.4, n_features) if per_feature_cost else 0.1
    reg = jb.regularizers.l2(1.0, split_cost=cost)
    reg = reg if bound is None else reg.with_max_delta_step(0.3 if bound else 0.0)
    leaves = VectorLeaves(K, solve_threads=threads)
    live = num_nodes - 1
    active = np.arange(num_nodes) != 4
    scanned = (np.arange(num_nodes) < live) & active

    def scan(kernel, histograms, reg):
        return find_best_splits_of_live_nodes(histograms, jnp.asarray(allowed), reg, F32(5.0), None, leaves,
                                              jnp.int32(live), missing_values, jnp.asarray(active), kernel=kernel)

    native_scan = jax.jit(partial(scan, "native"))
    xla = jax.tree_util.tree_map(np.asarray, jax.jit(partial(scan, "xla"))(histograms, reg))
    chosen = jax.jit(partial(scan, "auto")).lower(histograms, reg).as_text()
    assert jb.native.VECTOR_SPLIT_SCAN_TARGET in chosen
    for simd in each_kernel_simd(monkeypatch):
        native = jax.tree_util.tree_map(np.asarray, native_scan(histograms, reg))
        for field in ("feature", "threshold_bin", "default_left", "left_gradients", "left_hessians",
                      "right_gradients", "right_hessians"):
            np.testing.assert_array_equal(getattr(native, field)[scanned], getattr(xla, field)[scanned],
                                          err_msg=f"{field} ({simd or 'widest'})")
            assert not getattr(native, field)[~scanned].any(), field
        np.testing.assert_allclose(native.loss_change[scanned], xla.loss_change[scanned], rtol=2e-6,
                                   err_msg=simd or "widest")
        assert not native.loss_change[~scanned].any()
    monkeypatch.delenv("JAXBOOST_KERNEL_SIMD")
    native = jax.tree_util.tree_map(np.asarray, native_scan(histograms, reg))
    assert native.loss_change[2] == -np.inf and native.feature[2] == 0 and native.threshold_bin[2] == 0
    assert np.isnan(native.loss_change[6]) and native.feature[6] == 0 and native.threshold_bin[6] == 0
    assert np.isfinite(native.loss_change[scanned]).sum() >= 3
    if not missing_values:
        assert native.default_left[scanned].all()
    # Two models at once (train_many): a second lambda changes the gains.
    other = reg.replace(reg_lambda=F32(4.0))
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([jnp.asarray(a), jnp.asarray(b)]), reg, other)
    both = jax.jit(jax.vmap(partial(scan, "native"), in_axes=(None, 0)))(histograms, stacked)
    alone = jax.jit(partial(scan, "native"))(histograms, other)
    for batched, first, second in zip(both, native, alone):
        np.testing.assert_array_equal(np.asarray(batched), np.stack([first, np.asarray(second)]))
    assert not np.array_equal(native.loss_change, np.asarray(alone.loss_change))


@pytest.mark.skipif(jb.native.native_target(jb.native.VECTOR_SPLIT_SCAN_TARGET) is None or jax.default_backend() != "cpu",
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
def test_native_vector_split_scan_finds_a_split_at_every_lane_of_its_blocks():
    """The native scan takes its candidates 16 bins at a time: a node whose rows separate
    perfectly at bin b (class 0 up to it, class 1 past it) splits there, at the first and last
    lanes of a block, the last bin, and bin 0 with the missing values sent right, with the
    children's sums the XLA scan gives."""
    from jaxboost.split import find_best_splits_of_live_nodes

    K, max_bin = 3, 40  # 39 bins of values: blocks of 16, 16 and 7 candidates
    leaves = VectorLeaves(K)
    width = K + leaves.hessian_channels
    p = np.full(K, 1.0 / K)
    hessian = np.asarray(leaves.pack_hessian(jnp.asarray(np.diag(p) - np.outer(p, p))))
    # (threshold bin, missing values sent left), the best split of each node.
    splits = [(0, False), (14, True), (15, True), (16, False), (31, True), (32, True), (37, True), (38, False)]
    histograms = np.zeros((len(splits), 1, max_bin, width + width % 2), np.float32)
    for node, (threshold, missing_left) in enumerate(splits):
        for code in range(max_bin):
            label = (0 if missing_left else 1) if code == max_bin - 1 else int(code > threshold)
            histograms[node, 0, code, :width] = 20 * np.concatenate([p - np.eye(K)[label], hessian])
    reg = jb.regularizers.l2(1.0).with_max_delta_step(0.0)

    def scan(kernel, histograms):
        return find_best_splits_of_live_nodes(histograms, jnp.ones((len(splits), 1), bool), reg, F32(1.0), None,
                                              leaves, None, True, None, kernel=kernel)

    native, xla = (jax.tree_util.tree_map(np.asarray, jax.jit(partial(scan, kernel))(jnp.asarray(histograms)))
                   for kernel in ("native", "xla"))
    np.testing.assert_array_equal(native.threshold_bin, [threshold for threshold, _ in splits])
    np.testing.assert_array_equal(native.default_left, [missing_left for _, missing_left in splits])
    for field in ("threshold_bin", "default_left", "left_gradients", "left_hessians", "right_gradients",
                  "right_hessians"):
        np.testing.assert_array_equal(getattr(native, field), getattr(xla, field), err_msg=field)
    np.testing.assert_allclose(native.loss_change, xla.loss_change, rtol=2e-6)


@pytest.mark.skipif(jb.native.native_target(jb.native.VECTOR_SPLIT_SCAN_TARGET) is None or jax.default_backend() != "cpu",
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
def test_native_vector_split_scan_over_bins_without_rows_is_the_xla_scan():
    """The native scan solves only the candidates at bins that hold rows (and bin 0): one at a
    bin without rows has its predecessor's sides bit for bit. On nodes whose rows fill few bins,
    in runs that cross its blocks of 16, it chooses what the XLA scan (every candidate solved)
    chooses, the first bin of a run of equal gains: a node of two occupied bins, one of a single
    bin, a dense one, and bins whose rows' first gradient sums to exactly zero while their
    other channels do not (they hold rows: a test of the first channel alone would skip them)."""
    from jaxboost.split import find_best_splits_of_live_nodes

    K, max_bin = 2, 64  # 63 bins of values: blocks of 16, 16, 16 and 15 candidates
    leaves = VectorLeaves(K)
    width = K + leaves.hessian_channels
    rng = np.random.default_rng(5)
    hessian = np.asarray(leaves.pack_hessian(jnp.asarray(np.array([[1.0, 0.3], [0.3, 0.5]], np.float32))))
    occupied = {0: [0, 20, 21, 50, 63], 1: [40], 2: list(range(64)), 3: [5, 60], 4: [3, 17, 18, 33, 47, 63]}
    histograms = np.zeros((len(occupied), 1, max_bin, width + width % 2), np.float32)
    for node, bins in occupied.items():
        for code in bins:
            rows = int(rng.integers(2, 9))
            gradient = rng.normal(size=K).astype(np.float32) + (2.0 if code < 30 else -2.0)
            histograms[node, 0, code, :width] = rows * np.concatenate([gradient, hessian])
    histograms[4, 0, [17, 18], 0] = 0.0  # rows there, their first gradient summing to zero
    reg = jb.regularizers.l2(1.0)

    def scan(kernel, histograms):
        return find_best_splits_of_live_nodes(histograms, jnp.ones((len(occupied), 1), bool), reg, F32(1.0), None,
                                              leaves, None, True, None, kernel=kernel)

    native, xla = (jax.tree_util.tree_map(np.asarray, jax.jit(partial(scan, kernel))(jnp.asarray(histograms)))
                   for kernel in ("native", "xla"))
    for field in ("threshold_bin", "default_left", "left_gradients", "left_hessians", "right_gradients",
                  "right_hessians"):
        np.testing.assert_array_equal(getattr(native, field), getattr(xla, field), err_msg=field)
    np.testing.assert_allclose(native.loss_change, xla.loss_change, rtol=2e-6)
    # Each split at an occupied bin (the first of its run), node 1's none (one bin of rows).
    assert all(int(native.threshold_bin[node]) in bins for node, bins in occupied.items() if node != 1)
    assert np.isfinite(native.loss_change[[0, 2, 3, 4]]).all() and native.loss_change[1] == -np.inf
    assert native.threshold_bin[3] == 5


@pytest.mark.parametrize("reg", PENALTIES)
@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_full_solve_matches_dense_solve_and_minimises(K, reg):
    rng = np.random.default_rng(K)
    G, H = rng.normal(size=(200, K)), _random_psd(rng, 200, K) + 0.5 * np.eye(K)
    leaves = VectorLeaves(K)
    w, score = vector_value_and_score(jnp.asarray(G, F32), leaves.pack_hessian(jnp.asarray(H, F32)), reg, leaves)
    w_dense, score_dense = _dense_solution(G, H, 1.0)
    # The trust region: the full solve where it promises at most MAX_FULL_TO_DIAGONAL_SCORE x the
    # diagonal solve's decrease, the diagonal solve elsewhere.
    diagonal = np.diagonal(H, axis1=1, axis2=2) + 1.0
    diagonal_score = np.sum(G**2 / diagonal, axis=1)
    full = score_dense <= MAX_FULL_TO_DIAGONAL_SCORE * diagonal_score
    assert full.mean() > 0.5
    expected_w = np.where(full[:, None], w_dense, -G / diagonal)
    np.testing.assert_allclose(w, expected_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(score, np.where(full, score_dense, diagonal_score), rtol=1e-4, atol=1e-5)
    # The value is a stationary point of the penalised quadratic, and the score is -2 x its value there.
    w = np.asarray(w, np.float64)
    objective_gradient = G + np.einsum("bij,bj->bi", H + np.eye(K), w)
    np.testing.assert_allclose(objective_gradient[full], 0.0, atol=1e-4)
    curvature = np.where(full[:, None, None], H, H * np.eye(K)) + np.eye(K)
    objective = np.einsum("bk,bk->b", G, w) + 0.5 * np.einsum("bi,bij,bj->b", w, curvature, w)
    np.testing.assert_allclose(np.asarray(score), -2 * objective, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reg", PENALTIES)
def test_singular_softmax_hessian_is_solved_in_full_and_indefinite_falls_back_to_diagonal(reg):
    p = np.array([0.2, 0.3, 0.5])
    H = 50 * (np.diag(p) - np.outer(p, p))  # singular along (1, 1, 1), like a softmax leaf
    G = np.array([3.0, -1.0, -2.0])  # softmax gradients sum to 0: no component along the null direction
    leaves = VectorLeaves(3)
    w, score = vector_value_and_score(jnp.asarray(G, F32), leaves.pack_hessian(jnp.asarray(H, F32)), reg, leaves)
    w_dense, score_dense = _dense_solution(G, H, 1.0)
    np.testing.assert_allclose(w, w_dense, rtol=1e-4)
    np.testing.assert_allclose(score, score_dense, rtol=1e-4)

    indefinite = np.array([[4.0, 5.0], [5.0, 4.0]])  # eigenvalues 9 and -1
    G2 = np.array([1.0, -2.0])
    leaves2 = VectorLeaves(2)
    w, score = vector_value_and_score(jnp.asarray(G2, F32), leaves2.pack_hessian(jnp.asarray(indefinite, F32)),
                                      reg, leaves2)
    np.testing.assert_allclose(w, -G2 / 5.0, rtol=1e-6)
    np.testing.assert_allclose(score, np.sum(G2**2) / 5.0, rtol=1e-6)


def test_max_delta_step_clips_each_output_and_scores_the_clipped_value():
    leaves = VectorLeaves(2)
    G, H = np.array([-40.0, 6.0]), np.array([[3.0, 1.0], [1.0, 2.0]])
    reg = jb.regularizers.l2(1.0).replace(max_delta_step=F32(0.5))
    w, score = vector_value_and_score(jnp.asarray(G, F32), leaves.pack_hessian(jnp.asarray(H, F32)), reg, leaves)
    assert np.all(np.abs(np.asarray(w)) <= 0.5 + 1e-7)
    w = np.asarray(w, np.float64)
    np.testing.assert_allclose(score, -2 * (G @ w + 0.5 * w @ (H + np.eye(2)) @ w), rtol=1e-5)


def test_statistics_histograms_match_numpy():
    rng = np.random.default_rng(0)
    n, d, max_bin, C, nodes = 700, 3, 16, 5, 4
    X_binned_T = rng.integers(0, max_bin, size=(d, n)).astype(np.uint8)
    node_of_row = rng.integers(0, nodes, size=n).astype(np.int32)
    statistics = rng.normal(size=(n, C)).astype(np.float32)
    mask = rng.random(n) < 0.6

    def naive(node_index, rows):
        out = np.zeros((nodes, d, max_bin, C))
        for f in range(d):
            np.add.at(out, (node_index[rows], f, X_binned_T[f, rows].astype(int)), statistics[rows])
        return out

    histogram = build_statistics_histogram(jnp.asarray(X_binned_T), jnp.asarray(node_of_row), jnp.asarray(statistics),
                                           nodes, max_bin, jnp.asarray(mask))
    np.testing.assert_allclose(histogram, naive(node_of_row, mask), atol=1e-4)

    feature = rng.integers(0, d, size=nodes).astype(np.int32)
    threshold = rng.integers(0, max_bin - 1, size=nodes).astype(np.int32)
    default_left = rng.random(nodes) < 0.5
    splits = np.array([True, True, False, True])
    left_is_smaller = rng.random(nodes) < 0.5
    child, smaller = route_and_build_statistics_histogram(
        jnp.asarray(X_binned_T), jnp.asarray(node_of_row), jnp.asarray(statistics), jnp.asarray(feature),
        jnp.asarray(threshold), jnp.asarray(default_left), jnp.asarray(splits), jnp.asarray(left_is_smaller), max_bin)
    code = X_binned_T[feature[node_of_row], np.arange(n)]
    right = np.where(code == max_bin - 1, ~default_left[node_of_row], code > threshold[node_of_row])
    np.testing.assert_array_equal(child, 2 * node_of_row + right)
    in_smaller = splits[node_of_row] & (right != left_is_smaller[node_of_row])
    # Only the nodes that split have their smaller child summed (the native kernel leaves the
    # other nodes' cells of the first channel pair unwritten).
    np.testing.assert_allclose(np.asarray(smaller)[splits], naive(node_of_row, in_smaller)[splits], atol=1e-4)


def _coupled_softmax(raw_prediction, y):
    """A custom 3-class loss whose Hessian has off-diagonal entries (softmax's and a coupling)."""
    return (jax.nn.logsumexp(raw_prediction) - raw_prediction[y.astype(jnp.int32)]
            + raw_prediction[0] * raw_prediction[2])


@pytest.mark.parametrize("hessian_mode", ["exact", "floor", "constant"])
def test_round_statistics_pack_each_rows_weighted_hessian(monkeypatch, hessian_mode):
    """A vector-leaf round's statistics: each counted row's weighted gradient, then its Hessian
    packed as the trees read it (the diagonal, raised to the floor or replaced by 1 by the
    Hessian mode, then the upper triangle row by row, zero in the "constant" mode), all zero for
    a row of weight 0; against autodiff's per-row Hessians in NumPy."""
    from jaxboost import boosting

    rng = np.random.default_rng(4)
    n, K = 300, 3
    X = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, K, n).astype(np.float32)
    shape, arguments = round_shape_and_arguments(
        monkeypatch, X, y, loss=_coupled_softmax, num_outputs=K, multi_strategy="multi_output_tree",
        hessian="floor", hessian_floor=0.3)
    shape = shape._replace(hessian_mode=hessian_mode)
    params, y_rows, sample_weight, row_index, raw_prediction, *rest = (
        boosting.compiled_round(shape).program_arguments(arguments)[0])
    rows = raw_prediction.shape[0]  # the devices' rows, padded with rows of weight 0
    y = np.zeros(rows, np.float32)
    y[:n] = np.asarray(y_rows)[:n]
    raw_prediction = rng.normal(size=(rows, K)).astype(np.float32)
    row_weight = np.zeros(rows, np.float32)
    row_weight[:n] = rng.uniform(0.5, 2.0, n)
    row_weight[:n:7] = 0
    statistics_program = boosting.round_statistics_function(boosting.statistics_shape(shape))
    rows_spec = jax.sharding.PartitionSpec(boosting.ROW_AXIS)
    placed = [jax.device_put(row_weight, jax.sharding.NamedSharding(shape.mesh, rows_spec)),
              jax.device_put(raw_prediction, jax.sharding.NamedSharding(shape.mesh, rows_spec + (None,)))]
    (gradients, packed), _ = jax.jit(statistics_program)(params, y_rows, placed[0], row_index, placed[1], *rest)
    gradients, packed = np.asarray(gradients)[:n], np.asarray(packed)[:n]
    raw_prediction, y, row_weight = raw_prediction[:n], y[:n], row_weight[:n]

    per_row = jax.vmap(jax.hessian(_coupled_softmax))(jnp.asarray(raw_prediction), jnp.asarray(y))
    H = np.asarray(per_row, np.float64)
    g = np.asarray(jax.vmap(jax.grad(_coupled_softmax))(jnp.asarray(raw_prediction), jnp.asarray(y)), np.float64)
    diagonal = np.diagonal(H, axis1=1, axis2=2)
    upper = H[:, [0, 0, 1], [1, 2, 2]]
    assert np.abs(upper[:, 1]).min() > 0.5  # the coupling's entry is there to be read
    if hessian_mode == "floor":
        diagonal = np.maximum(diagonal, 0.3)
    elif hessian_mode == "constant":
        diagonal, upper = np.ones_like(diagonal), np.zeros_like(upper)
    w = row_weight[:, None]
    expected = np.concatenate([diagonal * w, upper * w], axis=1)
    np.testing.assert_allclose(packed[:, :2 * K], expected, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(gradients, g * w, rtol=2e-5, atol=1e-6)
    assert not packed[::7].any() and not gradients[::7].any()


@jax.custom_jvp
def _zero_with_nan_slope(x, flag):
    """0, whose derivative is NaN where ``flag`` > 0 and 0 elsewhere (its change along a zero
    tangent is 0, not NaN)."""
    return 0.0 * x


@_zero_with_nan_slope.defjvp
def _zero_with_nan_slope_jvp(primals, tangents):
    x, flag = primals
    tangent = tangents[0]
    return 0.0 * x, jnp.where((flag > 0) & (tangent != 0), jnp.nan, 0.0 * tangent)


@jax.custom_jvp
def _nan_coupling(a, b, flag):
    """0, with zero gradients, whose Hessian's (a, b) entry alone is NaN where ``flag`` > 0."""
    return 0.0 * a * b


@_nan_coupling.defjvp
def _nan_coupling_jvp(primals, tangents):
    a, b, flag = primals
    ta, tb, _ = tangents
    return 0.0 * a * b, _zero_with_nan_slope(b, flag) * ta + _zero_with_nan_slope(a, flag) * tb


def test_a_non_finite_off_diagonal_hessian_entry_stops_full_hessian_leaves():
    """A NaN Hessian entry off the diagonal (the loss's value, gradient and Hessian diagonal
    finite) stops a fit whose trees read it, the full Hessian's, with the error that names it;
    diagonal vector leaves never read it and train, and so do full ones where its row weighs
    nothing."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(400, 4)).astype(np.float32)
    y = rng.integers(0, 3, 400).astype(np.float32)
    y[17] = 5  # the one row whose Hessian has the NaN entry

    def loss(raw_prediction, label):
        flag = (label > 4).astype(jnp.float32)
        return (0.5 * jnp.sum(jnp.square(raw_prediction - jnp.minimum(label, 2.0)))
                + _nan_coupling(raw_prediction[0], raw_prediction[1], flag))

    H = jax.hessian(loss)(jnp.zeros(3), jnp.float32(5))
    assert np.isnan(H[0, 1]) and np.isfinite(np.diagonal(H)).all()
    assert np.isfinite(jax.hessian(loss)(jnp.zeros(3), jnp.float32(1))).all()
    settings = dict(loss=loss, num_outputs=3, multi_strategy="multi_output_tree", num_rounds=2, max_depth=2)
    with pytest.raises(FloatingPointError, match="non-finite"):
        jb.train(X, y, multi_output_hessian="full", **settings)
    model = jb.train(X, y, multi_output_hessian="diagonal", **settings)
    assert np.isfinite(model.predict(X)).all()
    weight = np.ones(len(y), np.float32)
    weight[17] = 0
    weightless = jb.train(jb.Dataset(X, y, sample_weight=weight), multi_output_hessian="full", **settings)
    assert np.isfinite(weightless.predict(X)).all()


def test_grown_vector_tree_leaves_are_the_per_leaf_solves():
    rng = np.random.default_rng(1)
    n, d, max_bin, K = 3000, 3, 16, 3
    X_binned_T = rng.integers(0, max_bin - 1, size=(d, n)).astype(np.uint8)
    g = rng.normal(size=(n, K)) + 0.5 * (X_binned_T[0] > 7)[:, None]
    H = _random_psd(rng, n, K) / K + 0.1 * np.eye(K)
    leaves = VectorLeaves(K)
    params = GrowthParams(jb.regularizers.l2(1.0), F32(0.3), F32(0), F32(1.0), F32(1), F32(1))
    grow = jax.jit(lambda X, g, h: grow_tree(X, g, h, jnp.ones(d, bool), jax.random.PRNGKey(0), params, 3, max_bin,
                                             None, False, leaves))
    tree, row_leaves, _, _ = grow(jnp.asarray(X_binned_T), jnp.asarray(g, F32), leaves.pack_hessian(jnp.asarray(H, F32)))
    row_leaf = np.asarray(row_leaves.heap_index())
    assert len(np.unique(row_leaf)) >= 4
    for leaf in np.unique(row_leaf):
        rows = row_leaf == leaf
        assert tree.is_leaf[leaf]
        w_dense, _ = _dense_solution(g[rows].sum(0), H[rows].sum(0), 1.0)
        np.testing.assert_allclose(tree.value[leaf], 0.3 * w_dense, rtol=2e-3, atol=1e-5)
        np.testing.assert_allclose(tree.sum_hessians[leaf], np.diagonal(H[rows].sum(0)), rtol=1e-4)
    # The root's loss_chg is the drop of the objective its children reach.
    feature, threshold = int(tree.feature[0]), int(tree.threshold_bin[0])
    left = X_binned_T[feature] <= threshold
    scores = [_dense_solution(g[rows].sum(0), H[rows].sum(0), 1.0)[1] for rows in (left, ~left, np.ones(n, bool))]
    np.testing.assert_allclose(tree.loss_change[0], scores[0] + scores[1] - scores[2], rtol=1e-3)


@pytest.mark.skipif(jb.native.native_target(jb.native.CHANNEL_HISTOGRAM_TARGET) is None,
                    reason="the native kernels are not built here")
@pytest.mark.parametrize("K, full_hessian, depth, by_pairs, routed_apart",
                         [(3, False, 4, True, False), (2, True, 4, True, False), (4, False, 4, False, True),
                          (2, True, 8, True, True)])
def test_narrow_childrens_histograms_are_built_by_pairs(K, full_hessian, depth, by_pairs, routed_apart, monkeypatch):
    """On CPU a level's children of at most ``CHILDREN_PAIR_PASSES_MAX_WIDTH`` (6) channels (3
    classes' diagonal, 2 outputs' full Hessian: 5 channels and a zero one) are built by pair
    passes, no channel kernel in the tree's program: in a tree's first levels (at most
    ``ROUTED_NARROW_PARENTS_MAX`` parents) with the first pair summed while the rows are routed,
    in the deep levels (depth 8) after a routing pass of their own. Wider cells (4 classes'
    diagonal, 8 channels) take the channel kernel, after a routing pass. Either way the tree is
    the one the channel kernel grows, bit for bit."""
    from jaxboost import grower, histogram
    routed_first = []  # a routing pass of its own, the children summed after it

    def route_to_children(*args, **kwargs):
        routed_first.append(True)
        return histogram.route_to_children(*args, **kwargs)

    monkeypatch.setattr(grower, "route_to_children", route_to_children)
    rng = np.random.default_rng(K)
    n, d, max_bin = 4000, 5, 64
    X_binned_T = jnp.asarray(rng.integers(0, max_bin - 1, size=(d, n)).astype(np.uint8))
    g = rng.normal(size=(n, K)) + (np.asarray(X_binned_T[:2]).T > 30) @ rng.normal(size=(2, K))
    leaves = VectorLeaves(K, full_hessian=full_hessian)
    hessians = leaves.pack_hessian(jnp.asarray(_random_psd(rng, n, K) / K + 0.1 * np.eye(K), F32))
    params = GrowthParams(jb.regularizers.l2(1.0), F32(0.3), F32(0), F32(1.0), F32(1), F32(1))

    def grown():
        grow = jax.jit(lambda X, g, h: grow_tree(X, g, h, jnp.ones(d, bool), jax.random.PRNGKey(0), params, depth,
                                                 max_bin, None, False, leaves)[0])
        arguments = (X_binned_T, jnp.asarray(g, F32), hessians)
        return grow.lower(*arguments).as_text(), grow(*arguments)

    lowered, tree = grown()
    channel_kernel = re.search(rf"@{histogram.CHANNEL_HISTOGRAM_TARGET}\b", lowered) is not None
    assert channel_kernel != by_pairs and any(routed_first) == routed_apart
    monkeypatch.setattr(histogram, "CHILDREN_PAIR_PASSES_MAX_WIDTH", 0)
    monkeypatch.setattr(histogram, "ROOT_PAIR_PASSES_MAX_WIDTH", 0)
    lowered, by_channel_kernel = grown()
    assert re.search(rf"@{histogram.CHANNEL_HISTOGRAM_TARGET}\b", lowered) is not None
    assert np.asarray(tree.is_leaf).sum() >= 6
    for field, expected in zip(tree, by_channel_kernel):
        np.testing.assert_array_equal(np.asarray(field), np.asarray(expected))


def _integer_data(n=3000, seed=0):
    # Few distinct values per feature: each value is its own bin in jaxboost and XGBoost.
    rng = np.random.default_rng(seed)
    X = rng.integers(0, 30, size=(n, 4)).astype(np.float32)
    Y = np.stack([X[:, 0] + 0.3 * rng.normal(size=n), 2 * np.sin(X[:, 1] / 5) + X[:, 0]], axis=1).astype(np.float32)
    return X, Y


@pytest.mark.parametrize("multi_output_hessian", ["full", "diagonal"])
def test_multi_output_tree_matches_xgboost(multi_output_hessian):
    """A two-target squared error (identity Hessians: full and diagonal coincide) against
    XGBoost's multi_output_tree, both starting from 0. Labels are row ids that the loss looks
    up, since jaxboost labels are one value per row."""
    X, Y = _integer_data()
    targets = jnp.asarray(Y)

    def two_target_squared_error(raw_prediction, row):
        return 0.5 * jnp.sum((raw_prediction - targets[row.astype(jnp.int32)]) ** 2)

    zeros = np.zeros_like(Y)
    model = jb.train(X, np.arange(len(Y), dtype=np.float32), loss=two_target_squared_error, num_outputs=2,
                     num_rounds=10, max_depth=3, multi_strategy="multi_output_tree",
                     multi_output_hessian=multi_output_hessian, base_margin=zeros)
    booster = xgb.train(dict(tree_method="hist", multi_strategy="multi_output_tree", max_depth=3, learning_rate=0.1,
                             reg_lambda=1.0, max_bin=256, base_score=0.0, nthread=2), xgb.DMatrix(X, Y), 10)
    expected = booster.predict(xgb.DMatrix(X), output_margin=True)
    np.testing.assert_allclose(model.predict_raw(X, base_margin=zeros), expected, atol=2e-5)
    # One tree per round: the K stored trees share every split.
    for field in ("feature", "threshold_bin", "is_leaf", "default_left"):
        stored = getattr(model.trees, field)
        np.testing.assert_array_equal(stored[:, 0], stored[:, 1])


@pytest.fixture(scope="module")
def softmax_model(data):
    X, signal, rng, _ = data
    y = np.digitize(signal + 0.3 * rng.normal(size=signal.shape), [-0.5, 1.0])
    model = jb.train(X, y, loss="softmax", num_rounds=8, max_depth=3, learning_rate=0.3,
                     multi_strategy="multi_output_tree")
    return model, X, y


def test_softmax_vector_tree_model_trains_saves_and_explains(softmax_model, tmp_path):
    model, X, y = softmax_model
    probabilities = model.predict(X)
    start = np.log(np.bincount(y) / len(y))
    assert -np.mean(np.log(probabilities[np.arange(len(y)), y])) < -np.mean(start[y]) - 0.2
    assert model.params["multi_strategy"] == "multi_output_tree"

    path = tmp_path / "vector.json"
    model.save(path)
    loaded = jb.load(path)
    assert loaded.params["multi_strategy"] == "multi_output_tree"
    np.testing.assert_array_equal(loaded.predict_raw(X), model.predict_raw(X))

    contributions = model.predict_contributions(X[:50])
    np.testing.assert_allclose(contributions.sum(axis=-1), model.predict_raw(X[:50]), atol=1e-4)

    # Importance counts each vector-leaf split once.
    weights = model.feature_importance("weight")
    splits = ~model.trees.is_leaf[:, 0] & (model.trees.loss_change[:, 0] > 0)
    assert sum(weights.values()) == int(splits.sum())


def test_gaussian_vector_tree_recovers_the_noise_scale():
    rng = np.random.default_rng(3)
    X = rng.uniform(size=(4000, 3)).astype(np.float32)
    sigma = 0.2 + X[:, 0]
    y = (np.sin(3 * X[:, 1]) + sigma * rng.normal(size=4000)).astype(np.float32)
    model = jb.train(X, y, loss="gaussian_nll", num_rounds=150, max_depth=3, learning_rate=0.1,
                     min_child_weight=5.0, multi_strategy="multi_output_tree")
    predicted_sigma = model.predict(X)[:, 1]
    assert np.median(np.abs(predicted_sigma / sigma - 1)) < 0.12


def test_vector_leaf_settings_are_checked(data):
    X, signal, _, _ = data
    y = (signal > 0).astype(np.float64)
    with pytest.raises(ValueError, match="monotone"):
        jb.train(X, y, loss="gaussian_nll", num_rounds=1, multi_strategy="multi_output_tree",
                 monotone_constraints=[1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="reg_lambda > 0"):
        jb.train(X, y, loss="gaussian_nll", num_rounds=1, multi_strategy="multi_output_tree", reg_lambda=0.0)
    with pytest.raises(ValueError, match="multi_output_hessian"):
        jb.train(X, y, loss="gaussian_nll", num_rounds=1, multi_strategy="multi_output_tree",
                 multi_output_hessian="block")
    with pytest.raises(ValueError, match="multi_strategy"):
        jb.train(X, y, num_rounds=1, multi_strategy="vector")


@pytest.mark.parametrize("thresholds", [[-0.5, 1.0], [-1.0, -0.3, 0.4, 1.2]])  # 3 classes; 5: the native solve
def test_train_many_vector_trees_equal_models_trained_alone(data, thresholds):
    X, signal, rng, _ = data
    y = np.digitize(signal + 0.3 * rng.normal(size=signal.shape), thresholds)
    settings = dict(loss="softmax", num_rounds=3, max_depth=3, multi_strategy="multi_output_tree")
    models = jb.train_many(X, y, batch={"reg_lambda": np.array([0.5, 4.0])}, **settings)
    for model, reg_lambda in zip(models, [0.5, 4.0]):
        alone = jb.train(X, y, reg_lambda=reg_lambda, **settings)
        np.testing.assert_array_equal(model.trees.feature, alone.trees.feature)
        np.testing.assert_allclose(model.predict_raw(X), alone.predict_raw(X), atol=1e-5)
    assert not np.allclose(models[0].predict_raw(X), models[1].predict_raw(X))


def test_sklearn_classifier_takes_multi_strategy(softmax_model):
    from jaxboost.sklearn import JaxBoostClassifier

    model, X, y = softmax_model
    classifier = JaxBoostClassifier(n_estimators=8, max_depth=3, learning_rate=0.3,
                                    multi_strategy="multi_output_tree").fit(X, y)
    np.testing.assert_allclose(classifier.predict_proba(X), model.predict(X), atol=1e-6)


def test_one_output_multi_output_tree_is_the_ordinary_tree(data):
    X, signal, _, _ = data
    settings = dict(loss="absolute_error", num_rounds=3, max_depth=3)
    vector = jb.train(X, signal, multi_strategy="multi_output_tree", **settings)
    assert_same_training(vector.predict_raw(X), jb.train(X, signal, **settings).predict_raw(X))


def test_vector_leaf_refit_lowers_the_true_loss():
    """First-order vector leaves (constant Hessians) refit on the true loss by coordinate
    descent over the outputs: one full-step round reaches a lower loss than without refit."""
    rng = np.random.default_rng(4)
    X = rng.normal(size=(3000, 3)).astype(np.float32)
    y = (X[:, 0] + rng.normal(size=3000) * (0.3 + (X[:, 1] > 0))).astype(np.float32)

    def training_loss(model):
        raw = jnp.asarray(model.predict_raw(X))
        return float(jnp.mean(jax.vmap(jb.losses.gaussian_nll)(raw, jnp.asarray(y))))

    settings = dict(loss="gaussian_nll", num_rounds=1, max_depth=2, learning_rate=1.0, hessian="constant",
                    multi_strategy="multi_output_tree")
    refit = jb.train(X, y, leaf_refit=True, **settings)
    plain = jb.train(X, y, leaf_refit=False, **settings)
    assert training_loss(refit) < training_loss(plain) - 0.01


def test_continuation_keeps_the_tree_mode(softmax_model):
    model, X, y = softmax_model
    with pytest.raises(ValueError, match="multi_strategy='multi_output_tree'"):
        jb.train(X, y, loss="softmax", num_rounds=1, max_depth=3, init_model=model)
    continued = jb.train(X, y, loss="softmax", num_rounds=2, max_depth=3, learning_rate=0.3, init_model=model,
                         multi_strategy="multi_output_tree")
    assert continued.num_rounds == model.num_rounds + 2


def _full_or_diagonal_scores(G, H, reg_lambda):
    """float64 scores of vector leaves: the full solve's unless it promises more than
    MAX_FULL_TO_DIAGONAL_SCORE times the diagonal's (softmax sums are PSD, so no other fallback)."""
    _, full = _dense_solution(G, H, reg_lambda)
    diagonal = np.sum(G ** 2 / (np.diagonal(H, axis1=-2, axis2=-1) + reg_lambda), axis=-1)
    return np.where(full <= MAX_FULL_TO_DIAGONAL_SCORE * diagonal, full, diagonal)


@pytest.mark.parametrize("start_ulps", [0, 1])
def test_full_hessian_splits_are_the_best_by_a_float64_scan(start_ulps, monkeypatch):
    """A later round of a softmax vector-leaf model (rows' Hessians differ by then): every split's
    loss_chg is its gain recomputed in float64 from the rows, and no other candidate of its node
    gains more. With the starting value one float32 step up (as another order of its sums gives),
    a candidate's left child (620 rows, its Hessian singular along (1, ..., 1)) had summed to a
    Cholesky pivot of -1.06e-5 of its largest diagonal entry, past the PSD test's tolerance then:
    the diagonal's score replaced the full one's, a gain of 394 where the rows give 350, and the
    tree split on that candidate. (XLA's YNNPACK fusions had moved the rounding there too.)"""
    from sklearn.datasets import load_digits

    from jaxboost import training

    found = training._starting_value

    def nudged(*args):
        start = np.asarray(found(*args), np.float32)
        return np.nextafter(start, np.float32(np.inf)) if start_ulps else start

    monkeypatch.setattr(training, "_starting_value", nudged)
    X, y = load_digits(return_X_y=True)
    X, y = X.astype(np.float32), y.astype(np.float32)
    dataset = jb.Dataset(X, y)
    model = jb.train(dataset, loss="softmax", num_rounds=4, max_depth=4, multi_strategy="multi_output_tree")
    raw = model[:3].predict_raw(X).astype(np.float64)
    p = np.exp(raw - raw.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = p - np.eye(10)[y.astype(int)]
    H = np.einsum("nk,kl->nkl", p, np.eye(10)) - np.einsum("nk,nl->nkl", p, p)
    codes = np.asarray(dataset.X_binned)
    tree = jax.tree_util.tree_map(lambda field: np.asarray(field)[3, 0], model.trees)
    rows_of = {0: np.ones(len(y), bool)}
    checked = 0
    for node in range(15):
        if node not in rows_of or tree.is_leaf[node]:
            continue
        rows = rows_of[node]
        feature, threshold = int(tree.feature[node]), int(tree.threshold_bin[node])
        goes_left = codes[:, feature] <= threshold
        rows_of[2 * node + 1], rows_of[2 * node + 2] = rows & goes_left, rows & ~goes_left
        # Every candidate (feature, threshold) of the node: children's sums from running sums over bins.
        bins = int(codes.max()) + 1
        G_bins = np.zeros((codes.shape[1], bins, 10))
        H_bins = np.zeros((codes.shape[1], bins, 10, 10))
        for f in range(codes.shape[1]):
            np.add.at(G_bins[f], codes[rows, f], g[rows])
            np.add.at(H_bins[f], codes[rows, f], H[rows])
        G_left, H_left = np.cumsum(G_bins, axis=1)[:, :-1], np.cumsum(H_bins, axis=1)[:, :-1]
        G_node, H_node = g[rows].sum(0), H[rows].sum(0)
        parent = _full_or_diagonal_scores(G_node, H_node, 1.0)
        gains = (_full_or_diagonal_scores(G_left, H_left, 1.0)
                 + _full_or_diagonal_scores(G_node - G_left, H_node - H_left, 1.0) - parent)
        hessian_left = np.diagonal(H_left, axis1=-2, axis2=-1).min(-1)
        hessian_right = np.diagonal(H_node - H_left, axis1=-2, axis2=-1).min(-1)
        gains = np.where((hessian_left >= 1.0) & (hessian_right >= 1.0), gains, -np.inf)  # min_child_weight
        np.testing.assert_allclose(tree.loss_change[node], gains[feature, threshold], rtol=1e-3,
                                   err_msg=f"node {node}: loss_chg is not its split's float64 gain")
        assert tree.loss_change[node] >= gains.max() * (1 - 1e-3), f"node {node}: a candidate gains more"
        checked += 1
    assert checked >= 3
