"""Prediction on raw features (the native CPU kernel) against the binned XLA predictor.

On CPU, ``Model.predict_raw`` walks raw float32 features against the splits' bin edges
(``x < edge`` goes left, NaN takes the default direction) instead of binning first; it must give
bit-identical raw predictions to the binned path, which GPU/TPU and the training loop use.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import predictor
from jaxboost.binning import apply_bins
from jaxboost.native import feature_predictor_available

pytestmark = pytest.mark.skipif(not feature_predictor_available(),
                                reason="the native kernels could not be built here; the binned path is tested elsewhere")


def binned_prediction(model, X, iteration_range=None, base_margin=None):
    start, stop = model._rounds(iteration_range)
    trees = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a)[start:stop]), model.trees)
    initial = (np.broadcast_to(model.base_score, (len(X), model.num_outputs)) if base_margin is None
               else np.asarray(base_margin, np.float32).reshape(len(X), -1))
    raw = np.asarray(jax.jit(predictor._predict_raw_local, static_argnums=3)(
        trees, jnp.asarray(apply_bins(X, model.bin_edges)), jnp.asarray(initial, jnp.float32),
        model.bin_edges.missing_bin))
    return raw[:, 0] if model.num_outputs == 1 else raw


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(3000, 6)).astype(np.float32)
    X[rng.random(X.shape) < 0.1] = np.nan
    X[:, 5] = np.where(rng.random(3000) < 0.5, np.nan, 1.0)  # splits on it use a padded +inf edge
    signal = np.nan_to_num(X[:, 0]) - np.nan_to_num(X[:, 1]) ** 2 + 1.5 * np.isnan(X[:, 5])
    return X, signal


@pytest.mark.parametrize("loss", ["squared_error", "logistic", "softmax"])
def test_raw_feature_prediction_equals_binned_prediction_exactly(data, loss):
    X, signal = data
    y = {"squared_error": signal, "logistic": (signal > 0).astype(np.float32),
         "softmax": np.digitize(signal, [-1.0, 0.5]).astype(np.float32)}[loss]
    model = jb.train(X, y, loss=loss, num_rounds=8, max_depth=4, learning_rate=0.3)
    assert np.any(model.trees.feature[~model.trees.is_leaf & (model.trees.loss_change > 0)] == 5)
    X_new = np.random.default_rng(9).normal(size=(777, 6)).astype(np.float32)
    X_new[::5, 2] = np.nan
    X_new[::3, 5] = np.nan
    for rows in (X, X_new):
        np.testing.assert_array_equal(model.predict_raw(rows), binned_prediction(model, rows))
    np.testing.assert_array_equal(model.predict_raw(X_new, iteration_range=(2, 6)),
                                  binned_prediction(model, X_new, iteration_range=(2, 6)))


def test_base_margin_and_fallback(data, monkeypatch):
    X, signal = data
    model = jb.train(X, signal, num_rounds=5, max_depth=3, base_margin=np.full(len(X), 0.5))
    margin = np.linspace(-1, 1, len(X))
    native = model.predict_raw(X, base_margin=margin)
    np.testing.assert_array_equal(native, binned_prediction(model, X, base_margin=margin))
    monkeypatch.setenv("JAXBOOST_NATIVE", "0")
    np.testing.assert_array_equal(model.predict_raw(X, base_margin=margin), native)


def test_a_split_on_a_missing_feature_is_an_error_not_a_crash(data):
    X, signal = data
    model = jb.train(X, signal, num_rounds=2, max_depth=3)
    feature = np.array(model.trees.feature)
    feature[0, 0, 0] = 99
    broken = dataclasses.replace(model, trees=model.trees._replace(feature=feature))
    with pytest.raises(Exception, match="out of range"):
        broken.predict_raw(X)


@pytest.mark.parametrize("simd", ["", "avx2", "none"])
def test_every_cpu_kernel_matches_the_binned_path(data, simd, monkeypatch):
    """The AVX-512, AVX2 and scalar walks (picked at run time; narrowed by the environment) on
    trees with leaves above the last level, depths 1 to 7 (more than the 3 levels the vector
    kernels pick from a block) and row counts that leave partial 64-row blocks."""
    monkeypatch.setenv("JAXBOOST_PREDICT_SIMD", simd)
    X, signal = data
    rows = np.random.default_rng(11).normal(size=(200, 6)).astype(np.float32)
    rows[::4, 0] = np.nan
    rows[::7, 1] = 40.0  # beyond every bin edge
    for depth, min_child_weight in ((1, 1.0), (4, 1.0), (7, 150.0)):
        model = jb.train(X, signal, num_rounds=6, max_depth=depth, learning_rate=0.5,
                         min_child_weight=min_child_weight)
        if depth == 7:  # leaves above the last level are re-laid as pass-through splits
            assert np.any(model.trees.is_leaf[:, :, :(1 << depth) - 1])
        for n in (1, 63, 65, 200):
            np.testing.assert_array_equal(model.predict_raw(rows[:n]), binned_prediction(model, rows[:n]))


@pytest.mark.parametrize("simd", ["", "avx2", "none"])
def test_vector_leaf_trees_are_walked_once_a_round_and_match_the_binned_path(data, simd, monkeypatch):
    """A vector-leaf model keeps K trees a round with the same splits: each kernel walks the
    first and reads the K leaves where the row ended (the same sums, in the same order). Trees
    of a round whose splits differ (one threshold moved here) are walked one by one."""
    monkeypatch.setenv("JAXBOOST_PREDICT_SIMD", simd)
    X, signal = data
    y = np.digitize(signal, [-1.0, 0.5]).astype(np.float32)
    model = jb.train(X, y, loss="softmax", num_rounds=5, max_depth=5, learning_rate=0.5, min_child_weight=40.0,
                     multi_strategy="multi_output_tree")
    trees = model.trees
    assert np.all(trees.threshold_bin == trees.threshold_bin[:, :1]) and np.all(trees.feature == trees.feature[:, :1])
    assert np.any(trees.is_leaf[:, :, :(1 << 5) - 1])  # leaves above the last level, re-laid
    threshold_bin = np.array(trees.threshold_bin)
    assert not trees.is_leaf[2, 1, 0]
    threshold_bin[2, 1, 0] = threshold_bin[2, 1, 0] // 2 if threshold_bin[2, 1, 0] > 20 else 40
    # Round 2's second tree now has its own root split.
    moved = dataclasses.replace(model, trees=trees._replace(threshold_bin=threshold_bin))
    rows = np.random.default_rng(13).normal(size=(200, 6)).astype(np.float32)
    rows[::4, 0] = np.nan
    rows[::5, 5] = np.nan
    for candidate in (model, moved):
        for n in (1, 65, 200):
            np.testing.assert_array_equal(candidate.predict_raw(rows[:n]), binned_prediction(candidate, rows[:n]))
    assert not np.array_equal(moved.predict_raw(rows), model.predict_raw(rows))


def test_native_walk_over_several_threads_matches_the_binned_path(data):
    """The host walk splits the rows into ranges of whole 64-row blocks, one per thread: any
    number of threads (more than there are blocks, too) gives the binned path's predictions,
    for every row, with the partial block at the end."""
    X, signal = data
    model = jb.train(X, np.digitize(signal, [-1.0, 0.5]).astype(np.float32), loss="softmax", num_rounds=5,
                     max_depth=4)
    rows = np.random.default_rng(12).normal(size=(1037, 6)).astype(np.float32)
    rows[::9, 3] = np.nan
    expected = binned_prediction(model, rows)
    forest = model._native_forest(0, model.num_rounds)
    for threads in (1, 2, 3, 7, 40):
        raw = np.array(np.broadcast_to(model.base_score, (len(rows), model.num_outputs)), np.float32, order="C")
        forest.add_to(rows, raw, threads)
        np.testing.assert_array_equal(raw, expected, err_msg=f"{threads} threads")


def test_prepared_forests_follow_the_rounds_asked_for_and_the_model_stays_unchanged(data):
    """What the native predictor prepares from a model is kept per range of rounds: predictions
    over other ranges, before and after, equal the binned path on that model slice; the model's
    arrays refuse in-place writes (which would leave them stale), and a pickled model carries no
    prepared arrays."""
    import pickle

    X, signal = data
    model = jb.train(X, signal, num_rounds=6, max_depth=3)
    rows = np.random.default_rng(3).normal(size=(300, 6)).astype(np.float32)
    for start, stop in [(0, 6), (0, 2), (3, 5), (0, 6), (2, 2)]:
        np.testing.assert_array_equal(model.predict_raw(rows, iteration_range=(start, stop)),
                                      binned_prediction(model[start:stop], rows), err_msg=f"rounds {start}-{stop}")
    assert set(model._prepared_forests) == {(0, 6), (0, 2), (3, 5), (2, 2)}
    with pytest.raises(ValueError, match="read-only"):
        model.trees.value[0, 0, 0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        model.bin_edges.edges[0, 0] = 1.0
    copy = pickle.loads(pickle.dumps(model))
    assert copy._prepared_forests == {}
    np.testing.assert_array_equal(copy.predict_raw(rows), model.predict_raw(rows))


def test_threads_predicting_at_once_share_the_prepared_forests(data):
    """Serving threads predict on one model at once (the native walk runs without the GIL),
    over ranges of rounds that fill and clear the model's prepared forests: every prediction
    equals the one made alone."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxboost import model as model_module

    X, signal = data
    model = jb.train(X, signal, num_rounds=12, max_depth=3)
    rows = np.random.default_rng(4).normal(size=(500, 6)).astype(np.float32)
    ranges = [(0, stop) for stop in range(1, 13)] * 4
    expected = {r: binned_prediction(model[r[0]:r[1]], rows) for r in set(ranges)}
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: (r, model.predict_raw(rows, iteration_range=r)), ranges))
    for r, prediction in results:
        np.testing.assert_array_equal(prediction, expected[r], err_msg=f"rounds {r}")
    assert len(model._prepared_forests) <= model_module.MAX_PREPARED_FORESTS


