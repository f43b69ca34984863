"""Tests of the segment line search and the starting value against exact NumPy minimisers.

``minimise_segment_offsets`` is driven through ``boosting.minimise_offsets`` (the way leaf refits
call it); NumPy computes exact weighted medians / quantiles by sorting and accumulating weights,
and the closed forms of the penalised squared error.
"""

from __future__ import annotations

import inspect
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import losses, training
from jaxboost.boosting import Objective, minimise_offsets, newton_constant, starting_value
from jaxboost.line_search import newton_minimiser
from jaxboost.native import lowering_for
from jaxboost.regularizer import Regularization

F32 = jnp.float32
# One shape for every call: 4 segments of rows plus a fifth segment that holds no rows.
SEGMENT_SIZES = (61, 60, 47, 72)
N_ROWS = sum(SEGMENT_SIZES)
NUM_SEGMENTS = len(SEGMENT_SIZES) + 1
SEGMENT_IDS = np.repeat(np.arange(len(SEGMENT_SIZES)), SEGMENT_SIZES).astype(np.int32)
EMPTY_SEGMENT = NUM_SEGMENTS - 1
SCALES = [1e-3, 1e-1, 1.0, 1e2, 1e4]


def identity(raw_prediction):
    return raw_prediction


def absolute_error(f, y):
    return jnp.abs(y - f)


def squared_error(f, y):
    return 0.5 * jnp.square(y - f)


def make_pinball(tau):
    def pinball(f, y):
        residual = y - f
        return jnp.maximum(tau * residual, (tau - 1.0) * residual)
    return pinball


def logistic(f, y):
    return jax.nn.softplus(f) - y * f


def softmax_loss(f, y):
    return jax.nn.logsumexp(f) - f[y]


ABSOLUTE = Objective(absolute_error, vector_output=False, num_outputs=1, link=identity)
SQUARED = Objective(squared_error, vector_output=False, num_outputs=1, link=identity)
PINBALL = {tau: Objective(make_pinball(tau), vector_output=False, num_outputs=1, link=identity)
           for tau in (0.1, 0.5, 0.9)}
LOGISTIC = Objective(logistic, vector_output=False, num_outputs=1, link=identity)
SOFTMAX = Objective(softmax_loss, vector_output=True, num_outputs=3, link=jax.nn.softmax)


# The line search as lowered for each platform: on CPU it bisects (one probe a step, the native
# segment sum), on the CPU's device; lowered for an accelerator it takes ACCELERATOR_PROBES
# probes a step with XLA's segment sums, on the default device (which runs them on a CPU too).
PLATFORMS = ["cpu", "accelerator"]


def lowered_as(platform: str):
    """``lowering_for`` one of ``PLATFORMS``: the CPU, or an accelerator (the default backend's
    where it is one, else a GPU's code run here)."""
    accelerator = jax.default_backend() if jax.default_backend() != "cpu" else "gpu"
    return lowering_for("cpu" if platform == "cpu" else accelerator)


def placed_as(platform: str, arrays):
    """``arrays`` on the CPU's device, or on the default device for an accelerator."""
    return jax.device_put(arrays, jax.devices("cpu")[0] if platform == "cpu" else jax.devices()[0])


@partial(jax.jit, static_argnames=("objective", "num_segments", "platform"))
def _jit_offsets(objective, raw_prediction, y, weights, segment_ids, num_segments, reg, platform):
    with lowered_as(platform):
        return minimise_offsets(objective, raw_prediction, y, weights, segment_ids, num_segments, 0, reg)


def offsets(objective, F, y, weights, reg_lambda=0.0, reg_alpha=0.0, platform="cpu"):
    reg = Regularization(F32(reg_lambda), F32(reg_alpha), F32(0.0))
    arguments = placed_as(platform, (np.asarray(F, np.float32)[:, None], np.asarray(y, np.float32),
                                     np.asarray(weights, np.float32), SEGMENT_IDS))
    result = _jit_offsets(objective, *arguments, NUM_SEGMENTS, reg, platform)
    assert result.shape == (NUM_SEGMENTS,) and result.dtype == jnp.float32
    return np.asarray(result, np.float64)


def make_rows(seed, scale, integer_weights=False):
    """Raw predictions F, labels y, weights (float32) and the exact residuals y - F (float64)."""
    rng = np.random.default_rng(seed)
    segment_shift = np.array([1.0, -0.4, 0.05, 2.5])[SEGMENT_IDS]
    F = (scale * rng.normal(size=N_ROWS)).astype(np.float32)
    y = (F + scale * (segment_shift + rng.standard_t(3, size=N_ROWS))).astype(np.float32)
    if integer_weights:
        weights = np.ones(N_ROWS, np.float32)
    else:
        weights = rng.uniform(0.1, 3.0, size=N_ROWS).astype(np.float32)
    residuals = y.astype(np.float64) - F.astype(np.float64)
    return F, y, weights, residuals


def weighted_quantile_interval(residuals, weights, tau):
    """The interval of minimisers of sum w rho_tau(r - c) (a point unless the weights split exactly)."""
    order = np.argsort(residuals, kind="stable")
    r, cumulative = residuals[order], np.cumsum(weights[order].astype(np.float64))
    target = tau * cumulative[-1]
    slack = 1e-9 * cumulative[-1]
    lower = r[np.argmax(cumulative >= target - slack)]
    upper = r[np.argmax(cumulative > target + slack)]
    return lower, upper


def pinball_objective(c, residuals, weights, tau):
    e = residuals - c
    return np.sum(weights * np.maximum(tau * e, (tau - 1.0) * e))


