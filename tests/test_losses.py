"""Tests of the built-in objectives against closed forms written here in NumPy."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats
from conftest import cpu_argument

import jaxboost as jb
from jaxboost import derivatives, losses
from jaxboost.devices import compiler_options


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x):
    shifted = np.exp(x - np.max(x))
    return shifted / shifted.sum()


def _signed(y):
    return 2.0 * y - 1.0


class ClosedForm(NamedTuple):
    """A loss's value, gradient and Hessian diagonal in NumPy, each ``(F, y, **params)``."""

    points: list  # (F, y) pairs, away from kinks for the piecewise-linear losses
    value: Callable
    gradient: Callable
    hessian: Callable  # the Hessian diagonal autodiff must report
    # The second derivative of the value where it differs from the reported curvature
    # (Fisher scoring); finite differences of the value must match it.
    exact_hessian: Callable | None = None


def _z(F, y):
    """Standardised residual of a (mu, log_sigma) raw prediction."""
    return (y - F[0]) * np.exp(-F[1])


def _student_t_log_normaliser(df):
    return scipy.special.gammaln(df / 2) - scipy.special.gammaln((df + 1) / 2) + 0.5 * np.log(df * np.pi)


HALF_LOG_2PI = 0.5 * np.log(2 * np.pi)
# (mu, log_sigma) raw predictions and labels; the Student-t points include an outlier
# (|z| = 4 > sqrt(5)) where its exact curvature in mu is negative.
DISTRIBUTION_POINTS = [(np.array([0.3, -0.5]), 2.0), (np.array([-1.0, 0.7]), -1.5), (np.array([1.0, 0.0]), 1.0)]


LOGITS = np.array([0.2, -1.0, 1.5])

CLOSED_FORMS = {
    "squared_error": ClosedForm(
        points=[(0.3, 1.2), (-2.0, 0.5), (1.5, 1.5)],
        value=lambda F, y: 0.5 * (y - F) ** 2,
        gradient=lambda F, y: F - y,
        hessian=lambda F, y: 1.0,
    ),
    "absolute_error": ClosedForm(
        points=[(0.3, 1.2), (-2.0, -3.5), (2.0, 0.1)],
        value=lambda F, y: abs(y - F),
        gradient=lambda F, y: np.sign(F - y),
        hessian=lambda F, y: 0.0,
    ),
    "pseudo_huber": ClosedForm(
        points=[(0.3, 1.2), (-2.0, 3.0), (0.0, 0.0), (4.0, -6.0)],
        value=lambda F, y, delta=1.0: delta**2 * (np.sqrt(1 + ((y - F) / delta) ** 2) - 1),
        gradient=lambda F, y, delta=1.0: -(y - F) / np.sqrt(1 + ((y - F) / delta) ** 2),
        hessian=lambda F, y, delta=1.0: (1 + ((y - F) / delta) ** 2) ** -1.5,
    ),
    "quantile": ClosedForm(
        points=[(0.3, 1.2), (2.0, -0.5)],
        value=lambda F, y, tau=0.5: max(tau * (y - F), (tau - 1) * (y - F)),
        gradient=lambda F, y, tau=0.5: -tau if y > F else 1 - tau,
        hessian=lambda F, y, tau=0.5: 0.0,
    ),
    "logistic": ClosedForm(
        points=[(0.3, 1.0), (-2.0, 0.0), (1.5, 0.25)],
        value=lambda F, y: -y * np.log(_sigmoid(F)) - (1 - y) * np.log(1 - _sigmoid(F)),
        gradient=lambda F, y: _sigmoid(F) - y,
        hessian=lambda F, y: _sigmoid(F) * (1 - _sigmoid(F)),
    ),
    "softmax": ClosedForm(
        points=[(LOGITS, 0), (LOGITS, 2), (np.zeros(3), 1)],
        value=lambda F, y: -np.log(_softmax(F)[y]),
        gradient=lambda F, y: _softmax(F) - np.eye(len(F))[y],
        hessian=lambda F, y: _softmax(F) * (1 - _softmax(F)),
    ),
    "poisson": ClosedForm(
        points=[(0.3, 2.0), (-1.0, 0.0), (1.2, 5.0)],
        value=lambda F, y: np.exp(F) - y * F,
        gradient=lambda F, y: np.exp(F) - y,
        hessian=lambda F, y: np.exp(F),
    ),
    "gamma": ClosedForm(
        points=[(0.3, 2.0), (-1.0, 0.5), (1.0, 1.0)],
        value=lambda F, y: y / np.exp(F) + F,
        gradient=lambda F, y: 1 - y / np.exp(F),
        hessian=lambda F, y: y / np.exp(F),
    ),
    "tweedie": ClosedForm(
        points=[(0.3, 2.0), (-1.0, 0.0), (0.8, 1.5)],
        value=lambda F, y, power=1.5: (
            -y * np.exp((1 - power) * F) / (1 - power) + np.exp((2 - power) * F) / (2 - power)
        ),
        gradient=lambda F, y, power=1.5: -y * np.exp((1 - power) * F) + np.exp((2 - power) * F),
        hessian=lambda F, y, power=1.5: (
            -y * (1 - power) * np.exp((1 - power) * F) + (2 - power) * np.exp((2 - power) * F)
        ),
    ),
    "negative_binomial": ClosedForm(
        points=[(0.3, 2.0), (-1.0, 0.0), (1.2, 7.0)],
        value=lambda F, y, alpha=1.0: (
            -scipy.special.gammaln(y + 1 / alpha) + scipy.special.gammaln(1 / alpha) + scipy.special.gammaln(y + 1)
            - y * np.log(alpha * np.exp(F) / (1 + alpha * np.exp(F))) + np.log(1 + alpha * np.exp(F)) / alpha
        ),
        gradient=lambda F, y, alpha=1.0: (np.exp(F) - y) / (1 + alpha * np.exp(F)),
        hessian=lambda F, y, alpha=1.0: np.exp(F) * (1 + alpha * y) / (1 + alpha * np.exp(F)) ** 2,
    ),
    "exponential": ClosedForm(
        points=[(0.3, 1.0), (-0.7, 0.0), (1.1, 0.0)],
        value=lambda F, y: np.exp(-_signed(y) * F),
        gradient=lambda F, y: -_signed(y) * np.exp(-_signed(y) * F),
        hessian=lambda F, y: np.exp(-_signed(y) * F),
    ),
    "hinge": ClosedForm(
        # Margin violated (loss > 0) and satisfied (loss 0), for each label.
        points=[(0.3, 1.0), (2.0, 1.0), (0.5, 0.0), (-2.0, 0.0)],
        value=lambda F, y: max(0.0, 1 - _signed(y) * F),
        gradient=lambda F, y: -_signed(y) if 1 - _signed(y) * F > 0 else 0.0,
        hessian=lambda F, y: 0.0,
    ),
    "gaussian_nll": ClosedForm(
        points=DISTRIBUTION_POINTS,
        value=lambda F, y: F[1] + 0.5 * _z(F, y) ** 2 + HALF_LOG_2PI,
        gradient=lambda F, y: np.array([-(y - F[0]) * np.exp(-2 * F[1]), 1 - _z(F, y) ** 2]),
        hessian=lambda F, y: np.array([np.exp(-2 * F[1]), 2 * _z(F, y) ** 2]),
    ),
    "lognormal_nll": ClosedForm(
        points=[(np.array([0.3, -0.5]), 2.0), (np.array([-1.0, 0.7]), 0.2), (np.array([0.0, 0.0]), 1.0)],
        value=lambda F, y: F[1] + 0.5 * _z(F, np.log(y)) ** 2 + HALF_LOG_2PI + np.log(y),
        gradient=lambda F, y: np.array([-(np.log(y) - F[0]) * np.exp(-2 * F[1]), 1 - _z(F, np.log(y)) ** 2]),
        hessian=lambda F, y: np.array([np.exp(-2 * F[1]), 2 * _z(F, np.log(y)) ** 2]),
    ),
    "student_t_nll": ClosedForm(
        points=DISTRIBUTION_POINTS + [(np.array([0.0, 0.0]), 4.0), (np.array([0.5, -1.0]), -2.0)],
        value=lambda F, y, df=5.0: (
            F[1] + (df + 1) / 2 * np.log1p(_z(F, y) ** 2 / df) + _student_t_log_normaliser(df)
        ),
        gradient=lambda F, y, df=5.0: np.array([
            -(df + 1) * _z(F, y) * np.exp(-F[1]) / (df + _z(F, y) ** 2),
            1 - (df + 1) * _z(F, y) ** 2 / (df + _z(F, y) ** 2),
        ]),
        hessian=lambda F, y, df=5.0: np.array([(df + 1) / (df + 3) * np.exp(-2 * F[1]), 2 * df / (df + 3)]),
        exact_hessian=lambda F, y, df=5.0: np.array([
            (df + 1) * (df - _z(F, y) ** 2) / (df + _z(F, y) ** 2) ** 2 * np.exp(-2 * F[1]),
            2 * df * (df + 1) * _z(F, y) ** 2 / (df + _z(F, y) ** 2) ** 2,
        ]),
    ),
}