def test_native_forest_refuses_bad_trees_and_rows(data):
    """The native predictor checks the trees once, when they are prepared (a split on a feature
    the data do not have, a heap that is not full), and each call's rows (their feature count,
    their dtype)."""
    from jaxboost.native import NativeForest

    X, signal = data
    model = jb.train(X, signal, num_rounds=3, max_depth=3)
    forest = model._native_forest(0, 3)
    packed = np.ascontiguousarray(predictor.packed_nodes(model.trees), np.int32)
    thresholds = np.zeros(packed.shape, np.float32)
    values = np.ascontiguousarray(model.trees.value, np.float32)
    split = tuple(np.argwhere(~np.asarray(model.trees.is_leaf))[0])
    bad = packed.copy()
    bad[split] = (X.shape[1] + 2) << 10
    with pytest.raises(ValueError, match="split feature out of range"):
        NativeForest(bad, thresholds, values, X.shape[1])
    with pytest.raises(ValueError, match="not a full heap"):
        NativeForest(packed[..., :-1].copy(), thresholds[..., :-1].copy(), values[..., :-1].copy(), X.shape[1])
    raw = np.zeros((5, 1), np.float32)
    with pytest.raises(ValueError, match=r"X \(5, 7\) for 6 features"):
        forest.add_to(np.zeros((5, 7), np.float32), raw, 1)
    with pytest.raises(TypeError, match="float32 or float64"):
        forest.add_to(np.zeros((5, X.shape[1]), np.int32), raw, 1)
    with pytest.raises(TypeError, match="C-contiguous float32 raw"):
        forest.add_to(X[:5], np.zeros((5, 1), np.float64), 1)
    raw[:] = model.base_score
    forest.add_to(X[:5], raw, 1)
    np.testing.assert_array_equal(raw[:, 0], model.predict_raw(X[:5]))