def check_quantile_offsets(result, residuals, weights, tau, context):
    for segment in range(len(SEGMENT_SIZES)):
        rows = SEGMENT_IDS == segment
        r, w = residuals[rows], weights[rows].astype(np.float64)
        lower, upper = weighted_quantile_interval(r, w, tau)
        tolerance = 1e-5 * np.max(np.abs(r))
        c = result[segment]
        assert lower - tolerance <= c <= upper + tolerance, (
            f"segment {segment}: offset {c!r} outside the minimiser interval [{lower!r}, {upper!r}] {context}")
        best = pinball_objective(lower, r, w, tau)
        assert pinball_objective(c, r, w, tau) <= best * (1 + 1e-5) + 1e-12, (
            f"segment {segment}: objective {pinball_objective(c, r, w, tau)} above the minimum {best} {context}")
        if lower == upper:  # a unique minimiser: the offset is that residual
            np.testing.assert_allclose(c, lower, rtol=1e-5, atol=tolerance,
                                       err_msg=f"segment {segment}: not the weighted {tau}-quantile {context}")
    assert result[EMPTY_SEGMENT] == 0.0, f"a segment with no rows must get 0, got {result[EMPTY_SEGMENT]} {context}"


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_absolute_error_offset_is_the_weighted_median(scale, seed, platform):
    F, y, weights, residuals = make_rows(seed, scale)
    result = offsets(ABSOLUTE, F, y, weights, platform=platform)
    check_quantile_offsets(result, residuals, weights, 0.5, f"(scale={scale}, seed={seed}, {platform})")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_absolute_error_offset_with_an_interval_of_medians(scale, platform):
    # Unit weights: segments of even size (60, 72) have a whole interval of medians.
    F, y, weights, residuals = make_rows(5, scale, integer_weights=True)
    for segment in (1, 3):
        rows = SEGMENT_IDS == segment
        lower, upper = weighted_quantile_interval(residuals[rows], weights[rows], 0.5)
        assert upper > lower, "the test needs a segment whose median is an interval"
    result = offsets(ABSOLUTE, F, y, weights, platform=platform)
    check_quantile_offsets(result, residuals, weights, 0.5, f"(unit weights, scale={scale}, {platform})")


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("integer_weights", [False, True])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_pinball_offset_is_the_weighted_quantile(tau, scale, integer_weights, platform):
    F, y, weights, residuals = make_rows(2, scale, integer_weights=integer_weights)
    result = offsets(PINBALL[tau], F, y, weights, platform=platform)
    check_quantile_offsets(result, residuals, weights, tau,
                           f"(tau={tau}, scale={scale}, unit={integer_weights}, {platform})")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_absolute_error_offsets_with_mixed_scales_in_one_call(platform):
    rng = np.random.default_rng(3)
    segment_scale = np.array([1e-3, 1e4, 1.0, 30.0])[SEGMENT_IDS]
    F = (segment_scale * rng.normal(size=N_ROWS)).astype(np.float32)
    y = (F + segment_scale * (1.0 + rng.normal(size=N_ROWS))).astype(np.float32)
    weights = rng.uniform(0.1, 3.0, size=N_ROWS).astype(np.float32)
    residuals = y.astype(np.float64) - F.astype(np.float64)
    check_quantile_offsets(offsets(ABSOLUTE, F, y, weights, platform=platform), residuals, weights, 0.5,
                           f"(mixed scales, {platform})")


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("reg_lambda", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("alpha_factor", [0.0, 20.0])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_squared_error_offset_is_the_penalised_closed_form(scale, reg_lambda, alpha_factor, platform):
    F, y, weights, residuals = make_rows(4, scale)
    reg_alpha = alpha_factor * scale
    result = offsets(SQUARED, F, y, weights, reg_lambda, reg_alpha, platform=platform)
    context = f"(scale={scale}, lambda={reg_lambda}, alpha={reg_alpha}, {platform})"
    thresholded = 0
    for segment in range(len(SEGMENT_SIZES)):
        rows = SEGMENT_IDS == segment
        r, w = residuals[rows], weights[rows].astype(np.float64)
        total = np.sum(w * r)
        soft = np.sign(total) * max(abs(total) - reg_alpha, 0.0)
        expected = soft / (np.sum(w) + reg_lambda)
        thresholded += expected == 0
        np.testing.assert_allclose(result[segment], expected, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=f"segment {segment}: not T_alpha(sum w r) / (sum w + lambda) {context}")
    assert result[EMPTY_SEGMENT] == 0.0, f"a segment with no rows must get 0 {context}"
    if alpha_factor > 0:
        assert thresholded >= 1, "the test data should have a segment soft-thresholded to 0"


# --------------------------------------------------------------------------------------------
# starting_value
# --------------------------------------------------------------------------------------------


def _weights(seed, n=N_ROWS):
    return np.random.default_rng(seed + 100).uniform(0.1, 3.0, size=n).astype(np.float32)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_starting_value_squared_error_is_the_weighted_mean(scale):
    y = (scale * (3.0 + np.random.default_rng(0).normal(size=N_ROWS))).astype(np.float32)
    weights = _weights(0)
    start = np.asarray(starting_value(SQUARED, jnp.zeros((N_ROWS, 1)), jnp.asarray(y), jnp.asarray(weights)))
    expected = np.average(y.astype(np.float64), weights=weights.astype(np.float64))
    assert start.shape == (1,)
    np.testing.assert_allclose(start[0], expected, rtol=1e-5, err_msg=f"not the weighted mean (scale={scale})")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_starting_value_absolute_error_is_the_weighted_median(scale):
    y = (scale * (-2.0 + np.random.default_rng(1).standard_t(2, size=N_ROWS))).astype(np.float32)
    weights = _weights(1)
    start = np.asarray(starting_value(ABSOLUTE, jnp.zeros((N_ROWS, 1)), jnp.asarray(y), jnp.asarray(weights)))
    lower, upper = weighted_quantile_interval(y.astype(np.float64), weights.astype(np.float64), 0.5)
    assert lower == upper, "random weights should give a unique median"
    np.testing.assert_allclose(start[0], lower, rtol=1e-5, err_msg=f"not the weighted median (scale={scale})")


@pytest.mark.parametrize("positive_share", [0.03, 0.4, 0.9])
def test_starting_value_logistic_is_the_log_odds(positive_share):
    rng = np.random.default_rng(2)
    y = (rng.uniform(size=N_ROWS) < positive_share).astype(np.float32)
    weights = _weights(2)
    start = np.asarray(starting_value(LOGISTIC, jnp.zeros((N_ROWS, 1)), jnp.asarray(y), jnp.asarray(weights)))
    p = np.average(y.astype(np.float64), weights=weights.astype(np.float64))
    np.testing.assert_allclose(start[0], np.log(p / (1 - p)), rtol=1e-5, atol=1e-5,
                               err_msg=f"not the log-odds of the weighted mean label {p:.4f}")


def test_starting_value_over_many_rows_is_exact():
    """The starting value's slope is a sum over every row: summed as a reduction, not a row-by-row
    scatter, whose float32 rounding grows with the rows (at 800k rows the scatter's log-odds
    was 7.5e-6 off, 9e-6 relative)."""
    n = 800_000
    y = (np.random.default_rng(5).uniform(size=n) < 0.3).astype(np.float32)
    start = np.asarray(starting_value(LOGISTIC, jnp.zeros((n, 1)), jnp.asarray(y), jnp.ones(n, jnp.float32)))
    p = y.astype(np.float64).mean()
    np.testing.assert_allclose(start[0], np.log(p / (1 - p)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("frequencies", [(1 / 3, 1 / 3, 1 / 3), (0.5, 0.3, 0.2), (0.1, 0.2, 0.7), (0.05, 0.9, 0.05)])
def test_starting_value_softmax_gives_the_class_frequencies(frequencies):
    rng = np.random.default_rng(3)
    y = rng.choice(3, size=N_ROWS, p=frequencies).astype(np.int32)
    weights = _weights(3)
    start = starting_value(SOFTMAX, jnp.zeros((N_ROWS, 3)), jnp.asarray(y), jnp.asarray(weights))
    probabilities = np.asarray(jax.nn.softmax(start), np.float64)
    expected = np.bincount(y, weights=weights.astype(np.float64), minlength=3) / weights.astype(np.float64).sum()
    np.testing.assert_allclose(probabilities, expected, atol=1e-3,
                               err_msg=f"softmax(starting value) {probabilities} is not the weighted class "
                                       f"frequencies {expected} (start={np.asarray(start)})")


def _vector_objective(loss, num_outputs):
    return Objective(loss, vector_output=True, num_outputs=num_outputs, link=identity)


@jax.jit
def _newton_softmax(raw_prediction, y, weights):
    return newton_constant(SOFTMAX_TEN, raw_prediction, y, weights)


SOFTMAX_TEN = _vector_objective(softmax_loss, 10)


def test_softmax_starting_value_is_solved_by_newton_steps_to_float32_resolution():
    """Ten unbalanced classes, weighted: Newton's steps converge (no coordinate sweeps, which took
    40x longer) to the centred log class frequencies."""
    n = 20_000
    rng = np.random.default_rng(6)
    frequencies = np.linspace(1, 30, 10) / np.linspace(1, 30, 10).sum()
    y = rng.choice(10, size=n, p=frequencies).astype(np.int32)
    weights = rng.uniform(0.1, 3.0, size=n).astype(np.float32)
    expected = np.log(np.bincount(y, weights=weights.astype(np.float64), minlength=10))
    args = (jnp.zeros((n, 10)), jnp.asarray(y), jnp.asarray(weights))
    constant, converged = _newton_softmax(*args)
    assert bool(converged), "Newton's steps should finish a smooth loss"
    start = np.asarray(starting_value(SOFTMAX_TEN, *args), np.float64)
    np.testing.assert_allclose(start - start.mean(), expected - expected.mean(), atol=2e-6)
    # The same steps (the starting value's program has its own compiler options: rounding).
    np.testing.assert_allclose(start, np.asarray(constant), atol=1e-6)


def _distinct_labels_naively(y, weights):
    """Each label some row of positive weight (in some model) holds, with each model's weights
    of its rows summed, by a walk over the rows."""
    weights = np.atleast_2d(weights)
    summed = {}
    for row in range(y.shape[0]):
        if np.any(weights[:, row] > 0):
            key = tuple(np.atleast_1d(y[row]).tolist())
            summed[key] = summed.get(key, 0.0) + weights[:, row].astype(np.float64)
    return summed


@pytest.mark.parametrize("case", ["classes", "models", "label-vectors"])
def test_distinct_labels_hold_each_weighted_label_once_with_its_rows_weights_summed(case):
    """Against a walk over the rows: rows of weight 0 (a device's padding, a fold left out) bring
    no label of their own, the padding up to the program's rows weighs 0 and repeats a real label,
    and each model's weights are summed apart."""
    rng = np.random.default_rng(11)
    n, rows = 3000, training.STARTING_VALUE_FEW_ROWS
    y = rng.choice([0.0, 1.0, 2.0, 7.5, -3.0], size=n).astype(np.float32)
    weights = rng.uniform(0.1, 3.0, size=n).astype(np.float32)
    y[:40], weights[:40] = 99.0, 0.0  # a label held only by rows of weight 0
    if case == "models":
        weights = np.stack([weights, weights * rng.integers(0, 2, size=n), 2.5 * weights]).astype(np.float32)
    elif case == "label-vectors":
        y = np.stack([y, rng.choice([0.0, 1.0], size=n).astype(np.float32)], axis=1)
    labels, summed = training.distinct_labels(y, weights)
    assert labels.shape == (rows,) + y.shape[1:] and labels.dtype == y.dtype
    assert summed.shape == weights.shape[:-1] + (rows,) and summed.dtype == np.float32
    expected = _distinct_labels_naively(y, weights)
    found = {}
    for label, weight in zip(labels, np.moveaxis(np.atleast_2d(summed), -1, 0)):
        key = tuple(np.atleast_1d(label).tolist())
        assert key in expected, f"label {key} is held by no row of positive weight"
        found[key] = found.get(key, 0.0) + weight.astype(np.float64)
    assert found.keys() == expected.keys()
    for key, weight in expected.items():
        np.testing.assert_allclose(found[key], weight, rtol=1e-6, err_msg=str(key))
    assert np.count_nonzero(np.atleast_2d(summed).sum(axis=0)) == len(expected)


def test_distinct_labels_are_none_where_the_labels_are_many():
    rng = np.random.default_rng(12)
    rows = training.STARTING_VALUE_FEW_ROWS
    continuous = rng.normal(size=5000).astype(np.float32)
    assert training.distinct_labels(continuous, np.ones(5000, np.float32)) is None
    # One more than the program holds, the last of them first met after the first rows.
    counts = np.concatenate([np.tile(np.arange(rows, dtype=np.float32), 20), [float(rows)]])
    assert training.distinct_labels(counts, np.ones(counts.shape[0], np.float32)) is None
    assert training.distinct_labels(counts[:-1], np.ones(counts.shape[0] - 1, np.float32)) is not None


def _record_rows_taken(monkeypatch, module) -> list:
    """The rows of each call of ``module``'s ``starting_value``, recorded as it runs."""
    rows_taken = []
    original = module.starting_value

    def recording(objective, raw_prediction, *args, **kwargs):
        rows_taken.append(raw_prediction.shape[0])
        return original(objective, raw_prediction, *args, **kwargs)

    monkeypatch.setattr(module, "starting_value", recording)
    return rows_taken


def test_a_custom_softmax_finds_its_starting_value_over_its_distinct_labels(monkeypatch):
    """A fit of a custom 3-class softmax: its starting value's program runs over the classes
    (``STARTING_VALUE_FEW_ROWS`` rows), not every row, and finds the centred log of the weighted
    class frequencies, as the same program over every row does; a custom Gaussian's continuous
    labels are taken row by row."""
    rng = np.random.default_rng(13)
    n = 6000
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.choice(3, size=n, p=[0.6, 0.3, 0.1]).astype(np.float32)
    weights = rng.uniform(0.1, 3.0, size=n).astype(np.float32)
    original = training.starting_value
    rows_taken = _record_rows_taken(monkeypatch, training)
    model = jb.train(X, y, sample_weight=weights, loss=lambda f, label: softmax_loss(f, label.astype(jnp.int32)),
                     num_outputs=3, num_rounds=1, max_depth=2)
    assert rows_taken == [training.STARTING_VALUE_FEW_ROWS]
    expected = np.log(np.bincount(y.astype(np.int64), weights=weights.astype(np.float64)))
    start = np.asarray(model.base_score, np.float64)
    np.testing.assert_allclose(start - start.mean(), expected - expected.mean(), atol=2e-6)
    every_row = np.asarray(original(_vector_objective(softmax_loss, 3), jnp.zeros((n, 3)), jnp.asarray(y, jnp.int32),
                                    jnp.asarray(weights)), np.float64)
    np.testing.assert_allclose(start - start.mean(), every_row - every_row.mean(), atol=2e-6)

    rows_taken.clear()
    labels = (40.0 + 3.0 * rng.normal(size=n)).astype(np.float32)
    jb.train(X, labels, loss=gaussian_loss, num_outputs=2, multi_strategy="multi_output_tree", num_rounds=1,
             max_depth=2)
    assert rows_taken and all(taken >= n for taken in rows_taken), rows_taken


def test_train_many_finds_each_custom_softmax_starting_value_over_the_distinct_labels(monkeypatch):
    """train_many's models, each with its own row weights (one of them leaving a class out),
    find their starting values over the labels once, each weighted by its own sums."""
    from jaxboost import vmapped_training
    rows_taken = _record_rows_taken(monkeypatch, vmapped_training)
    rng = np.random.default_rng(16)
    n = 300
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.choice(3, size=n, p=[0.5, 0.3, 0.2]).astype(np.float32)
    weights = np.stack([_weights(17, n), _weights(18, n) * (y != 2)])
    models = jb.train_many(X, y, sample_weights=weights, num_outputs=3, num_rounds=1, max_depth=2,
                           loss=lambda f, label: softmax_loss(f, label.astype(jnp.int32)))
    assert rows_taken == [training.STARTING_VALUE_FEW_ROWS]
    for model, w in zip(models, weights):
        frequencies = np.bincount(y.astype(np.int64), weights=w.astype(np.float64), minlength=3)
        start = np.asarray(model.base_score, np.float64)
        probabilities = np.exp(start - start.max()) / np.exp(start - start.max()).sum()
        np.testing.assert_allclose(probabilities, frequencies / frequencies.sum(), atol=1e-5)


def gaussian_loss(f, y):
    return f[1] + 0.5 * jnp.square((y - f[0]) * jnp.exp(-f[1]))


def test_gaussian_starting_value_is_the_weighted_mean_and_log_deviation():
    """Two coupled outputs with a Hessian that changes along the way (the scale's)."""
    rng = np.random.default_rng(7)
    y = (40.0 + 3.0 * rng.normal(size=N_ROWS)).astype(np.float32)
    weights = _weights(7)
    args = (jnp.zeros((N_ROWS, 2)), jnp.asarray(y), jnp.asarray(weights))
    objective = _vector_objective(gaussian_loss, 2)
    _, converged = jax.jit(partial(newton_constant, objective))(*args)
    assert bool(converged)
    start = np.asarray(starting_value(objective, *args), np.float64)
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    mean = np.average(y64, weights=w)
    np.testing.assert_allclose(start, [mean, 0.5 * np.log(np.average((y64 - mean) ** 2, weights=w))], rtol=1e-5)


def test_a_gaussians_newton_steps_end_where_float32_resolves_its_gradients():
    """Labels on a scale of 260 (a regression's): the mean's gradient sum is float32 rounding
    worth Newton steps of 5e-5 about the minimiser, above the steps' tolerance. The steps end
    there, converged to the weighted mean and log deviation (they had gone on to the coordinate
    sweeps, a program of their own)."""
    n = 20_000
    rng = np.random.default_rng(18)
    y = (-0.6 + 260.0 * rng.normal(size=n)).astype(np.float32)
    weights = rng.uniform(0.1, 3.0, size=n).astype(np.float32)
    args = (jnp.zeros((n, 2)), jnp.asarray(y), jnp.asarray(weights))
    constant, converged = jax.jit(partial(newton_constant, _vector_objective(gaussian_loss, 2)))(*args)
    assert bool(converged)
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    mean = np.average(y64, weights=w)
    expected = [mean, 0.5 * np.log(np.average((y64 - mean) ** 2, weights=w))]
    np.testing.assert_allclose(np.asarray(constant), expected, rtol=1e-5, atol=1e-4)


def squared_and_absolute_error(f, y):
    return 0.5 * jnp.square(y - f[0]) + jnp.abs(y - f[1])


def test_starting_value_without_curvature_falls_back_to_exact_sweeps():
    """One output's loss has no curvature (absolute error): Newton's steps stop short, and the
    coordinate sweeps go on to the exact weighted mean and median."""
    y = (-2.0 + np.random.default_rng(8).standard_t(2, size=N_ROWS)).astype(np.float32)
    weights = _weights(8)
    args = (jnp.zeros((N_ROWS, 2)), jnp.asarray(y), jnp.asarray(weights))
    objective = _vector_objective(squared_and_absolute_error, 2)
    _, converged = jax.jit(partial(newton_constant, objective))(*args)
    assert not bool(converged)
    start = np.asarray(starting_value(objective, *args))
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    median, upper = weighted_quantile_interval(y64, w, 0.5)
    assert median == upper
    np.testing.assert_allclose(start, [np.average(y64, weights=w), median], rtol=1e-5)


def two_pinball_losses(f, y):
    residual = y - f
    levels = jnp.array([0.2, 0.7])
    return jnp.sum(jnp.maximum(levels * residual, (levels - 1) * residual))


def _trained_and_traced(dataset, **settings):
    """``jb.train``'s model, and the names of the functions it traced."""
    traced = []

    def listener(name, duration, **kwargs):
        if name.endswith("jaxpr_trace_duration"):
            traced.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        model = jb.train(dataset, **settings)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return model, traced


def test_a_loss_without_any_curvature_starts_from_its_refit_program(monkeypatch):
    """A loss whose Hessian is zero everywhere (two pinball losses): ``jb.train`` finds its
    starting value with the round's refit program (``SplitRound.constant_offsets``), tracing
    neither Newton steps nor sweeps of their own. It is the same, bit for bit, as the sweeps
    alone and as Newton's steps followed by them (which stop where they start), and the
    weighted quantiles. A smooth built-in (softmax) is not traced for it."""
    import jaxboost as jb
    from jaxboost import training

    asked = []
    monkeypatch.setattr(training, "_hessian_vanishes",
                        lambda resolved, rows, ask=training._hessian_vanishes: asked.append(resolved.name)
                        or ask(resolved, rows))
    X_small = np.random.default_rng(11).normal(size=(300, 3)).astype(np.float32)
    jb.train(X_small, (X_small[:, 0] > 0) + (X_small[:, 1] > 0), loss="softmax", num_rounds=1, max_depth=2)
    assert asked == []

    y = (1.5 + np.random.default_rng(9).standard_t(3, size=N_ROWS)).astype(np.float32)
    X = np.random.default_rng(10).normal(size=(N_ROWS, 3)).astype(np.float32)
    weights = _weights(9)
    model, traced = _trained_and_traced(jb.Dataset(X, y, sample_weight=weights), loss=two_pinball_losses,
                                        num_outputs=2, num_rounds=1, max_depth=2)
    assert "round_refit" in traced, traced
    assert "_coordinate_sweeps" not in traced and "newton_constant" not in traced, traced
    assert asked, "the custom loss's Hessian was not looked at"
    objective = _vector_objective(two_pinball_losses, 2)
    args = (jnp.zeros((N_ROWS, 2)), jnp.asarray(y), jnp.asarray(weights))
    with_newton = np.asarray(starting_value(objective, *args))
    if jb.native.native_target(jb.native.SEGMENT_SUM_TARGET) is not None:
        np.testing.assert_array_equal(np.asarray(model.base_score), with_newton)
    else:  # without the native segment sum the two programs sum the rows in orders of their own
        np.testing.assert_allclose(np.asarray(model.base_score), with_newton, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(starting_value(objective, *args, hessian_vanishes=True)), with_newton)
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    for output, level in enumerate([0.2, 0.7]):
        lower, upper = weighted_quantile_interval(y64, w, level)
        assert lower - 1e-5 * abs(lower) <= with_newton[output] <= upper + 1e-5 * abs(upper)


@pytest.mark.parametrize("loss_name, settings", [
    ("pinball", dict()),  # its zero Hessians call for the refit
    ("pinball", dict(reg_lambda=5.0, reg_alpha=2.0, max_delta_step=0.3, learning_rate=0.3, subsample=0.5)),
    ("squared", dict(leaf_refit=True)),  # a smooth loss refit on request
])
def test_a_refit_start_is_the_unpenalised_minimiser_over_every_row(loss_name, settings):
    """A one-output custom loss with a leaf refit starts from the refit program's minimisation
    over every row in one leaf (``SplitRound.constant_offsets``), with no program of its own:
    a pinball loss's is the sweeps' value bit for bit, whatever the round's penalty, learning rate, leaf bound and
    row sample (none of which a starting value takes), and the weighted quantile; a smooth
    loss's to float32 rounding, and the weighted mean."""
    def pinball(f, y):
        residual = y - f
        return jnp.maximum(0.9 * residual, -0.1 * residual)

    def squared(f, y):
        return 0.5 * jnp.square(y - f)

    loss = {"pinball": pinball, "squared": squared}[loss_name]
    y = (1.5 + 40.0 * np.random.default_rng(12).standard_t(3, size=N_ROWS)).astype(np.float32)
    X = np.random.default_rng(13).normal(size=(N_ROWS, 3)).astype(np.float32)
    weights = _weights(12)
    model, traced = _trained_and_traced(jb.Dataset(X, y, sample_weight=weights), loss=loss, num_rounds=1,
                                        max_depth=2, **settings)
    assert model.params["leaf_refit"]
    assert "round_refit" in traced and "_coordinate_sweeps" not in traced, traced
    objective = Objective(loss, vector_output=False, num_outputs=1, link=identity)
    sweeps = np.asarray(starting_value(objective, jnp.zeros((N_ROWS, 1)), jnp.asarray(y), jnp.asarray(weights)))
    if loss_name == "pinball":  # its minimiser is a label
        np.testing.assert_array_equal(np.asarray(model.base_score), sweeps)
    else:  # the derivatives' sums, in another order, round otherwise
        np.testing.assert_allclose(np.asarray(model.base_score), sweeps, rtol=2e-6)
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    if loss_name == "squared":
        np.testing.assert_allclose(model.base_score, [np.average(y64, weights=w)], rtol=1e-5)
    else:
        lower, upper = weighted_quantile_interval(y64, w, 0.9)
        assert lower - 1e-5 * abs(lower) <= model.base_score[0] <= upper + 1e-5 * abs(upper)


def test_outputs_that_interact_go_on_to_the_sweeps_after_the_refit_start():
    """Two outputs that one absolute error couples (a Hessian zero everywhere): the refit
    program's second pass over them still moves them, so the coordinate sweeps go on from
    there, to a point that no output alone can improve."""
    def coupled(f, y):
        return jnp.abs(f[0] + f[1] - y) + 0.5 * jnp.abs(f[0] - 0.3 * y)

    y = (1.5 + 40.0 * np.random.default_rng(14).standard_t(3, size=N_ROWS)).astype(np.float32)
    X = np.random.default_rng(15).normal(size=(N_ROWS, 3)).astype(np.float32)
    weights = _weights(14)
    model, traced = _trained_and_traced(jb.Dataset(X, y, sample_weight=weights), loss=coupled, num_outputs=2,
                                        num_rounds=1, max_depth=2)
    assert "round_refit" in traced and "_coordinate_sweeps" in traced, traced
    w, y64 = weights.astype(np.float64), y.astype(np.float64)

    def total(c):
        return np.sum(w * (np.abs(c[0] + c[1] - y64) + 0.5 * np.abs(c[0] - 0.3 * y64)))

    start = np.asarray(model.base_score, np.float64)
    for output in range(2):
        for step in (-1e-2, 1e-2):
            moved = start.copy()
            moved[output] += step * max(1.0, abs(start[output]))
            assert total(moved) >= total(start) * (1 - 1e-7), (output, step)


def test_a_custom_leaf_penalty_leaves_the_start_unpenalised():
    """With a custom leaf penalty, which the refit program's minimisation adds, a refit loss's
    starting value comes from Newton steps on the round's derivatives, which take no penalty:
    the weighted quantile."""
    def pinball(f, y):
        residual = y - f
        return jnp.maximum(0.3 * residual, -0.7 * residual)

    y = (1.5 + 40.0 * np.random.default_rng(16).standard_t(3, size=N_ROWS)).astype(np.float32)
    X = np.random.default_rng(17).normal(size=(N_ROWS, 3)).astype(np.float32)
    weights = _weights(16)
    penalty = jb.regularizers.custom(lambda w, params: 50.0 * jnp.square(w))
    model, traced = _trained_and_traced(jb.Dataset(X, y, sample_weight=weights), loss=pinball, num_rounds=1,
                                        max_depth=2, regularizer=penalty)
    assert model.params["leaf_refit"]
    assert "_coordinate_sweeps" not in traced, traced
    w, y64 = weights.astype(np.float64), y.astype(np.float64)
    lower, upper = weighted_quantile_interval(y64, w, 0.3)
    assert lower - 1e-5 * abs(lower) <= model.base_score[0] <= upper + 1e-5 * abs(upper)


def _counted(derivatives):
    """``derivatives`` (c -> (slope, curvature)) as ``newton_minimiser`` takes it (float64
    slopes: rounding below 1e-9), and the list of points it was asked at."""
    asked = []

    def counted(c):
        asked.append(c)
        return (*derivatives(c), 1e-9)
    return counted, asked


_LABELS = 7.0 + 40.0 * np.random.default_rng(20).standard_t(3, size=1000)
_LABEL_WEIGHTS = np.random.default_rng(21).uniform(0.1, 3.0, size=1000)


def _weighted_sigmoid_slope(c):
    positive = (_LABELS > 30.0).astype(np.float64)
    p = 1.0 / (1.0 + np.exp(-c))
    return np.sum(_LABEL_WEIGHTS * (p - positive)), np.sum(_LABEL_WEIGHTS * p * (1 - p))


@pytest.mark.parametrize("case", ["squared", "logistic", "poisson", "overstated curvature", "understated curvature",
                                  "defined above 0 only", "defined below 5 only", "far from 0",
                                  "overstated near the minimum"])
def test_newton_minimiser_finds_a_smooth_minimum(case):
    """The host's safeguarded Newton steps (a custom loss's starting value, from a compiled
    round's derivatives) against the minimisers' closed forms or a float64 bisection: Newton's
    few steps where the curvature is exact, bracketing and secants where it misleads by 10^4
    either way or only near the minimum, a loss undefined at and below 0 or above 5, a minimiser
    far from 0. The calls' bounds hold the secants' gain over bisection (which took 28-38 calls
    in the Poisson and misleading cases, 26 undefined above 5)."""
    w, y = _LABEL_WEIGHTS, _LABELS
    mean = np.sum(w * y) / np.sum(w)
    derivatives, expected, most_calls = {
        "squared": (lambda c: (np.sum(w * (c - y)), np.sum(w)), mean, 3),
        "logistic": (_weighted_sigmoid_slope, None, 8),
        "poisson": (lambda c: (np.sum(w * (np.exp(c) - np.abs(y))), np.sum(w * np.exp(c))),
                    np.log(np.sum(w * np.abs(y)) / np.sum(w)), 25),
        "overstated curvature": (lambda c: (np.sum(w * (c - y)), 1e4 * np.sum(w)), mean, 20),
        "understated curvature": (lambda c: (np.sum(w * (c - y)), 1e-4 * np.sum(w)), mean, 8),
        "defined above 0 only": (lambda c: (1.0 - 3e-3 / c, 3e-3 / c ** 2) if c > 0 else (np.nan, np.nan), 3e-3, 16),
        # Newton's first step (7.5) lands where the loss is not defined.
        "defined below 5 only": (lambda c: (1.0 / (5.0 - c) - 0.5, 1.0 / (5.0 - c) ** 2) if c < 5 else (np.nan, np.nan),
                                 3.0, 16),
        "far from 0": (lambda c: (c - 1e4, 1.0), 1e4, 3),
        # Newton's steps halve the slope on the way in, then one step of 1e-11 does not.
        "overstated near the minimum": (lambda c: ((c - 10) ** 3 + (c - 10),
                                                   (3 * (c - 10) ** 2 + 1) * (1e9 if abs(c - 10) < 0.1 else 1.0)),
                                        10.0, 40),
    }[case]
    if expected is None:  # the slope's root by bisection in float64
        lower, upper = -50.0, 50.0
        for _ in range(200):
            middle = 0.5 * (lower + upper)
            lower, upper = (middle, upper) if derivatives(middle)[0] < 0 else (lower, middle)
        expected = 0.5 * (lower + upper)
    counted, asked = _counted(derivatives)
    found = newton_minimiser(counted)
    np.testing.assert_allclose(found, expected, rtol=4e-7, atol=1e-12)
    assert len(asked) <= most_calls, (len(asked), asked)


def test_newton_minimiser_stops_at_an_exact_or_unresolved_slope():
    """A zero slope at 0 ends the search there at once; a slope within its stated noise (a
    float32 loss's rounding) ends it where Newton's first step lands; a piecewise-linear loss
    (curvature stood in by the weights) gets its weighted median by bisection."""
    counted, asked = _counted(lambda c: (c, 1.0))
    assert newton_minimiser(counted) == 0.0 and asked == [0.0]
    w, y = _LABEL_WEIGHTS, _LABELS
    mean = np.sum(w * y) / np.sum(w)
    asked = []

    def noisy(c):
        asked.append(c)
        return np.sum(w * (c - y)) + 1e-3, np.sum(w), 1e-2  # off by rounding below the noise
    assert newton_minimiser(noisy) == pytest.approx(mean - 1e-3 / np.sum(w), rel=1e-9) and len(asked) == 2
    counted, asked = _counted(lambda c: (np.sum(w * np.sign(c - y)), np.sum(w)))
    median = newton_minimiser(counted)
    lower, upper = weighted_quantile_interval(y, w, 0.5)
    assert lower - 1e-6 * abs(lower) <= median <= upper + 1e-6 * abs(upper)
    assert len(asked) <= 64


@pytest.mark.parametrize("settings", [dict(), dict(subsample=0.5, hessian="constant")])
def test_a_smooth_custom_loss_starts_from_its_rounds_derivatives(settings, monkeypatch):
    """A one-output smooth custom loss (written as the logistic loss) finds its starting value
    by Newton steps on its compiled round's derivatives (``SplitRound.derivative_sums``), with
    no program of its own: the sweeps' value to float32 rounding, whatever the row sample and
    the Hessian's mode (neither of which a starting value takes), in a few calls (Newton's
    steps end where the slope is float32 rounding: else they gave way to bisection there)."""
    from jaxboost import boosting

    def logistic_by_hand(f, y):
        return jax.nn.softplus(f) - y * f

    calls = []
    monkeypatch.setattr(boosting.SplitRound, "derivative_sums",
                        lambda self, *arguments, sums=boosting.SplitRound.derivative_sums:
                        calls.append(arguments) or sums(self, *arguments))

    rng = np.random.default_rng(22)
    X = rng.normal(size=(N_ROWS, 3)).astype(np.float32)
    y = (rng.uniform(size=N_ROWS) < 0.2).astype(np.float32)
    weights = _weights(22)
    model, traced = _trained_and_traced(jb.Dataset(X, y, sample_weight=weights), loss=logistic_by_hand,
                                        num_rounds=1, max_depth=2, **settings)
    assert "round_statistics" in traced and "_coordinate_sweeps" not in traced, traced
    assert 2 <= len(calls) <= (8 if settings.get("hessian") is None else 40), len(calls)
    objective = Objective(logistic_by_hand, vector_output=False, num_outputs=1, link=identity)
    sweeps = np.asarray(starting_value(objective, jnp.zeros((N_ROWS, 1)), jnp.asarray(y), jnp.asarray(weights)))
    np.testing.assert_allclose(np.asarray(model.base_score), sweeps, rtol=1e-5)
    share = np.sum(weights * y) / np.sum(weights)
    np.testing.assert_allclose(model.base_score, [np.log(share / (1 - share))], rtol=1e-5)


@pytest.mark.parametrize("n_rows,num_segments", [(0, 3), (1, 3), (7, 3), (1003, 127)])
def test_segment_sums_add_each_segments_rows_and_leave_out_other_ids(n_rows, num_segments):
    """Leaf refits' segment sums (the native kernel on CPU, four partial sums; XLA's scatter
    elsewhere) against NumPy: every id's rows summed, ids outside the segments left out, any
    row count (the kernel's last rows past its blocks of four)."""
    from jaxboost.line_search import segment_sums

    rng = np.random.default_rng(n_rows)
    values = rng.normal(size=n_rows).astype(np.float32)
    ids = rng.integers(-2, num_segments + 2, size=n_rows).astype(np.int32)  # some out of range
    expected = np.zeros(num_segments)
    inside = (ids >= 0) & (ids < num_segments)
    np.add.at(expected, ids[inside], values[inside].astype(np.float64))
    sums = jax.jit(lambda v, i: segment_sums(v, i, num_segments))(jnp.asarray(values), jnp.asarray(ids))
    assert sums.shape == (num_segments,) and sums.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(sums), expected, rtol=1e-5, atol=1e-5)


def _labels(name: str, rng, n: int = N_ROWS) -> np.ndarray:
    """Labels a built-in takes, with a spread on its own scale."""
    if name in ("logistic", "exponential", "hinge"):
        return (rng.uniform(size=n) < 0.3).astype(np.float32)
    if name == "softmax":
        return rng.choice(4, size=n, p=[0.1, 0.2, 0.3, 0.4]).astype(np.int32)
    if name in ("poisson", "tweedie", "negative_binomial"):
        return rng.poisson(2.5, size=n).astype(np.float32)
    if name in ("gamma", "lognormal_nll"):
        return rng.gamma(2.0, 1.5, size=n).astype(np.float32)
    if name == "student_t_nll":  # heavy tails, and a mean away from the minimising location
        return (40.0 + 3.0 * rng.standard_t(2.0, size=n) + 20.0 * (rng.uniform(size=n) < 0.05)).astype(np.float32)
    return (40.0 + 3.0 * rng.normal(size=n)).astype(np.float32)


CLOSED_FORMS = [(name, {}) for name, record in losses.BUILTINS.items() if record.optimal_constant is not None] + [
    ("tweedie", {"power": 1.2}), ("tweedie", {"power": 1.8}), ("negative_binomial", {"alpha": 0.3}),
    ("negative_binomial", {"alpha": 3.0}), ("quantile", {"tau": 0.1}), ("quantile", {"tau": 0.9}),
    ("student_t_nll", {"df": 1.5}), ("student_t_nll", {"df": 40.0})]


def _closed_form(record, y, weights, K, loss_params):
    """``record.optimal_constant`` with the loss's default parameters under ``loss_params``, as
    the library calls it."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(record.function).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    return record.optimal_constant(y, weights, K, **{**defaults, **loss_params})


@pytest.mark.parametrize("name, loss_params", CLOSED_FORMS)
def test_a_built_ins_closed_form_constant_is_its_numerical_minimiser(name, loss_params):
    """A built-in's closed-form best constant (``optimal_constant``) against the library's
    numerical minimisation of the same loss on the same weighted labels (the way of every custom
    loss), for each parameter: the same constant to float32's resolution, and never a larger
    weighted loss. Softmax's logs are centred as Newton's steps centre them."""
    record = losses.BUILTINS[name]
    rng = np.random.default_rng(len(name) + 10 * len(loss_params))
    y, weights = _labels(name, rng), _weights(11)
    K = 4 if record.multiclass else record.num_outputs or 1
    objective = _vector_objective(record.function, K) if K > 1 or record.num_outputs else Objective(
        record.function, vector_output=False, num_outputs=1, link=identity)
    params = {key: jnp.float32(value) for key, value in loss_params.items()}
    numerical = np.asarray(starting_value(objective, jnp.zeros((N_ROWS, K)), jnp.asarray(y), jnp.asarray(weights),
                                          params), np.float64)
    closed = _closed_form(record, y, weights, K, loss_params)
    assert closed.shape == (K,) and closed.dtype == np.float64
    np.testing.assert_allclose(closed, numerical, rtol=2e-5, atol=2e-5, err_msg=f"{name} {loss_params}")

    def weighted_loss(constant):
        raw = jnp.broadcast_to(jnp.asarray(constant, jnp.float32), (N_ROWS, K))
        per_row = jax.vmap(lambda f, label: record.function(f if K > 1 or record.num_outputs else f[0], label,
                                                            **params))(raw, jnp.asarray(y))
        return float(np.dot(np.asarray(per_row, np.float64), weights))

    assert weighted_loss(closed) <= weighted_loss(numerical) * (1 + 1e-6) + 1e-6, name


@pytest.mark.parametrize("name, label, expected", [
    ("logistic", 0.0, [np.log(np.finfo(np.float32).tiny)]), ("logistic", 1.0, [-np.log(np.finfo(np.float32).tiny)]),
    ("poisson", 0.0, [np.log(np.finfo(np.float32).tiny)]), ("tweedie", 0.0, [np.log(np.finfo(np.float32).tiny)]),
    ("gaussian_nll", 3.0, [3.0, np.log(3.0 * np.finfo(np.float32).eps)]),
    ("gaussian_nll", 0.0, [0.0, np.log(np.finfo(np.float32).eps)]),
    ("lognormal_nll", 2.0, [np.log(2.0), np.log(np.finfo(np.float32).eps)]),
    ("student_t_nll", -5.0, [-5.0, np.log(5.0 * np.finfo(np.float32).eps)])])
def test_labels_without_a_minimiser_start_where_float32_stops(name, label, expected):
    """One label for every row: a log-scale mean of 0 or a Gaussian without spread has no
    minimiser. The constant stops at float32's smallest normal number or resolution (the
    numerical minimisation had run a Gaussian's mean off to 9e17), and a model trained from it
    predicts the label."""
    n = 400
    X = np.random.default_rng(12).normal(size=(n, 3)).astype(np.float32)
    y = np.full(n, label, np.float32)
    model = jb.train(X, y, loss=name, num_rounds=3, max_depth=2)
    np.testing.assert_allclose(np.asarray(model.base_score, np.float64), expected, rtol=1e-6)
    prediction = np.asarray(model.predict(X), np.float64)
    location = prediction[:, 0] if prediction.ndim == 2 else prediction
    np.testing.assert_allclose(location, expected[0] if name == "lognormal_nll" else label, atol=1e-6)
    if prediction.ndim == 2:  # (location, scale): the scale at float32's resolution of the location
        assert np.all(prediction[:, 1] < 1e-6 * max(abs(expected[0]), 1)), prediction[:2]


@pytest.mark.parametrize("share, df", [(0.9, 5.0), (0.7, 1.5)])
def test_a_student_t_whose_likelihood_has_no_minimum_stops_at_float32_resolution(share, df):
    """More than df / (df + 1) of the weight on one label: the Student t likelihood falls without
    bound as the scale shrinks about that label. The host's minimisation stops where float32
    resolves the scale at the location (it had overflowed), and a model trained from it predicts
    the label. (The numerical program's steps had stopped near there for 90% at df 5, and run
    the location off to 9e17 for 70% at df 1.5.)"""
    rng = np.random.default_rng(23)
    n = 2000
    y = np.where(rng.uniform(size=n) < share, 3.0, rng.normal(size=n)).astype(np.float32)
    floor = np.log(3.0 * np.finfo(np.float32).eps)
    constant = losses._optimal_constants.student_t(y, np.ones(n, np.float32), 2, df=df)
    np.testing.assert_allclose(constant, [3.0, floor], rtol=1e-6)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    model = jb.train(X, y, loss="student_t_nll", loss_params={"df": df}, num_rounds=3, max_depth=2)
    np.testing.assert_allclose(np.asarray(model.predict(X[:5]))[:, 0], 3.0, rtol=1e-6)


@pytest.mark.parametrize("loss, num_classes", [("softmax", 3), ("gaussian_nll", None), ("logistic", None),
                                               ("student_t_nll", None)])
def test_a_built_in_with_a_closed_form_finds_its_constant_without_a_program(monkeypatch, loss, num_classes):
    """``jb.train`` and ``train_many`` take a built-in's closed form: the numerical minimisation,
    a program of its own to compile, is never called. Each of train_many's models takes the
    constant of its own weights, the same as ``jb.train`` with those weights."""
    def numerical(*args, **kwargs):
        raise AssertionError("the numerical starting value was called")

    monkeypatch.setattr(training, "starting_value", numerical)
    from jaxboost import vmapped_training
    monkeypatch.setattr(vmapped_training, "starting_value", numerical)
    rng = np.random.default_rng(13)
    n = 300
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = _labels(loss, rng, n)
    if num_classes:
        y = np.minimum(y, num_classes - 1)
    weights = [_weights(14, n), _weights(15, n)]
    models = jb.train_many(X, y, sample_weights=np.stack(weights), loss=loss, num_rounds=1, max_depth=2)
    for model, w in zip(models, weights):
        alone = jb.train(jb.Dataset(X, y, sample_weight=w), loss=loss, num_rounds=1, max_depth=2)
        K = num_classes or losses.BUILTINS[loss].num_outputs or 1
        expected = _closed_form(losses.BUILTINS[loss], y, w, K, {}).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(alone.base_score), expected)
        np.testing.assert_array_equal(np.asarray(model.base_score), expected)


@pytest.mark.parametrize("positive_weight, expected", [(3.0, 1.0), (1.0, -1.0), (2.0, 0.0)])
def test_hinges_constant_is_the_margin_towards_the_heavier_class(positive_weight, expected):
    """Two rows of weight 1 labelled 0 against one labelled 1: a margin of 1 towards the heavier
    class, and 0 (the middle of the flat [-1, 1]) when the classes weigh the same."""
    y = np.array([0.0, 1.0, 0.0], np.float32)
    weights = np.array([1.0, positive_weight, 1.0], np.float32)
    np.testing.assert_array_equal(losses.BUILTINS["hinge"].optimal_constant(y, weights, 1), [expected])


@pytest.mark.parametrize("tau, expected", [(0.5, 2.5), (0.25, 1.5), (0.3, 2.0), (0.75, 3.5)])
def test_a_weighted_quantile_between_two_labels_takes_their_midpoint(tau, expected):
    """Unit weights on the labels 1..4 (and a row of weight zero, the devices' padding, that
    counts for nothing): where the rows at or below a label carry exactly ``tau`` of the weight,
    every point up to the next label minimises the pinball loss, and the midpoint is taken (the
    usual median of an even count); otherwise the smallest label past ``tau`` of the weight."""
    y = np.array([4.0, 2.0, 1.0, 3.0, -50.0], np.float32)
    weights = np.array([1, 1, 1, 1, 0], np.float32)
    closed = losses.BUILTINS["quantile"].optimal_constant(y, weights, 1, tau=tau)
    np.testing.assert_array_equal(closed, [expected])
    if tau == 0.5:
        np.testing.assert_array_equal(losses.BUILTINS["absolute_error"].optimal_constant(y, weights, 1), [expected])


def test_train_many_takes_each_models_quantile_level(monkeypatch):
    """A batch of quantile levels: each model starts from the weighted quantile at its own
    ``tau``, from the closed form (the numerical minimisation is never called); ``jb.train``
    with the same ``tau`` starts from the same value."""
    def numerical(*args, **kwargs):
        raise AssertionError("the numerical starting value was called")

    from jaxboost import vmapped_training
    monkeypatch.setattr(vmapped_training, "starting_value", numerical)
    rng = np.random.default_rng(16)
    X = rng.normal(size=(301, 3)).astype(np.float32)
    y = rng.standard_t(3, size=301).astype(np.float32)
    models = jb.train_many(X, y, loss="quantile", batch={"tau": [0.2, 0.5, 0.9]}, num_rounds=1, max_depth=2)
    starts = [float(np.asarray(model.base_score)[0]) for model in models]
    np.testing.assert_allclose(starts, np.quantile(y.astype(np.float64), [0.2, 0.5, 0.9], method="inverted_cdf"),
                               rtol=1e-6)
    monkeypatch.setattr(training, "starting_value", numerical)
    alone = jb.train(X, y, loss="quantile", loss_params={"tau": 0.9}, num_rounds=1, max_depth=2)
    np.testing.assert_array_equal(np.asarray(alone.base_score), np.float32(starts[2]))


def test_a_class_without_rows_starts_where_float32_stops_and_is_never_predicted():
    """Softmax over 4 classes whose labels hold 3: the absent class has no minimiser (its
    constant falls without end); it starts at the log of float32's smallest normal number below
    the present classes' mean, they at their centred log frequencies, and the model predicts
    the absent class with probability under 1e-30, the others near their frequencies."""
    rng = np.random.default_rng(17)
    n = 300
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.choice(3, size=n, p=[0.2, 0.3, 0.5]).astype(np.float32)
    model = jb.train(X, y, loss="softmax", num_outputs=4, num_rounds=2, max_depth=2)
    start = np.asarray(model.base_score, np.float64)
    logs = np.log(np.bincount(y.astype(int), minlength=3) / n)
    np.testing.assert_allclose(start[:3], logs - logs.mean(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(start[3], np.log(np.finfo(np.float32).tiny) - logs.mean(), rtol=1e-6)
    probabilities = np.asarray(model.predict(X))  # softmax's link: class probabilities
    assert probabilities.shape == (n, 4) and np.all(np.isfinite(probabilities))
    assert probabilities[:, 3].max() < 1e-30
    np.testing.assert_allclose(probabilities[:, :3].mean(axis=0), np.bincount(y.astype(int)) / n, atol=0.05)


@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("tau", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_a_weighted_quantile_is_the_quantile_of_repeated_rows(n, tau):
    """A row of weight 2 counts as the row twice: the sort of weighted rows gives what the
    selection of equally weighted rows gives on the data with that row repeated, ties (exactly
    tau of the weight) and their midpoints included; both are the usual quantile of the
    repeated data where no tie arises."""
    y = np.random.default_rng(n).permutation(np.arange(n, dtype=np.float32) * 1.5)
    weights = np.ones(n, np.float32)
    weights[2] = 2.0
    repeated = np.concatenate([y, y[2:3]])
    record = losses.BUILTINS["quantile"]
    weighted = record.optimal_constant(y, weights, 1, tau=np.float32(tau))
    selected = record.optimal_constant(repeated, np.ones(n + 1, np.float32), 1, tau=np.float32(tau))
    np.testing.assert_array_equal(weighted, selected)
    target = np.float32(tau) * (n + 1)
    if target != np.floor(target):
        np.testing.assert_array_equal(selected, [np.quantile(repeated.astype(np.float64), float(np.float32(tau)),
                                                             method="inverted_cdf")])


@pytest.mark.parametrize("loss", ["absolute_error", "quantile"])
def test_a_fit_refit_with_an_accelerators_probes_is_the_cpus_fit(monkeypatch, loss):
    """A whole fit whose leaf refits take ``ACCELERATOR_PROBES`` probes a step (as lowered for a
    GPU), here on CPU, against the CPU's bisection: both stop at float32 resolution, so with
    weighted rows (each leaf's quantile a single residual) the leaves and the predictions agree."""
    from jaxboost import boosting, line_search

    rng = np.random.default_rng(7)
    X = rng.normal(size=(2000, 5)).astype(np.float32)
    y = (3.0 * X[:, 0] + np.sin(2.0 * X[:, 1]) + rng.standard_t(3, size=2000)).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=2000).astype(np.float32)
    settings = dict(loss=loss, num_rounds=6, max_depth=3, learning_rate=0.5, reg_lambda=0.0)
    calls = []

    def fit():
        boosting.clear_compiled_rounds()
        try:
            return jb.train(jb.Dataset(X, y, sample_weight=weights), **settings)
        finally:
            boosting.clear_compiled_rounds()

    bisected = fit()
    monkeypatch.setattr(line_search, "probes_per_step", lambda: calls.append(1) or line_search.ACCELERATOR_PROBES)
    probed = fit()
    assert calls, "the refit did not ask for the accelerators' probes"
    np.testing.assert_array_equal(probed.trees.feature, bisected.trees.feature)
    is_leaf = np.asarray(bisected.trees.is_leaf)
    np.testing.assert_allclose(np.asarray(probed.trees.value)[is_leaf], np.asarray(bisected.trees.value)[is_leaf],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probed.predict(X), bisected.predict(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("tau", [0.1, 0.5, 0.9])
def test_one_segment_of_every_row_is_the_weighted_quantile(platform, tau):
    """One segment holding every row (a starting value's search, summed over rows rather than
    scattered), bisected on CPU or probed as on an accelerator: the weighted tau-quantile."""
    F, y, weights, residuals = make_rows(6, 10.0)

    @jax.jit
    def one_segment(raw_prediction, labels, row_weights):
        with lowered_as(platform):
            return minimise_offsets(PINBALL[tau], raw_prediction, labels, row_weights,
                                    jnp.zeros(N_ROWS, jnp.int32), 1, 0, Regularization(F32(0), F32(0), F32(0)))

    result = np.asarray(one_segment(*placed_as(platform, (F[:, None], y, weights))), np.float64)
    assert result.shape == (1,)
    lower, upper = weighted_quantile_interval(residuals, weights.astype(np.float64), tau)
    tolerance = 1e-5 * np.max(np.abs(residuals))
    assert lower - tolerance <= result[0] <= upper + tolerance, (result[0], lower, upper)


@pytest.mark.parametrize("loss", ["absolute", "squared"])
def test_order_independent_sums_of_an_accelerators_probes_find_the_minimisers(loss):
    """``deterministic`` (fixed-point segment sums, one scale for all the probes' values) with
    the accelerators' probes: the weighted medians, and squared error's penalised means."""
    F, y, weights, residuals = make_rows(8, 100.0)
    objective, reg_lambda = (ABSOLUTE, 0.0) if loss == "absolute" else (SQUARED, 3.0)

    @jax.jit
    def fixed_point_offsets(raw_prediction, labels, row_weights, segment_ids):
        with lowered_as("accelerator"):
            return minimise_offsets(objective, raw_prediction, labels, row_weights, segment_ids, NUM_SEGMENTS, 0,
                                    Regularization(F32(reg_lambda), F32(0), F32(0)), deterministic=True)

    result = np.asarray(fixed_point_offsets(F[:, None], y, weights, SEGMENT_IDS), np.float64)
    if loss == "absolute":
        check_quantile_offsets(result, residuals, weights, 0.5, "(fixed-point sums, accelerator probes)")
        return
    for segment in range(len(SEGMENT_SIZES)):
        rows = SEGMENT_IDS == segment
        w = weights[rows].astype(np.float64)
        expected = np.sum(w * residuals[rows]) / (np.sum(w) + reg_lambda)
        np.testing.assert_allclose(result[segment], expected, rtol=1e-5, atol=1e-5 * 100.0,
                                   err_msg=f"segment {segment}: not sum w r / (sum w + lambda)")
    assert result[EMPTY_SEGMENT] == 0.0
