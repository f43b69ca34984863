"""Tests of the built-in objectives against closed forms written here in NumPy."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxboost import losses


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
    hessian: Callable


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
}

# Every built-in with its default parameters, plus non-default parameters where it has any.
VARIANTS = [(name, {}) for name in CLOSED_FORMS] + [
    ("quantile", {"tau": 0.9}),
    ("quantile", {"tau": 0.1}),
    ("pseudo_huber", {"delta": 0.5}),
    ("pseudo_huber", {"delta": 3.0}),
    ("tweedie", {"power": 1.2}),
    ("tweedie", {"power": 1.8}),
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
            np.testing.assert_allclose(hessian, fd_hessian, rtol=1e-5, atol=1e-6, err_msg=where)
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


# For each built-in with a label range: labels it accepts, and single labels it rejects.
LABEL_RANGES = {
    "logistic": ([0.0, 1.0, 0.3], [1.5, -0.1]),
    "softmax": ([0, 1, 2, 2.0], [-1, 1.5]),
    "poisson": ([0.0, 3.5, 7.0], [-1.5]),
    "gamma": ([0.1, 3.0], [0.0, -2.0]),
    "tweedie": ([0.0, 2.5], [-0.5]),
    "exponential": ([0.0, 1.0, 1.0], [0.5, -1.0, 2.0]),
    "hinge": ([0.0, 1.0], [0.5, -1.0, 2.0]),
}
UNRESTRICTED = ["squared_error", "absolute_error", "pseudo_huber", "quantile"]


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
    # name: (link, leaf_refit, multiclass)
    "squared_error": ("identity", False, False),
    "absolute_error": ("identity", True, False),
    "pseudo_huber": ("identity", False, False),
    "quantile": ("identity", True, False),
    "logistic": ("sigmoid", False, False),
    "softmax": ("softmax", False, True),
    "poisson": ("exp", False, False),
    "gamma": ("exp", False, False),
    "tweedie": ("exp", False, False),
    "exponential": ("sigmoid_2x", False, False),
    "hinge": ("step", True, False),
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