@pytest.mark.parametrize("order", ["C", "F"])
def test_float64_rows_predict_as_their_float32_rounding(data, order):
    """float64 rows, and rows in any layout, are read where they lie, 64 at a time copied to C
    order (float64 rounded to float32) by the native walk: the predictions are those of the rows
    rounded first, bit for bit, also for values within float64's precision of a split's edge,
    which a float64 comparison would send the other way; the binned path agrees."""
    X, signal = data
    model = jb.train(X, signal, num_rounds=6, max_depth=4, learning_rate=0.3)
    rng = np.random.default_rng(21)
    rows = rng.normal(size=(1000, 6))
    rows[::7, 3] = np.nan
    # The first tree's root edge: a hair below it in float64 goes right once rounded onto it.
    root_feature, root_bin = int(model.trees.feature[0, 0, 0]), int(model.trees.threshold_bin[0, 0, 0])
    edge = float(model.bin_edges.edges[root_feature, root_bin])
    rows[:300, root_feature] = edge * (1.0 - 1e-12) if edge > 0 else edge * (1.0 + 1e-12)
    rows = np.asarray(rows, order=order)
    rounded = rows.astype(np.float32)
    assert np.all(rows[:300, root_feature] < edge) and np.all(rounded[:300, root_feature] == np.float32(edge))
    expected = model.predict_raw(rounded)
    np.testing.assert_array_equal(model.predict_raw(rows), expected)
    np.testing.assert_array_equal(model.predict_raw(rows), binned_prediction(model, rounded))
    np.testing.assert_array_equal(model.predict_leaf(rows), model.predict_leaf(rounded))
    # Views in other layouts: every other row, every other feature of a wider array, reversed.
    np.testing.assert_array_equal(model.predict_raw(rows[::2]), expected[::2])
    np.testing.assert_array_equal(model.predict_raw(rounded[::2]), expected[::2])
    wide = np.repeat(rows, 2, axis=1)
    np.testing.assert_array_equal(model.predict_raw(wide[:, ::2]), expected)
    np.testing.assert_array_equal(model.predict_raw(rows[::-1])[::-1], expected)


