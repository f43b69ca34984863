"""Losses for counts and positive amounts on a log link: the prediction is ``exp(F)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._elementary import softplus
from ._validation import check_parameter


def poisson(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Poisson negative log-likelihood up to constants, ``exp(F) - y F``.

    Args:
      raw_prediction: the log of the predicted mean, ``F``, for one example, a scalar.
      y: the count, a scalar ``>= 0``.

    Returns:
      the loss, a scalar.
    """
    return jnp.exp(raw_prediction) - y * raw_prediction


def gamma(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Gamma deviance up to constants, ``y exp(-F) + F``.

    Args:
      raw_prediction: the log of the predicted mean, ``F``, for one example, a scalar.
      y: the target, a scalar ``> 0``.

    Returns:
      the loss, a scalar.
    """
    return y * jnp.exp(-raw_prediction) + raw_prediction


def tweedie(
    raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike, power: float = 1.5
) -> jax.Array:
    """Tweedie negative log-likelihood up to constants,
    ``-y exp((1 - p) F) / (1 - p) + exp((2 - p) F) / (2 - p)`` with ``p = power``.

    A compound Poisson-gamma model: exact zeros and positive amounts in one distribution.

    Args:
      raw_prediction: the log of the predicted mean, ``F``, for one example, a scalar.
      y: the target, a scalar ``>= 0``.
      power: the variance power ``p``, ``1 < p < 2``; it tends to Poisson as ``p -> 1`` and
        to gamma as ``p -> 2``.

    Returns:
      the loss, a scalar.
    """
    check_parameter("tweedie", "power", power, lambda value: 1 < value < 2, "1 < power < 2")
    return (
        -y * jnp.exp((1.0 - power) * raw_prediction) / (1.0 - power)
        + jnp.exp((2.0 - power) * raw_prediction) / (2.0 - power)
    )


def negative_binomial(
    raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike, alpha: float = 1.0
) -> jax.Array:
    """Negative binomial (NB2) negative log-likelihood of a count, with mean ``mu = exp(F)`` and
    variance ``mu + alpha mu^2``: a Poisson-gamma mixture for over-dispersed counts.

    ``(y + 1/alpha) log(1 + alpha mu) - y log(alpha mu) - log Gamma(y + 1/alpha)
    + log Gamma(1/alpha) + log Gamma(y + 1)``, written with ``softplus`` so that it stays
    finite for any ``F``. The exact likelihood, so that it can be compared across ``alpha``
    (e.g. to choose it on validation data); as ``alpha -> 0`` it tends to the Poisson.

    Args:
      raw_prediction: the log of the predicted mean, ``F``, for one example, a scalar.
      y: the count, a scalar ``>= 0``.
      alpha: the dispersion, ``> 0``.

    Returns:
      the loss, a scalar.
    """
    check_parameter("negative_binomial", "alpha", alpha, lambda value: value > 0, "alpha > 0")
    size = 1.0 / alpha
    log_alpha_mu = jnp.log(alpha) + raw_prediction
    return ((y + size) * softplus(log_alpha_mu) - y * log_alpha_mu
            - jax.scipy.special.gammaln(y + size) + jax.scipy.special.gammaln(size)
            + jax.scipy.special.gammaln(y + 1.0))
