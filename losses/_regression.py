"""Regression losses on an identity link: the raw prediction ``F`` is the prediction."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._validation import check_parameter


def squared_error(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Squared error, ``1/2 (y - F)^2``.

    Args:
      raw_prediction: the prediction ``F`` for one example, a scalar.
      y: the target, a scalar.

    Returns:
      the loss, a scalar.
    """
    return 0.5 * jnp.square(y - raw_prediction)


def absolute_error(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Absolute error, ``|y - F|``; its minimiser is the median.

    The Hessian is zero everywhere it exists, so leaves are refit by exact minimisation.

    Args:
      raw_prediction: the prediction ``F`` for one example, a scalar.
      y: the target, a scalar.

    Returns:
      the loss, a scalar.
    """
    return jnp.abs(y - raw_prediction)


def pseudo_huber(
    raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike, delta: float = 1.0
) -> jax.Array:
    """Pseudo-Huber loss, ``delta^2 (sqrt(1 + ((y - F) / delta)^2) - 1)``.

    Smooth everywhere: quadratic, ``1/2 (y - F)^2``, for ``|y - F| << delta`` and linear with
    slope ``delta`` far from it. Computed as the algebraically equal
    ``e^2 / (1 + sqrt(1 + (e / delta)^2))``, ``e = y - F``, which avoids the cancellation of
    ``sqrt(1 + r^2) - 1`` for small residuals.

    Args:
      raw_prediction: the prediction ``F`` for one example, a scalar.
      y: the target, a scalar.
      delta: the residual scale where the loss turns from quadratic to linear; ``> 0``.

    Returns:
      the loss, a scalar.
    """
    check_parameter("pseudo_huber", "delta", delta, lambda value: value > 0, "delta > 0")
    residual = y - raw_prediction
    return jnp.square(residual) / (1.0 + jnp.sqrt(1.0 + jnp.square(residual / delta)))


def quantile(
    raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike, tau: float = 0.5
) -> jax.Array:
    """Pinball loss, ``max(tau e, (tau - 1) e)`` with ``e = y - F``; its minimiser is the
    ``tau``-quantile.

    The Hessian is zero everywhere it exists, so leaves are refit by exact minimisation.

    Args:
      raw_prediction: the prediction ``F`` for one example, a scalar.
      y: the target, a scalar.
      tau: the quantile level, ``0 < tau < 1``; ``0.5`` gives half the absolute error.

    Returns:
      the loss, a scalar.
    """
    check_parameter("quantile", "tau", tau, lambda value: 0 < value < 1, "0 < tau < 1")
    residual = y - raw_prediction
    return jnp.maximum(tau * residual, (tau - 1.0) * residual)
