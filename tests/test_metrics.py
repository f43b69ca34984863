"""Tests for jaxboost.metrics against scikit-learn / NumPy references, under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import (
    accuracy_score,
    log_loss,
    mean_absolute_error,
    mean_squared_error,
    roc_auc_score,
)

from jaxboost import metrics

N = 1000
N_PAD = 137
K = 4


def _jit(fn):
    return jax.jit(fn)


def _call(fn, y, p, w):
    out = _jit(fn)(jnp.asarray(y), jnp.asarray(p, jnp.float32), jnp.asarray(w, jnp.float32))
    assert out.shape == () and out.dtype == jnp.float32
    return float(out)


def _pad(y, p, w, rng, mode, y_garbage, p_garbage):
    """Append (or interleave) weight-0 rows with garbage labels and predictions."""
    y2 = np.concatenate([y, y_garbage])
    p2 = np.concatenate([p, p_garbage])
    w2 = np.concatenate([w, np.zeros(len(y_garbage), w.dtype)])
    if mode == "interleave":
        perm = rng.permutation(len(y2))
        y2, p2, w2 = y2[perm], p2[perm], w2[perm]
    return y2, p2, w2


def _garbage_floats(rng, shape):
    g = rng.normal(scale=1e3, size=shape).astype(np.float32)
    flat = g.reshape(-1)
    flat[::7] = np.nan
    flat[1::11] = np.inf
    flat[2::13] = -np.inf
    return g


@pytest.fixture(params=["unweighted", "weighted"])
def weights(request):
    rng = np.random.default_rng(0)
    if request.param == "unweighted":
        return np.ones(N, np.float32)
    return rng.uniform(0.1, 3.0, size=N).astype(np.float32)


# ----------------------------------------------------------------- scalar-output metrics


def _regression_data(rng):
    y = rng.normal(size=N).astype(np.float32)
    p = (y + rng.normal(scale=0.5, size=N)).astype(np.float32)
    return y, p


def _binary_data(rng, ties=False):
    y = (rng.uniform(size=N) < 0.4).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-(1.5 * (2 * y - 1) + rng.normal(scale=1.5, size=N))))
    p = np.clip(p, 0.01, 0.99)
    if ties:
        p = np.round(p, 1)
    return y, p.astype(np.float32)


def _ref_rmse(y, p, w):
    return np.sqrt(mean_squared_error(y, p, sample_weight=w))


def _ref_mae(y, p, w):
    return mean_absolute_error(y, p, sample_weight=w)


def _ref_logloss(y, p, w):
    return log_loss(y, p, sample_weight=w, labels=[0, 1])


def _ref_error(y, p, w):
    return 1.0 - accuracy_score(y, (p > 0.5).astype(np.float32), sample_weight=w)


def _ref_auc(y, p, w):
    return roc_auc_score(y, p, sample_weight=w)


SCALAR_CASES = [
    ("rmse", _regression_data, _ref_rmse, {}),
    ("mae", _regression_data, _ref_mae, {}),
    ("logloss", _binary_data, _ref_logloss, {}),
    ("error", _binary_data, _ref_error, {}),
    ("auc", _binary_data, _ref_auc, {}),
    ("auc_ties", _binary_data, _ref_auc, {"ties": True}),
]


@pytest.mark.parametrize("case", SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_scalar_metric_matches_reference(case, weights):
    name, make, ref, kw = case
    fn = metrics.METRICS[name.split("_")[0]].function
    rng = np.random.default_rng(1)
    y, p = make(rng, **kw)
    got = _call(fn, y, p, weights)
    np.testing.assert_allclose(got, ref(y, p, weights), rtol=1e-5, atol=1e-6)


def _assert_padding_changes_nothing(fn, ref, y, p, weights, padded_inputs):
    """The metric on padded inputs equals the metric without them, and the reference."""
    base = _call(fn, y, p, weights)
    padded = _call(fn, *padded_inputs)
    assert np.isfinite(padded)
    np.testing.assert_allclose(padded, base, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(padded, ref(y, p, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["append", "interleave"])
@pytest.mark.parametrize("case", SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_scalar_metric_ignores_zero_weight_rows(case, mode, weights):
    name, make, ref, kw = case
    fn = metrics.METRICS[name.split("_")[0]].function
    rng = np.random.default_rng(2)
    y, p = make(rng, **kw)
    y_g = _garbage_floats(rng, (N_PAD,))
    p_g = _garbage_floats(rng, (N_PAD,))
    _assert_padding_changes_nothing(fn, ref, y, p, weights, _pad(y, p, weights, rng, mode, y_g, p_g))


# ----------------------------------------------------------------- AUC specifics


@pytest.mark.parametrize("decimals", [0, 1, 2])
def test_auc_heavy_ties(decimals, weights):
    rng = np.random.default_rng(3)
    y = (rng.uniform(size=N) < 0.5).astype(np.float32)
    p = np.round(np.clip(rng.uniform(size=N) + 0.3 * (y - 0.5), 0, 1), decimals).astype(np.float32)
    got = _call(metrics.auc, y, p, weights)
    np.testing.assert_allclose(got, roc_auc_score(y, p, sample_weight=weights), rtol=1e-5, atol=1e-6)


def test_auc_edge_cases():
    y = np.array([0, 1, 0, 1, 1, 0], np.float32)
    w = np.ones(6, np.float32)
    # All predictions equal: every pair is a tie.
    assert _call(metrics.auc, y, np.full(6, 0.3, np.float32), w) == pytest.approx(0.5)
    # Perfect and reversed rankings.
    assert _call(metrics.auc, y, y, w) == pytest.approx(1.0)
    assert _call(metrics.auc, y, 1 - y, w) == pytest.approx(0.0)
    # Signed zeros are the same score.
    p = np.array([0.0, -0.0, 0.0, -0.0, 1.0, 0.5], np.float32)
    assert _call(metrics.auc, y, p, w) == pytest.approx(roc_auc_score(y, p))
    # A single class (ignoring padding) gives NaN, as in XGBoost.
    y1 = np.array([1, 1, 1, 0], np.float32)
    w1 = np.array([1, 1, 1, 0], np.float32)
    assert np.isnan(_call(metrics.auc, y1, np.array([0.1, 0.2, 0.3, 0.4], np.float32), w1))


# ----------------------------------------------------------------- multiclass


def _multiclass_data(rng):
    y = rng.integers(0, K, size=N).astype(np.int32)
    logits = rng.normal(size=(N, K)) + 1.5 * np.eye(K)[y]
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return y, p.astype(np.float32)


def _ref_mlogloss(y, p, w):
    return log_loss(y, p, sample_weight=w, labels=list(range(K)))


def _ref_merror(y, p, w):
    return 1.0 - accuracy_score(y, p.argmax(axis=1), sample_weight=w)


MULTI_CASES = [("mlogloss", _ref_mlogloss), ("merror", _ref_merror)]


@pytest.mark.parametrize("case", MULTI_CASES, ids=[c[0] for c in MULTI_CASES])
def test_multiclass_metric_matches_reference(case, weights):
    name, ref = case
    rng = np.random.default_rng(4)
    y, p = _multiclass_data(rng)
    got = _call(metrics.METRICS[name].function, y, p, weights)
    np.testing.assert_allclose(got, ref(y, p, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["append", "interleave"])
@pytest.mark.parametrize("case", MULTI_CASES, ids=[c[0] for c in MULTI_CASES])
def test_multiclass_metric_ignores_zero_weight_rows(case, mode, weights):
    name, ref = case
    fn = metrics.METRICS[name].function
    rng = np.random.default_rng(5)
    y, p = _multiclass_data(rng)
    # Garbage labels, including out-of-range class ids, and garbage probabilities.
    y_g = rng.integers(-50, 50, size=N_PAD).astype(np.int32)
    p_g = _garbage_floats(rng, (N_PAD, K))
    _assert_padding_changes_nothing(fn, ref, y, p, weights, _pad(y, p, weights, rng, mode, y_g, p_g))


def test_mlogloss_clips_zero_probability():
    y = np.array([0, 1], np.int32)
    p = np.array([[0.0, 1.0], [0.5, 0.5]], np.float32)
    got = _call(metrics.mlogloss, y, p, np.ones(2, np.float32))
    expected = (-np.log(np.float32(metrics.EPS)) - np.log(0.5)) / 2
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ----------------------------------------------------------------- registry


def test_registry_and_get_metric():
    assert set(metrics.METRICS) == {
        "rmse", "mae", "logloss", "error", "auc", "mlogloss", "merror"
    }
    for name, m in metrics.METRICS.items():
        assert isinstance(m, metrics.Metric)
        assert m.name == name
        assert metrics.get_metric(name) is m
        assert m.higher_is_better == (name == "auc")

    with pytest.raises(ValueError, match="rmse"):
        metrics.get_metric("no_such_metric")

    def my_metric(y, y_pred, sample_weight):
        return jnp.sum(sample_weight * (y - y_pred)) / jnp.sum(sample_weight)

    m = metrics.get_metric(my_metric)
    assert m == metrics.Metric(name="my_metric", function=my_metric, higher_is_better=False)
    assert metrics.get_metric(m) is m
    y = jnp.arange(4.0)
    assert float(jax.jit(m.function)(y, y - 1.0, jnp.ones(4))) == pytest.approx(1.0)


def test_default_weights_and_column_predictions():
    rng = np.random.default_rng(6)
    y, p = _binary_data(rng)
    w = np.ones(N, np.float32)
    for name in ("rmse", "mae", "logloss", "error", "auc"):
        fn = metrics.METRICS[name].function
        expected = _call(fn, y, p, w)
        # sample_weight=None means all ones; an (n, 1) prediction column is accepted.
        got = float(jax.jit(lambda a, b: fn(a, b, None))(jnp.asarray(y), jnp.asarray(p)[:, None]))
        np.testing.assert_allclose(got, expected, rtol=1e-6)


# --------------------------------------------------------------------------- sort_by_key


def _lax_sorted(keys, *payloads):
    return jax.jit(lambda *arrays: jax.lax.sort(arrays, num_keys=1))(keys, *payloads)


@pytest.mark.parametrize("n", [1, 2, 2049, 20_000])
def test_sort_by_key_matches_lax_sort(n):
    """The native radix sort on CPU orders keys as ``lax.sort`` does (negatives, signed zeros,
    infinities, heavy ties) and carries each payload with its key."""
    from jaxboost import native

    if native.native_target(native.SORT_BY_KEY_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler)")
    rng = np.random.default_rng(n)
    keys = rng.normal(scale=100, size=n).astype(np.float32)
    # Not subnormals: XLA's CPU sort takes them as zero, the native sort orders them by value.
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30], np.float32)
    keys[: n // 3] = np.round(keys[: n // 3])  # ties
    chosen = rng.random(n) < 0.1
    keys[chosen] = rng.choice(special, size=int(chosen.sum()))
    row = np.arange(n, dtype=np.float32)  # a payload that names each key's row
    other = rng.random(n).astype(np.float32)
    native_keys, native_row, native_other = jax.jit(metrics.sort_by_key)(keys, row, other)
    lax_keys, _, _ = _lax_sorted(keys, row, other)
    np.testing.assert_array_equal(np.asarray(native_keys), np.asarray(lax_keys))
    taken = np.asarray(native_row).astype(np.int64)
    assert sorted(taken.tolist()) == list(range(n)), "each row once"
    np.testing.assert_array_equal(keys[taken], np.asarray(native_keys))
    np.testing.assert_array_equal(other[taken], np.asarray(native_other))
    sorted_keys = np.asarray(native_keys)
    assert np.all(sorted_keys[1:] >= sorted_keys[:-1])


def test_sort_by_key_runs_natively_on_cpu_and_under_vmap():
    from jaxboost import native

    if native.native_target(native.SORT_BY_KEY_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler)")
    # On the host's CPU whatever the default backend: the kernel is the CPU's.
    keys = jax.device_put(np.random.default_rng(0).normal(size=(3, 500)).astype(np.float32), jax.devices("cpu")[0])
    lowered = jax.jit(jax.vmap(metrics.sort_by_key)).lower(keys, -keys).as_text()
    assert native.SORT_BY_KEY_TARGET in lowered
    sorted_keys, payload = jax.jit(jax.vmap(metrics.sort_by_key))(keys, -keys)
    np.testing.assert_array_equal(np.asarray(sorted_keys), np.sort(np.asarray(keys), axis=1))
    np.testing.assert_array_equal(np.asarray(payload), -np.asarray(sorted_keys))


def test_sorted_auc_sums_native_kernel_is_the_xla_scans():
    from jaxboost import native

    if native.native_target(native.SORTED_AUC_SUMS_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler)")
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(5)
    n = 3000
    # Heavy ties (two decimals), fractional labels (rows both positive and negative), rows of
    # zero weight, and a NaN score (a run of its own on both paths).
    scores = np.sort(np.round(rng.uniform(size=n), 2)).astype(np.float32)
    scores[-1] = np.nan
    y = np.where(rng.random(n) < 0.2, rng.random(n), rng.random(n) < scores).astype(np.float32)
    w = np.where(rng.random(n) < 0.1, 0.0, rng.uniform(0.5, 2.0, n)).astype(np.float32)
    sorted_rows = [jax.device_put(a, cpu) for a in (scores, w * y, w * (1 - y))]
    lowered = jax.jit(metrics.sorted_auc_sums).lower(*sorted_rows).as_text()
    assert native.SORTED_AUC_SUMS_TARGET in lowered
    got = np.array(jax.jit(metrics.sorted_auc_sums)(*sorted_rows))
    scans = np.array(jax.jit(metrics._xla_sorted_auc_sums)(*sorted_rows))
    np.testing.assert_allclose(got, scans, rtol=2e-6)
    # And the double-precision definition, run by run from the top score down.
    positive, negative = (w * y).astype(np.float64), (w * (1 - y)).astype(np.float64)
    area = above = 0.0
    for score in [np.nan] + sorted(set(scores[~np.isnan(scores)].tolist()), reverse=True):
        run = np.isnan(scores) if np.isnan(score) else scores == score
        area += negative[run].sum() * (above + 0.5 * positive[run].sum())
        above += positive[run].sum()
    np.testing.assert_allclose(got, [area, positive.sum(), negative.sum()], rtol=1e-6)