# Every built-in with its default parameters, plus non-default parameters where it has any.
VARIANTS = [(name, {}) for name in CLOSED_FORMS] + [
    ("quantile", {"tau": 0.9}),
    ("quantile", {"tau": 0.1}),
    ("pseudo_huber", {"delta": 0.5}),
    ("pseudo_huber", {"delta": 3.0}),
    ("tweedie", {"power": 1.2}),
    ("tweedie", {"power": 1.8}),
    ("negative_binomial", {"alpha": 0.2}),
    ("negative_binomial", {"alpha": 5.0}),
    ("student_t_nll", {"df": 2.5}),
    ("student_t_nll", {"df": 30.0}),
]
VARIANT_IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in VARIANTS]


def _as_jax(F, y, float_dtype):
    """Casts one example the way the library passes it: float raw predictions, and an
    int32 class label for softmax."""
    label_dtype = jnp.int32 if isinstance(y, int) else float_dtype
    return jnp.asarray(F, float_dtype), jnp.asarray(y, label_dtype)


def _gradient_and_hessian_diagonal(fn, F, y):
    gradient = jax.grad(fn)(F, y)
    if F.ndim == 0:
        hessian = jax.jvp(lambda F: jax.grad(fn)(F, y), (F,), (jnp.ones_like(F),))[1]
    else:
        hessian = jnp.diag(jax.hessian(fn)(F, y))
    return gradient, hessian


