"""Host-side checks of labels and loss parameters.

Each label check has the signature ``check(loss_name, y)``; the package binds the loss name
so that a record's ``check_labels(y)`` takes the labels only. Finiteness is checked by the
library before these run, so only the loss's range is checked here.
"""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np

# Enough offending values to recognise the mistake without flooding the message.
_MAX_VALUES_SHOWN = 5


def _format_values(values: np.ndarray) -> str:
    distinct = np.unique(values)
    shown = ", ".join(f"{value:g}" for value in distinct[:_MAX_VALUES_SHOWN])
    if distinct.size > _MAX_VALUES_SHOWN:
        shown += f", ... ({distinct.size} distinct values)"
    return shown


def _as_flat_floats(y) -> np.ndarray:
    """``y`` as a flat array of floats: floating labels as they are (the checks compare them
    exactly in their own type; a float64 copy of 800k float32 labels made a check 0.77 ms rather
    than 0.27), any other labels as float64."""
    y = np.asarray(y)
    return (y if np.issubdtype(y.dtype, np.floating) else y.astype(np.float64)).ravel()


def any_finite(loss_name: str, y) -> None:
    """Accepts every label: the loss is defined for any real label."""
    del loss_name, y


def non_negative(loss_name: str, y) -> None:
    """Requires ``y >= 0``."""
    y = _as_flat_floats(y)
    if y.size and y.min() < 0:
        raise ValueError(f"loss '{loss_name}' needs labels >= 0; got min {y.min():g}")


def positive(loss_name: str, y) -> None:
    """Requires ``y > 0``."""
    y = _as_flat_floats(y)
    if y.size and y.min() <= 0:
        raise ValueError(f"loss '{loss_name}' needs labels > 0; got min {y.min():g}")


def unit_interval(loss_name: str, y) -> None:
    """Requires ``0 <= y <= 1``: hard 0/1 labels or probabilities."""
    y = _as_flat_floats(y)
    outside = y[(y < 0) | (y > 1)]
    if outside.size:
        raise ValueError(
            f"loss '{loss_name}' needs labels in [0, 1]; got {_format_values(outside)}"
        )


def binary(loss_name: str, y) -> None:
    """Requires every label to be exactly 0 or 1."""
    y = _as_flat_floats(y)
    invalid = y[(y != 0) & (y != 1)]
    if invalid.size:
        raise ValueError(
            f"loss '{loss_name}' needs labels 0 or 1; got {_format_values(invalid)}"
        )


def class_indices(loss_name: str, y) -> None:
    """Requires non-negative integer class labels; floats equal to integers are accepted."""
    y = _as_flat_floats(y)
    invalid = y[(y < 0) | (y != np.floor(y))]
    if invalid.size:
        raise ValueError(
            f"loss '{loss_name}' needs integer class labels >= 0; "
            f"got {_format_values(invalid)}"
        )


def check_parameter(
    loss_name: str,
    parameter: str,
    value,
    is_valid: Callable[[float], bool],
    requirement: str,
) -> None:
    """Raises ``ValueError`` when a concrete parameter value fails ``is_valid``.

    Runs at trace time, so it costs nothing in compiled code. Traced values (a parameter
    passed as a ``jax.jit`` argument) cannot be inspected on the host and are left alone.

    Args:
      loss_name: the loss the parameter belongs to, named in the message.
      parameter: the parameter's name.
      value: the parameter's value.
      is_valid: predicate on a concrete value.
      requirement: the requirement in words, e.g. ``"1 < power < 2"``.
    """
    if isinstance(value, numbers.Real) and not is_valid(value):
        raise ValueError(f"loss '{loss_name}' needs {requirement}; got {parameter}={value}")
