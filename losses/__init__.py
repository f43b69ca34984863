"""Built-in objectives: per-example losses in JAX and the records describing them.

Each loss is a pure function of ONE example, ``function(raw_prediction, y, **params)``;
gradients and Hessians come from autodiff. ``BUILTINS`` maps each name to its
``BuiltinLoss`` record (link, label check, whether leaves need refitting, whether it is
multiclass, how many raw outputs it takes, the closed form of its best constant where it has
one). Bind parameters with ``functools.partial``, e.g. ``functools.partial(quantile, tau=0.9)``.

The distributional losses (``gaussian_nll``, ``student_t_nll``, ``lognormal_nll``) take two
raw outputs, ``(mu, log_sigma)``; their models predict ``(mu, sigma)`` per row, and
``predictive_interval`` / ``predictive_quantile`` turn those into intervals and quantiles.

``softplus`` is ``log(1 + e^x)`` composed so that autodiff's derivatives of it take one
exponential a row and its second derivative is exact to float32 rounding (those of
``jax.nn.softplus`` take three, and lose precision for large ``x``); the logistic and negative
binomial losses use it, and so can a custom loss.

This package imports nothing from ``jaxboost`` so that it stands alone.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from . import _optimal_constants as _constant
from . import _validation
from ._classification import exponential, hinge, logistic, softmax
from ._count import gamma, negative_binomial, poisson, tweedie
from ._distributional import (
    gaussian_nll,
    gaussian_quantile,
    location_scale,
    lognormal_nll,
    lognormal_quantile,
    student_t_nll,
    student_t_quantile,
)
from ._elementary import softplus
from ._record import BuiltinLoss
from ._regression import absolute_error, pseudo_huber, quantile, squared_error

__all__ = [
    "BUILTINS",
    "BuiltinLoss",
    "absolute_error",
    "exponential",
    "gamma",
    "gaussian_nll",
    "gaussian_quantile",
    "get",
    "hinge",
    "location_scale",
    "logistic",
    "lognormal_nll",
    "lognormal_quantile",
    "poisson",
    "predictive_interval",
    "predictive_quantile",
    "pseudo_huber",
    "quantile",
    "softmax",
    "softplus",
    "squared_error",
    "student_t_nll",
    "student_t_quantile",
    "tweedie",
    "negative_binomial",
]


def _record(
    function: Callable,
    link: str | Callable,
    label_check: Callable,
    *,
    leaf_refit: bool = False,
    multiclass: bool = False,
    num_outputs: int | None = None,
    quantile: Callable | None = None,
    optimal_constant: Callable | None = None,
) -> BuiltinLoss:
    name = function.__name__
    return BuiltinLoss(
        name=name,
        function=function,
        link=link,
        check_labels=functools.partial(label_check, name),
        leaf_refit=leaf_refit,
        multiclass=multiclass,
        num_outputs=num_outputs,
        quantile=quantile,
        optimal_constant=optimal_constant,
    )


BUILTINS: dict[str, BuiltinLoss] = {
    record.name: record
    for record in (
        _record(squared_error, "identity", _validation.any_finite, optimal_constant=_constant.mean),
        _record(absolute_error, "identity", _validation.any_finite, leaf_refit=True,
                optimal_constant=_constant.weighted_median),
        _record(pseudo_huber, "identity", _validation.any_finite),
        _record(quantile, "identity", _validation.any_finite, leaf_refit=True,
                optimal_constant=_constant.weighted_quantile),
        _record(logistic, "sigmoid", _validation.unit_interval, optimal_constant=_constant.log_odds),
        _record(softmax, "softmax", _validation.class_indices, multiclass=True,
                optimal_constant=_constant.log_class_frequencies),
        _record(poisson, "exp", _validation.non_negative, optimal_constant=_constant.log_mean),
        _record(gamma, "exp", _validation.positive, optimal_constant=_constant.log_mean),
        _record(tweedie, "exp", _validation.non_negative, optimal_constant=_constant.log_mean),
        _record(negative_binomial, "exp", _validation.non_negative, optimal_constant=_constant.log_mean),
        _record(exponential, "sigmoid_2x", _validation.binary, optimal_constant=_constant.half_log_odds),
        _record(hinge, "step", _validation.binary, leaf_refit=True, optimal_constant=_constant.hinge_side),
        _record(gaussian_nll, location_scale, _validation.any_finite, num_outputs=2,
                quantile=gaussian_quantile, optimal_constant=_constant.gaussian),
        _record(student_t_nll, location_scale, _validation.any_finite, num_outputs=2,
                quantile=student_t_quantile, optimal_constant=_constant.student_t),
        _record(lognormal_nll, location_scale, _validation.positive, num_outputs=2,
                quantile=lognormal_quantile, optimal_constant=_constant.lognormal),
    )
}


def get(name: str) -> BuiltinLoss:
    """Returns the built-in objective called ``name``.

    Raises:
      ValueError: if ``name`` is not a built-in; the message lists the known names.
    """
    try:
        return BUILTINS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTINS))
        raise ValueError(f"unknown loss {name!r}; known losses: {known}") from None


def _distribution(loss) -> tuple[BuiltinLoss, dict]:
    """The record of a distributional loss given by name, function or ``functools.partial``
    (whose bound keywords, e.g. ``df``, are returned as quantile parameters)."""
    bound = {}
    if isinstance(loss, functools.partial):
        loss, bound = loss.func, dict(loss.keywords)
    if isinstance(loss, str):
        record = get(loss)
    else:
        record = next((r for r in BUILTINS.values() if r.function is loss), None)
        if record is None:
            raise ValueError(f"{loss!r} is not a built-in loss; predictive quantiles need a built-in likelihood")
    if record.quantile is None:
        with_quantiles = sorted(name for name, r in BUILTINS.items() if r.quantile is not None)
        raise ValueError(f"loss '{record.name}' is not a likelihood with quantiles; those are: {with_quantiles}")
    return record, bound


def predictive_quantile(loss, params, level, **loss_params) -> jax.Array:
    """Quantiles of the predictive distribution of a distributional model.

    Args:
      loss: the loss the model was trained with: a name (``"gaussian_nll"``), the function, or
        a ``functools.partial`` binding its parameters.
      params: ``(..., 2)`` distribution parameters, as ``model.predict`` returns them.
      level: probability in (0, 1), a scalar or an array broadcasting against the rows.
      **loss_params: the loss's parameters, e.g. ``df=5.0`` for ``student_t_nll``.

    Returns:
      the quantile per row.
    """
    record, bound = _distribution(loss)
    return record.quantile(params, level, **{**bound, **loss_params})


def predictive_interval(loss, params, coverage: float, **loss_params) -> tuple[jax.Array, jax.Array]:
    """Central predictive interval holding probability ``coverage`` per row: the quantiles at
    ``(1 - coverage)/2`` and ``(1 + coverage)/2``.

    Args:
      loss: as ``predictive_quantile``.
      params: ``(..., 2)`` distribution parameters, as ``model.predict`` returns them.
      coverage: probability in (0, 1), e.g. 0.8 or 0.95.
      **loss_params: the loss's parameters, e.g. ``df=5.0`` for ``student_t_nll``.

    Returns:
      ``(lower, upper)``, each shaped like ``params[..., 0]``.
    """
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be in (0, 1); got {coverage}")
    tail = 0.5 * (1.0 - coverage)
    return (predictive_quantile(loss, params, tail, **loss_params),
            predictive_quantile(loss, params, 1.0 - tail, **loss_params))
