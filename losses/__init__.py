"""Built-in objectives: per-example losses in JAX and the records describing them.

Each loss is a pure function of ONE example, ``function(raw_prediction, y, **params)``;
gradients and Hessians come from autodiff. ``BUILTINS`` maps each name to its
``BuiltinLoss`` record (link, label check, whether leaves need refitting, whether it is
multiclass). Bind parameters with ``functools.partial``, e.g.
``functools.partial(quantile, tau=0.9)``.

This package imports nothing from ``jaxboost`` so that it stands alone.
"""

from __future__ import annotations

import functools
from typing import Callable

from . import _validation
from ._classification import exponential, hinge, logistic, softmax
from ._count import gamma, poisson, tweedie
from ._record import BuiltinLoss
from ._regression import absolute_error, pseudo_huber, quantile, squared_error

__all__ = [
    "BUILTINS",
    "BuiltinLoss",
    "absolute_error",
    "exponential",
    "gamma",
    "get",
    "hinge",
    "logistic",
    "poisson",
    "pseudo_huber",
    "quantile",
    "softmax",
    "squared_error",
    "tweedie",
]


def _record(
    function: Callable,
    link: str,
    label_check: Callable,
    *,
    leaf_refit: bool = False,
    multiclass: bool = False,
) -> BuiltinLoss:
    name = function.__name__
    return BuiltinLoss(
        name=name,
        function=function,
        link=link,
        check_labels=functools.partial(label_check, name),
        leaf_refit=leaf_refit,
        multiclass=multiclass,
    )


BUILTINS: dict[str, BuiltinLoss] = {
    record.name: record
    for record in (
        _record(squared_error, "identity", _validation.any_finite),
        _record(absolute_error, "identity", _validation.any_finite, leaf_refit=True),
        _record(pseudo_huber, "identity", _validation.any_finite),
        _record(quantile, "identity", _validation.any_finite, leaf_refit=True),
        _record(logistic, "sigmoid", _validation.unit_interval),
        _record(softmax, "softmax", _validation.class_indices, multiclass=True),
        _record(poisson, "exp", _validation.non_negative),
        _record(gamma, "exp", _validation.positive),
        _record(tweedie, "exp", _validation.non_negative),
        _record(exponential, "sigmoid_2x", _validation.binary),
        _record(hinge, "step", _validation.binary, leaf_refit=True),
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