def _finite_differences(fn, F, y):
    """Central differences of the value in every coordinate of F: first and second order."""
    gradient_step, hessian_step = 1e-6, 1e-4
    flat = np.atleast_1d(np.asarray(F, np.float64))
    gradient, hessian = np.empty_like(flat), np.empty_like(flat)

    def value_at(shift, k, step):
        moved = flat.copy()
        moved[k] += shift * step
        return float(fn(jnp.asarray(moved.reshape(np.shape(F))), y))

    center = float(fn(F, y))
    for k in range(flat.size):
        gradient[k] = (value_at(1, k, gradient_step) - value_at(-1, k, gradient_step)) / (
            2 * gradient_step
        )
        hessian[k] = (
            value_at(1, k, hessian_step) - 2 * center + value_at(-1, k, hessian_step)
        ) / hessian_step**2
    return gradient.reshape(np.shape(F)), hessian.reshape(np.shape(F))


@pytest.mark.parametrize("name, params", VARIANTS, ids=VARIANT_IDS)
def test_value_matches_closed_form(name, params):
    fn = functools.partial(losses.BUILTINS[name].function, **params)
    closed_form = CLOSED_FORMS[name]
    for F, y in closed_form.points:
        got = fn(*_as_jax(F, y, jnp.float32))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(
            got, closed_form.value(F, y, **params), rtol=1e-5, atol=1e-6, err_msg=f"F={F}, y={y}"
        )


@pytest.mark.parametrize("name, params", VARIANTS, ids=VARIANT_IDS)
def test_autodiff_derivatives_match_finite_differences_and_closed_form(name, params):
    # Compiled once per shape: the finite differences evaluate the loss many times.
    fn = jax.jit(functools.partial(losses.BUILTINS[name].function, **params))
    closed_form = CLOSED_FORMS[name]
    with jax.enable_x64(True):
        for F, y in closed_form.points:
            F_jax, y_jax = _as_jax(F, y, jnp.float64)
            gradient, hessian = _gradient_and_hessian_diagonal(fn, F_jax, y_jax)
            fd_gradient, fd_hessian = _finite_differences(fn, F_jax, y_jax)
            where = f"F={F}, y={y}"
            np.testing.assert_allclose(gradient, fd_gradient, rtol=1e-6, atol=1e-8, err_msg=where)
            if closed_form.exact_hessian is None:
                np.testing.assert_allclose(hessian, fd_hessian, rtol=1e-5, atol=1e-6, err_msg=where)
            else:
                np.testing.assert_allclose(
                    fd_hessian, closed_form.exact_hessian(F, y, **params), rtol=1e-5, atol=1e-6, err_msg=where
                )
            np.testing.assert_allclose(
                gradient, closed_form.gradient(F, y, **params), rtol=1e-10, atol=1e-12, err_msg=where
            )
            np.testing.assert_allclose(
                hessian, closed_form.hessian(F, y, **params), rtol=1e-10, atol=1e-12, err_msg=where
            )


def test_x64_is_restored_after_derivative_tests():
    assert jnp.asarray(1.0).dtype == jnp.float32


@pytest.mark.parametrize("name", list(CLOSED_FORMS))
def test_jit_and_vmap_over_rows(name):
    fn = losses.BUILTINS[name].function
    closed_form = CLOSED_FORMS[name]
    raw_predictions = np.stack([np.asarray(F, np.float32) for F, _ in closed_form.points])
    labels = np.array([y for _, y in closed_form.points])
    label_dtype = jnp.int32 if name == "softmax" else jnp.float32
    F_rows, y_rows = jnp.asarray(raw_predictions), jnp.asarray(labels, label_dtype)

    values = jax.jit(jax.vmap(fn))(F_rows, y_rows)
    gradients = jax.jit(jax.vmap(jax.grad(fn)))(F_rows, y_rows)

    expected_values = [closed_form.value(F, y) for F, y in closed_form.points]
    expected_gradients = np.stack(
        [np.broadcast_to(closed_form.gradient(F, y), np.shape(F)) for F, y in closed_form.points]
    )
    assert values.shape == (len(closed_form.points),)
    np.testing.assert_allclose(values, expected_values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gradients, expected_gradients, rtol=1e-5, atol=1e-6)


def _quantile_pair(raw_prediction, y):
    """A custom loss of two outputs whose label has a trailing axis (two quantiles at once)."""
    residual = y - raw_prediction
    levels = jnp.array([0.25, 0.75])
    return jnp.sum(jnp.maximum(levels * residual, (levels - 1) * residual)) + 0.1 * jnp.sum(raw_prediction ** 2)


@pytest.mark.parametrize("loss, outputs, labels", [
    (losses.softmax, 10, lambda rng, n: rng.integers(0, 10, n).astype(np.int32)),
    (losses.gaussian_nll, 2, lambda rng, n: rng.standard_normal(n).astype(np.float32)),
    (_quantile_pair, 2, lambda rng, n: rng.standard_normal((n, 2)).astype(np.float32)),
], ids=["softmax", "gaussian_nll", "custom-trailing-label"])
def test_vector_losses_mapped_over_rows_as_the_last_axis_give_vmaps_values(loss, outputs, labels):
    """``derivatives.over_rows`` computes a vector loss with the rows as the last axis: the
    values, gradients and Hessians (diagonal and full) are plain ``jax.vmap``'s, in the same
    rows-first shapes, up to the order of a sum over the outputs (softmax's: a few units in the
    last place)."""
    rng = np.random.default_rng(outputs)
    n = 4099
    raw = jnp.asarray(rng.standard_normal((n, outputs)).astype(np.float32))
    y = jnp.asarray(labels(rng, n))

    def plain(full):
        return jax.vmap(lambda f, label: derivatives._example_value_gradient_and_hessian(loss, f, label, full=full))

    for full, mapped in [(False, derivatives.values_gradients_and_hessians),
                         (True, derivatives.values_gradients_and_hessian_matrices)]:
        got = jax.jit(functools.partial(mapped, loss))(raw, y)
        expected = jax.jit(plain(full))(raw, y)
        for got_part, expected_part in zip(got, expected):
            assert got_part.shape == expected_part.shape
            np.testing.assert_allclose(np.asarray(got_part), np.asarray(expected_part), rtol=2e-6, atol=1e-7)