@pytest.mark.parametrize("order", ["C", "F"])
def test_float64_rows_are_not_copied_whole_to_predict(data, order):
    """Predicting on float64 rows, in C or Fortran order (a DataFrame's values), allocates the
    result and little else (traced NumPy allocations: the result's 1.6 MB, where a float32 copy
    of the rows would take 9.6 MB; 11.2 MB in all when they were copied)."""
    import tracemalloc

    X, signal = data
    model = jb.train(X, signal, num_rounds=3, max_depth=3)
    rows = np.asarray(np.random.default_rng(22).normal(size=(400_000, 6)), order=order)
    model.predict_raw(rows[:10])
    tracemalloc.start()
    try:
        model.predict_raw(rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result_bytes = len(rows) * np.dtype(np.float32).itemsize
    assert peak < 2 * result_bytes, f"prediction allocated {peak} bytes for a result of {result_bytes}"


@pytest.mark.parametrize("outputs", [1, 3])
def test_position_values_added_by_the_kernel_equal_a_numpy_gather(outputs, monkeypatch):
    """A round's update of the training raw predictions: the native kernel (on CPU), the XLA
    gather (native kernels off) and NumPy agree exactly, inside a sharded program too."""
    from jax.sharding import Mesh, PartitionSpec

    rng = np.random.default_rng(outputs)
    n_rows, positions = 5000, 64
    raw = rng.normal(size=(n_rows, outputs)).astype(np.float32)
    values = rng.normal(size=(outputs, positions)).astype(np.float32)
    at = rng.integers(0, positions, size=(outputs, n_rows)).astype(np.int32)
    expected = raw + np.take_along_axis(values, at, axis=1).T
    # On the host's CPU whatever the default backend: the kernel is the CPU's.
    cpu = jax.devices("cpu")
    on_cpu = jax.device_put((raw, values, at), cpu[0])
    update = jax.jit(predictor.add_position_values)
    np.testing.assert_array_equal(np.asarray(update(*on_cpu)), expected)
    mesh = Mesh(np.array(cpu[:2]), ("rows",))
    sharded = jax.jit(jax.shard_map(predictor.add_position_values, mesh=mesh,
                                    in_specs=(PartitionSpec("rows"), PartitionSpec(), PartitionSpec(None, "rows")),
                                    out_specs=PartitionSpec("rows")))
    np.testing.assert_array_equal(np.asarray(sharded(raw, values, at)), expected)
    assert "jaxboost_add_position_values" in update.lower(*on_cpu).as_text()
    # The kernel's result aliases its input: with the raw predictions donated, no buffer of
    # their size is added for the result (the training rounds write the update in place).
    in_place = jax.jit(predictor.add_position_values, donate_argnums=0).lower(*on_cpu).compile()
    assert in_place.memory_analysis().temp_size_in_bytes < raw.nbytes
    np.testing.assert_array_equal(np.asarray(in_place(jax.device_put(raw, cpu[0]), *on_cpu[1:])), expected)
    monkeypatch.setenv("JAXBOOST_NATIVE", "0")
    gather = jax.jit(lambda *args: predictor.add_position_values(*args))  # a new function: traced again
    assert "jaxboost_add_position_values" not in gather.lower(*on_cpu).as_text()
    np.testing.assert_array_equal(np.asarray(gather(*on_cpu)), expected)


def native_predictor_threads(monkeypatch) -> list:
    """The thread counts that the native predictor's calls are given, appended as they come."""
    from jaxboost.native import NativeForest

    threads_used = []
    add_to = NativeForest.add_to
    monkeypatch.setattr(NativeForest, "add_to", lambda self, rows, raw, threads: (threads_used.append(threads),
                                                                                 add_to(self, rows, raw, threads)))
    return threads_used


def test_predictions_split_rows_over_the_cores_from_fewer_rows_than_training(data, monkeypatch):
    """Training shards rows over devices from ``MIN_ROWS_PER_DEVICE`` rows a device (below it a
    sharded round's collectives cost more than the work they split); predicting has no
    collectives, and its native predictor takes a thread a core from ``MIN_PREDICT_ROWS_PER_DEVICE``
    rows a thread. Rows between the two train on one device and are predicted on every core."""
    import jax

    from jaxboost import devices

    if min(len(jax.local_devices()), devices.available_cpu_cores()) < 2:
        pytest.skip("needs two CPU devices and two cores")
    assert devices.MIN_PREDICT_ROWS_PER_DEVICE < devices.MIN_ROWS_PER_DEVICE
    X, signal = data
    model = jb.train(X, signal, num_rounds=3, max_depth=3)
    threads_used = native_predictor_threads(monkeypatch)
    rows = 2 * devices.MIN_PREDICT_ROWS_PER_DEVICE
    assert rows < 2 * devices.MIN_ROWS_PER_DEVICE
    many = np.repeat(X, -(-rows // len(X)), axis=0)[:rows]
    np.testing.assert_array_equal(model.predict_raw(many), binned_prediction(model, many))
    assert threads_used == [2]
    assert devices.training_row_mesh(rows, X.shape[1], 256).devices.size == 1


def test_an_accelerators_default_backend_still_predicts_on_the_host(data, monkeypatch):
    """With a GPU as JAX's default backend the rows and the result are still host arrays: the
    native predictor walks them on the host's cores (threads as a CPU mesh would have)."""
    from jaxboost import devices

    X, signal = data
    model = jb.train(X, signal, num_rounds=5, max_depth=3)
    threads_used = native_predictor_threads(monkeypatch)
    monkeypatch.setattr(devices, "mesh_platform", lambda mesh: "gpu")
    monkeypatch.setattr(devices, "available_cpu_cores", lambda: 4)
    np.testing.assert_array_equal(model.predict_raw(X), binned_prediction(model, X))
    many = np.repeat(X, 20, axis=0)  # 60k rows: 5 x MIN_PREDICT_ROWS_PER_DEVICE, capped by the 4 cores
    np.testing.assert_array_equal(model.predict_raw(many), binned_prediction(model, many))
    assert threads_used == [1, 4]