def test_softmax_derivatives_compile_to_loops_over_rows_innermost():
    # The reason for the layout: with the rows last, softmax's exponentials are one loop over
    # (classes, rows); mapped rows-first, XLA's loop ran over each row's 10 classes, which LLVM
    # unrolled (four times the machine code). Were XLA to move the transpose away again, the
    # exponentials would be (rows, classes) and this test says so.
    n = 4099
    raw = cpu_argument((n, 10), jnp.float32)
    y = cpu_argument((n,), jnp.int32)
    text = jax.jit(functools.partial(derivatives.values_gradients_and_hessians, losses.softmax),
                   compiler_options=compiler_options("cpu")).lower(raw, y).compile().as_text()
    exponentials = re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]*\} exponential\(", text)
    assert exponentials and set(exponentials) == {f"10,{n}"}, exponentials


def test_softplus_and_its_autodiff_derivatives_are_exact_to_float32_rounding_everywhere():
    """``losses.softplus`` against float64 closed forms: the value ``log(1 + e^x)``, the
    gradient ``sigmoid(x)`` and the second derivative ``sigmoid(x) sigmoid(-x)``, from x = 0 to
    where they underflow. ``jax.nn.softplus``'s second derivative is a difference of nearly
    equal terms for large x (off by 40% at x = 15, zero at 20); at x = 0, ``jnp.maximum`` and
    ``jnp.abs`` would give a gradient of 0."""
    x = np.array([0.0, 1e-8, -1e-8, 0.5, -0.5, 3.0, -3.0, 15.0, -15.0, 20.0, -20.0, 50.0, -50.0, 80.0, -80.0],
                 np.float32)
    x64 = x.astype(np.float64)
    value, gradient, hessian = jax.jit(jax.vmap(
        lambda point: (losses.softplus(point), jax.grad(losses.softplus)(point),
                       jax.grad(jax.grad(losses.softplus))(point))))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(value), np.logaddexp(0.0, x64), rtol=2e-7, atol=0)
    np.testing.assert_allclose(np.asarray(gradient), _sigmoid(x64), rtol=2e-7, atol=0)
    np.testing.assert_allclose(np.asarray(hessian), _sigmoid(x64) * _sigmoid(-x64), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(jax.vmap(jax.nn.softplus)(jnp.asarray(x))))
    # Infinite and NaN inputs: the limits, and NaN carried through (training reports it).
    edges = jnp.array([np.inf, -np.inf, np.nan], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.vmap(losses.softplus)(edges)), [np.inf, 0.0, np.nan])
    np.testing.assert_array_equal(np.asarray(jax.vmap(jax.grad(losses.softplus))(edges)), [1.0, 0.0, np.nan])


def test_logistic_derivatives_compile_to_one_exponential_a_row():
    # Written with jax.nn.softplus, whose derivative rule takes an exponential of each of
    # logaddexp's arguments, the round's derivatives took three exponentials (and a log1p) a
    # row, 2.3 times the time of this one.
    n = 4099
    text = jax.jit(functools.partial(derivatives.gradients_and_hessians, losses.logistic),
                   compiler_options=compiler_options("cpu")).lower(
        cpu_argument((n,), jnp.float32), cpu_argument((n,), jnp.float32)).compile().as_text()
    assert re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]*\} exponential\(", text) == [str(n)]


# For each built-in with a label range: labels it accepts, and single labels it rejects.
LABEL_RANGES = {
    "logistic": ([0.0, 1.0, 0.3], [1.5, -0.1]),
    "softmax": ([0, 1, 2, 2.0], [-1, 1.5]),
    "poisson": ([0.0, 3.5, 7.0], [-1.5]),
    "gamma": ([0.1, 3.0], [0.0, -2.0]),
    "tweedie": ([0.0, 2.5], [-0.5]),
    "negative_binomial": ([0.0, 3.0, 40.0], [-1.0]),
    "exponential": ([0.0, 1.0, 1.0], [0.5, -1.0, 2.0]),
    "hinge": ([0.0, 1.0], [0.5, -1.0, 2.0]),
    "lognormal_nll": ([0.1, 3.0, 1e5], [0.0, -2.0]),
}
UNRESTRICTED = ["squared_error", "absolute_error", "pseudo_huber", "quantile", "gaussian_nll", "student_t_nll"]


def test_every_builtin_has_closed_forms_and_label_expectations():
    assert set(CLOSED_FORMS) == set(losses.BUILTINS)
    assert set(LABEL_RANGES) | set(UNRESTRICTED) == set(losses.BUILTINS)


@pytest.mark.parametrize(
    "name, bad_label",
    [(name, bad) for name, (_, rejected) in LABEL_RANGES.items() for bad in rejected],
)
def test_label_check_rejects_out_of_range_label(name, bad_label):
    valid, _ = LABEL_RANGES[name]
    labels = np.array(valid + [bad_label])
    with pytest.raises(ValueError) as excinfo:
        losses.BUILTINS[name].check_labels(labels)
    message = str(excinfo.value)
    assert f"'{name}'" in message
    assert f"{bad_label:g}" in message


@pytest.mark.parametrize("name", list(LABEL_RANGES))
def test_label_check_accepts_valid_labels(name):
    valid, _ = LABEL_RANGES[name]
    losses.BUILTINS[name].check_labels(np.array(valid))
    losses.BUILTINS[name].check_labels(np.array([], dtype=np.float32))


@pytest.mark.parametrize("name", UNRESTRICTED)
def test_regression_losses_accept_any_finite_label(name):
    losses.BUILTINS[name].check_labels(np.array([-1e6, -1.5, 0.0, 2.25, 1e6]))


def test_label_check_lists_a_few_offending_values():
    with pytest.raises(ValueError, match=r"needs labels 0 or 1; got -1, 0\.5, 2, 3, 4, \.\.\. "):
        losses.get("hinge").check_labels(np.array([0, 1, 2, 3, 4, 5, 6, -1, 0.5, 2]))


def test_parameters_change_values_as_closed_forms_say():
    # Residual y - F = +2: the pinball loss weighs under-prediction by tau.
    assert float(functools.partial(losses.quantile, tau=0.9)(0.0, 2.0)) == pytest.approx(1.8)
    assert float(losses.quantile(0.0, 2.0)) == pytest.approx(1.0)
    # Residual -2: over-prediction is weighed by 1 - tau.
    assert float(functools.partial(losses.quantile, tau=0.9)(0.0, -2.0)) == pytest.approx(0.2)

    # Pseudo-Huber: quadratic 1/2 e^2 well inside delta, slope delta well outside it.
    assert float(losses.pseudo_huber(0.0, 1e-3, delta=2.0)) == pytest.approx(0.5e-6, rel=1e-4)
    far = losses.pseudo_huber(0.0, 1e4, delta=2.0) - losses.pseudo_huber(0.0, 1e4 - 1, delta=2.0)
    assert float(far) == pytest.approx(2.0, rel=1e-3)

    # Tweedie at y = 0 is exp((2 - p) F) / (2 - p); at F = 0 it is -y/(1 - p) + 1/(2 - p).
    assert float(losses.tweedie(1.0, 0.0, power=1.2)) == pytest.approx(np.exp(0.8) / 0.8, rel=1e-6)
    assert float(losses.tweedie(0.0, 3.0, power=1.8)) == pytest.approx(3.0 / 0.8 + 1 / 0.2, rel=1e-6)


@pytest.mark.parametrize(
    "loss, params",
    [
        ("quantile", {"tau": 1.5}),
        ("quantile", {"tau": 0.0}),
        ("pseudo_huber", {"delta": 0.0}),
        ("tweedie", {"power": 2.5}),
        ("tweedie", {"power": 1.0}),
        ("negative_binomial", {"alpha": 0.0}),
        ("negative_binomial", {"alpha": -1.0}),
    ],
)
def test_invalid_parameters_are_rejected(loss, params):
    fn = functools.partial(losses.get(loss).function, **params)
    with pytest.raises(ValueError, match=f"'{loss}'"):
        fn(0.0, 1.0)


def test_parameters_can_be_traced():
    quantile_loss = jax.jit(losses.quantile)
    assert float(quantile_loss(0.0, 2.0, 0.9)) == pytest.approx(1.8)
    assert float(quantile_loss(0.0, 2.0, 0.1)) == pytest.approx(0.2)


EXPECTED_RECORDS = {
    # name: (link, leaf_refit, multiclass); num_outputs in test_distributional_records
    "squared_error": ("identity", False, False),
    "absolute_error": ("identity", True, False),
    "pseudo_huber": ("identity", False, False),
    "quantile": ("identity", True, False),
    "logistic": ("sigmoid", False, False),
    "softmax": ("softmax", False, True),
    "poisson": ("exp", False, False),
    "gamma": ("exp", False, False),
    "tweedie": ("exp", False, False),
    "negative_binomial": ("exp", False, False),
    "exponential": ("sigmoid_2x", False, False),
    "hinge": ("step", True, False),
    "gaussian_nll": (losses.location_scale, False, False),
    "student_t_nll": (losses.location_scale, False, False),
    "lognormal_nll": (losses.location_scale, False, False),
}


@pytest.mark.parametrize("name", list(EXPECTED_RECORDS))
def test_registry_records(name):
    record = losses.get(name)
    assert isinstance(record, losses.BuiltinLoss)
    assert record is losses.BUILTINS[name]
    assert record.name == name
    assert record.function is getattr(losses, name)
    assert (record.link, record.leaf_refit, record.multiclass) == EXPECTED_RECORDS[name]


def test_registry_has_exactly_the_builtins():
    assert set(losses.BUILTINS) == set(EXPECTED_RECORDS)


def test_get_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown loss 'huber'") as excinfo:
        losses.get("huber")
    for name in losses.BUILTINS:
        assert name in str(excinfo.value)


def test_package_imports_nothing_from_jaxboost():
    for source in Path(losses.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported = [node.module]
            else:
                continue
            assert not any(module.split(".")[0] == "jaxboost" for module in imported), source


# Distributional losses: (mu, log_sigma) raw outputs, parameters (mu, sigma) after the link.

DISTRIBUTIONAL = ["gaussian_nll", "student_t_nll", "lognormal_nll"]


def _scipy_distribution(name, mu, sigma, df=5.0):
    if name == "gaussian_nll":
        return scipy.stats.norm(loc=mu, scale=sigma)
    if name == "student_t_nll":
        return scipy.stats.t(df, loc=mu, scale=sigma)
    return scipy.stats.lognorm(s=sigma, scale=np.exp(mu))


def _raw_and_label_grid(name):
    """Raw predictions over a wide range of log_sigma and labels far into the tails."""
    mu, log_sigma, y = np.meshgrid(np.linspace(-3, 3, 7), np.linspace(-8, 8, 9), np.linspace(-30, 30, 13))
    if name == "lognormal_nll":
        y = np.exp(y / 3)
    raw = np.stack([mu.ravel(), log_sigma.ravel()], axis=1)
    return raw, y.ravel()


@pytest.mark.parametrize("name, params", [(name, {}) for name in DISTRIBUTIONAL] + [
    ("student_t_nll", {"df": 1.0}), ("student_t_nll", {"df": 2.5}), ("student_t_nll", {"df": 100.0})])
def test_negative_log_likelihood_equals_scipy_logpdf(name, params):
    raw, y = _raw_and_label_grid(name)
    with jax.enable_x64(True):
        values = jax.jit(jax.vmap(functools.partial(losses.get(name).function, **params)))(
            jnp.asarray(raw), jnp.asarray(y))
    expected = -_scipy_distribution(name, raw[:, 0], np.exp(raw[:, 1]), **params).logpdf(y)
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", DISTRIBUTIONAL)
def test_hessian_diagonal_is_non_negative_and_finite_on_a_grid(name):
    raw, y = _raw_and_label_grid(name)
    gradient_and_hessian = jax.jit(jax.vmap(lambda F, y: _gradient_and_hessian_diagonal(losses.get(name).function, F, y)))
    values = jax.jit(jax.vmap(losses.get(name).function))(jnp.asarray(raw, jnp.float32), jnp.asarray(y, jnp.float32))
    gradient, hessian = gradient_and_hessian(jnp.asarray(raw, jnp.float32), jnp.asarray(y, jnp.float32))
    # float32 throughout, as in training: |log_sigma| up to 8 and residuals up to 30 stay finite.
    assert np.isfinite(values).all() and np.isfinite(gradient).all() and np.isfinite(hessian).all()
    assert (np.asarray(hessian) >= 0).all()


def test_student_t_exact_curvature_is_negative_for_outliers_but_reported_curvature_is_fisher():
    # z = 4 > sqrt(5): the true second derivative in mu, from finite differences, is negative.
    F, y = np.array([0.0, 0.0]), 4.0
    with jax.enable_x64(True):
        _, fd_hessian = _finite_differences(jax.jit(losses.student_t_nll), jnp.asarray(F), jnp.asarray(y))
        _, hessian = jax.jit(_gradient_and_hessian_diagonal, static_argnums=0)(
            losses.student_t_nll, jnp.asarray(F), jnp.asarray(y))
    assert fd_hessian[0] == pytest.approx(6 * (5 - 16) / 21**2, rel=1e-5)
    np.testing.assert_allclose(hessian, [6 / 8, 10 / 8], rtol=1e-12)
    # Only the curvature in the raw prediction changes: the derivative in the label is exact,
    # the negative of the one in mu (the loss depends on y - mu).
    with jax.enable_x64(True):
        d_label = jax.grad(losses.student_t_nll, argnums=1)(jnp.asarray(F), jnp.asarray(y))
    assert float(d_label) == pytest.approx(-CLOSED_FORMS["student_t_nll"].gradient(F, y)[0], rel=1e-12)
    # So is the gradient's derivative in the label (what a derivative of the model in its labels
    # reads): the exact mixed second derivative, minus the exact curvature in mu, not Fisher's.
    with jax.enable_x64(True):
        d_gradient_d_label = jax.grad(lambda label: jax.grad(losses.student_t_nll)(jnp.asarray(F), label)[0])(
            jnp.asarray(y))
    assert float(d_gradient_d_label) == pytest.approx(-6 * (5 - 16) / 21**2, rel=1e-12)


def test_losses_stay_finite_for_extreme_scales_and_residuals():
    F32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    raw = F32([(0.0, 30.0), (0.0, -30.0), (5.0, -40.0)])
    y = F32([1e3, 1.0, 5.001])
    for name in DISTRIBUTIONAL:
        fn = losses.get(name).function
        value = jax.jit(jax.vmap(fn))(raw, y)
        gradient, hessian = jax.jit(jax.vmap(functools.partial(_gradient_and_hessian_diagonal, fn)))(raw, y)
        assert np.isfinite(value).all() and np.isfinite(gradient).all() and np.isfinite(hessian).all(), name
    # |z| = 1e24: z^2 would overflow float32, the Student-t value is still exact.
    value = losses.student_t_nll(F32((0.0, -30.0)), F32(1e11))
    expected = -scipy.stats.t(5.0, scale=np.exp(-30.0)).logpdf(1e11)
    assert float(value) == pytest.approx(expected, rel=1e-5)


def test_student_t_full_hessian_is_the_fisher_information_matrix():
    # What vector leaves with the full Hessian read: the Fisher information, diagonal (the
    # expected cross-derivative in mu and log sigma is zero), not the observed cross-derivative,
    # which at an outlier is large beside the diagonal.
    raw = jnp.asarray([[0.0, 0.0], [0.5, -1.0], [-1.0, 0.7]], jnp.float32)
    y = jnp.asarray([4.0, -2.0, 0.3], jnp.float32)
    _, _, hessians = derivatives.values_gradients_and_hessian_matrices(losses.student_t_nll, raw, y)
    for F, matrix in zip(np.asarray(raw, np.float64), np.asarray(hessians)):
        expected = np.diag(CLOSED_FORMS["student_t_nll"].hessian(F, None))
        np.testing.assert_allclose(matrix, expected, rtol=1e-6, atol=1e-7)
    # At (0, 0) and y = 4 the value's own cross-derivative, from central differences of the
    # exact value, is 2 df (df + 1) z / (df + z^2)^2 = 240/441; the one reported is zero.
    step = 1e-4
    with jax.enable_x64(True):
        value = jax.jit(lambda mu, s: losses.student_t_nll(jnp.stack([mu, s]), 4.0))
        cross = (value(step, step) - value(step, -step) - value(-step, step) + value(-step, -step)) / (4 * step**2)
        reported = jax.hessian(lambda F: losses.student_t_nll(F, 4.0))(jnp.zeros(2))
    assert float(cross) == pytest.approx(240 / 441, rel=1e-5)
    assert float(reported[0, 1]) == 0.0 and float(reported[1, 0]) == 0.0


def test_student_t_reports_an_overflowing_fisher_curvature_as_negative_its_value_and_gradient_finite():
    # Below a scale of e^-44 the Fisher information in mu, (df + 1)/(df + 3) e^(-2 s), overflows
    # float32. Its curvature term would be NaN at the point (infinity times a zero step), and the
    # value and gradient with it: the curvature is reported as -1 there, which training rejects as
    # a negative Hessian.
    F, y = np.array([0.0, -45.0]), 1.0
    F32, y32 = jnp.asarray(F, jnp.float32), jnp.asarray(y, jnp.float32)
    value = losses.student_t_nll(F32, y32)
    gradient, hessian = _gradient_and_hessian_diagonal(losses.student_t_nll, F32, y32)
    assert float(value) == pytest.approx(-scipy.stats.t(5.0, scale=np.exp(-45.0)).logpdf(y), rel=1e-5)
    np.testing.assert_allclose(gradient, CLOSED_FORMS["student_t_nll"].gradient(F, y), rtol=1e-5)
    np.testing.assert_allclose(hessian, [-1.0, 10 / 8], rtol=1e-6)


def test_distributional_losses_reject_a_scalar_raw_prediction():
    for name in DISTRIBUTIONAL:
        with pytest.raises(ValueError, match=f"'{name}' takes 2 raw outputs"):
            losses.get(name).function(jnp.float32(0.0), 1.0)


def test_distributional_records():
    for name in DISTRIBUTIONAL:
        record = losses.get(name)
        assert record.num_outputs == 2 and record.link is losses.location_scale
        assert record.quantile is getattr(losses, name.replace("_nll", "_quantile"))
    scalar_records = [record for name, record in losses.BUILTINS.items() if name not in DISTRIBUTIONAL]
    assert all(record.num_outputs is None and record.quantile is None for record in scalar_records)


def test_location_scale_link():
    raw = np.array([[0.5, 0.0], [-2.0, np.log(3.0)]], np.float32)
    np.testing.assert_allclose(losses.location_scale(raw), [[0.5, 1.0], [-2.0, 3.0]], rtol=1e-6)


LEVELS = np.array([1e-4, 0.025, 0.1, 0.5, 0.8, 0.975, 0.9999])


@pytest.mark.parametrize("name, params", [(name, {}) for name in DISTRIBUTIONAL] + [
    ("student_t_nll", {"df": 1.0}), ("student_t_nll", {"df": 2.5}), ("student_t_nll", {"df": 50.0})])
def test_quantiles_match_scipy(name, params):
    distribution_params = np.array([[0.0, 1.0], [1.5, 0.2], [-2.0, 3.0]])
    mu, sigma = distribution_params[:, :1], distribution_params[:, 1:]
    got = losses.predictive_quantile(name, distribution_params[:, None, :], LEVELS, **params)
    expected = _scipy_distribution(name, mu, sigma, **params).ppf(LEVELS)
    assert got.shape == (3, len(LEVELS))
    # float32 levels: 1 - 0.9999 is only known to ~1e-4 relative, which the far tail magnifies.
    np.testing.assert_allclose(got[:, :-1], expected[:, :-1], rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, -1], expected[:, -1], rtol=2e-4)


def test_predictive_interval_has_the_stated_probability():
    params = np.array([[1.0, 2.0], [0.0, 0.5]])
    for loss, distribution in [("gaussian_nll", "gaussian_nll"),
                               (functools.partial(losses.student_t_nll, df=3.0), "student_t_nll"),
                               (losses.lognormal_nll, "lognormal_nll")]:
        lower, upper = losses.predictive_interval(loss, params, 0.8)
        df = {"df": 3.0} if distribution == "student_t_nll" else {}
        frozen = _scipy_distribution(distribution, params[:, 0], params[:, 1], **df)
        np.testing.assert_allclose(frozen.cdf(np.asarray(upper)) - frozen.cdf(np.asarray(lower)), 0.8, atol=1e-5)


def test_quantile_helpers_reject_bad_input():
    with pytest.raises(ValueError, match=r"levels must be in \(0, 1\)"):
        losses.gaussian_quantile(np.array([[0.0, 1.0]]), 1.0)
    with pytest.raises(ValueError, match=r"parameters \(\.\.\., 2\)"):
        losses.gaussian_quantile(np.zeros((4, 3)), 0.5)
    with pytest.raises(ValueError, match="coverage must be in"):
        losses.predictive_interval("gaussian_nll", np.array([[0.0, 1.0]]), 95)
    with pytest.raises(ValueError, match="'poisson' is not a likelihood with quantiles"):
        losses.predictive_interval("poisson", np.array([[0.0, 1.0]]), 0.9)
    with pytest.raises(ValueError, match="loss 'student_t_nll' needs df > 0"):
        losses.student_t_quantile(np.array([[0.0, 1.0]]), 0.5, df=0.0)


def _heteroscedastic(n, seed, noise):
    rng = np.random.default_rng(seed)
    X = rng.uniform(0, 1, (n, 3)).astype(np.float32)
    mu = np.sin(4 * X[:, 1])
    sigma = 0.2 + 0.8 * X[:, 0]
    return X, mu + sigma * noise(rng, n), mu, sigma


@pytest.mark.parametrize("name", ["gaussian_nll", "student_t_nll"])
def test_training_recovers_the_scale_of_heteroscedastic_noise(name):
    # Noise drawn from the loss's own family: the fitted scale should track sigma(x).
    noise = ((lambda rng, n: rng.standard_normal(n)) if name == "gaussian_nll"
             else (lambda rng, n: rng.standard_t(5.0, n)))
    X, y, mu, sigma = _heteroscedastic(3000, 0, noise)
    # Few shallow rounds: the scale trees start fitting noise after about 40 (measured: mean
    # relative scale error 0.07 at 40 rounds for both losses, 0.11-0.14 at 150).
    model = jb.train(X[:2000], y[:2000], loss=name, num_rounds=40, max_depth=2, learning_rate=0.1,
                     min_child_weight=10)
    params = model.predict(X[2000:])
    assert params.shape == (1000, 2) and model.num_outputs == 2
    assert np.mean(np.abs(params[:, 1] / sigma[2000:] - 1)) < 0.12
    assert np.mean(np.abs(params[:, 0] - mu[2000:])) < 0.1
    lower, upper = losses.predictive_interval(name, params, 0.8)
    coverage = np.mean((y[2000:] >= lower) & (y[2000:] <= upper))
    assert abs(coverage - 0.8) < 0.04  # binomial standard error at n = 1000: 0.013


def test_training_checks_the_distributional_loss_labels_and_outputs():
    X, y, _, _ = _heteroscedastic(200, 1, lambda rng, n: rng.standard_normal(n))
    with pytest.raises(ValueError, match="'lognormal_nll' needs labels > 0"):
        jb.train(X, y, loss="lognormal_nll", num_rounds=1)
    with pytest.raises(ValueError, match="has 2 outputs"):
        jb.train(X, y, loss="gaussian_nll", num_outputs=3, num_rounds=1)


@pytest.mark.parametrize("alpha", [0.2, 1.0, 5.0])
def test_negative_binomial_is_scipys_log_pmf(alpha):
    counts = np.array([0.0, 1.0, 4.0, 30.0])
    F = np.array([-0.5, 0.2, 1.5, 3.0])
    mu = np.exp(F)
    expected = -scipy.stats.nbinom.logpmf(counts, 1 / alpha, 1 / (1 + alpha * mu))
    actual = jax.vmap(lambda f, y: losses.negative_binomial(f, y, alpha=alpha))(jnp.asarray(F), jnp.asarray(counts))
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_negative_binomial_trains_on_overdispersed_counts():
    """Gamma-Poisson counts with dispersion 0.5: the fitted means follow the true means, and the
    held-out likelihood prefers the true dispersion to a nearly-Poisson one."""
    rng = np.random.default_rng(0)
    X = rng.uniform(size=(6000, 3)).astype(np.float32)
    mu = np.exp(1.0 + 1.5 * X[:, 0])
    y = rng.poisson(mu * rng.gamma(2.0, 0.5, size=mu.shape)).astype(np.float32)  # variance mu + 0.5 mu^2
    train, test = slice(0, 4000), slice(4000, None)
    nll = {}
    for alpha in (0.5, 0.05):
        model = jb.train(X[train], y[train], loss="negative_binomial", loss_params={"alpha": alpha}, num_rounds=60,
                         max_depth=2, learning_rate=0.1)
        raw = jnp.asarray(model.predict_raw(X[test]))
        nll[alpha] = float(jnp.mean(jax.vmap(lambda f, label: losses.negative_binomial(f, label, alpha=0.5))(
            raw, jnp.asarray(y[test]))))
        if alpha == 0.5:
            assert np.median(np.abs(model.predict(X[test]) / mu[test] - 1)) < 0.15
    assert nll[0.5] < nll[0.05]


def test_a_source_checkout_takes_its_own_losses_folder(tmp_path):
    """A source checkout on ``PYTHONPATH`` takes the ``losses/`` folder beside its package, even
    with another checkout installed in editable mode (whose mapping of ``jaxboost.losses`` had
    given it that checkout's losses, so a comparison of two versions ran one version's losses)."""
    import os
    import shutil
    import subprocess
    import sys

    root = Path(jb.__file__).resolve().parent.parent
    checkout = tmp_path / "checkout"
    shutil.copytree(root / "jaxboost", checkout / "jaxboost", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "losses", checkout / "losses", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", checkout / "pyproject.toml")
    with open(checkout / "losses" / "__init__.py", "a") as file:
        file.write("\nTHIS_CHECKOUT = True\n")
    code = "import jaxboost; print(jaxboost.losses.__file__); print(getattr(jaxboost.losses, 'THIS_CHECKOUT', False))"
    env = dict(os.environ, PYTHONPATH=str(checkout), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    path, marked = done.stdout.strip().splitlines()[-2:]
    assert Path(path).resolve().parent == (checkout / "losses").resolve() and marked == "True", done.stdout
