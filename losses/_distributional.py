"""Distributional regression: losses whose K raw outputs are the parameters of a predictive
distribution, and the quantiles of that distribution.

Each loss is the exact negative log-likelihood of one example, a function of a length-2 raw
prediction ``(mu, log_sigma)`` and a scalar label. Every output gets its own trees, so the
model predicts a location and a scale per row; the link ``location_scale`` turns the raw
outputs into the parameters ``(mu, sigma)`` that ``predict`` returns and that the quantile
functions here take.

The library needs non-negative Hessian diagonals. The Gaussian and log-normal negative
log-likelihoods have them everywhere. The Student-t one does not (its curvature in ``mu`` is
negative for outliers), so ``student_t_nll`` keeps its exact value and gradient but reports the
Fisher information as its curvature: Fisher scoring.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import betainc, gammaln, ndtri

from ._validation import check_parameter

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
# |z| beyond which z**2 is not formed: log(1 + z^2/df) is then computed from log|z|, so a huge
# standardised residual gives a large finite loss instead of an overflow to inf.
_SQUARE_SAFE = 1e15
# Bisection steps for the Student-t quantile: enough to reach float64 resolution from [0, 2^20].
_QUANTILE_BISECTIONS = 80
_QUANTILE_SEARCH_LIMIT = 2.0**20


def location_scale(raw_prediction: jax.typing.ArrayLike) -> jax.Array:
    """Inverse link of the distributional losses: raw ``(..., 2)`` = ``(mu, log_sigma)`` ->
    parameters ``(..., 2)`` = ``(mu, sigma)``.

    Args:
      raw_prediction: raw predictions whose last axis is ``(mu, log_sigma)``.

    Returns:
      an array of the same shape holding ``(mu, exp(log_sigma))``.
    """
    raw = jnp.asarray(raw_prediction)
    return jnp.stack([raw[..., 0], jnp.exp(raw[..., 1])], axis=-1)


def _location_and_log_scale(raw_prediction, loss_name: str):
    raw = jnp.asarray(raw_prediction)
    if raw.shape != (2,):
        raise ValueError(
            f"loss '{loss_name}' takes 2 raw outputs (mu, log_sigma) per example; got shape {raw.shape}"
        )
    return raw[0], raw[1]


def _standardised_residual(y, mu, log_sigma):
    # Multiplying by exp(-log_sigma) instead of dividing by exp(log_sigma) keeps small sigmas
    # (large negative log_sigma) from underflowing to a zero divisor.
    return (y - mu) * jnp.exp(-log_sigma)


def _log1p_square_over(z, df):
    """``log(1 + z^2 / df)`` without forming ``z^2`` for huge ``|z|``; both branches see only
    inputs where they are finite, so the derivative of the unused branch is not NaN."""
    huge = jnp.abs(z) > _SQUARE_SAFE
    z_moderate = jnp.where(huge, 0.0, z)
    z_huge = jnp.where(huge, z, _SQUARE_SAFE)
    moderate = jnp.log1p(jnp.square(z_moderate) / df)
    # log1p(df / z^2) < 1e-29 relative here, and dropping it keeps z^2 (which overflows
    # float32 near |z| = 1.8e19) out of the second derivative.
    far = 2.0 * jnp.log(jnp.abs(z_huge)) - jnp.log(df)
    return jnp.where(huge, far, moderate)


def _with_curvature(negative_log_likelihood, raw_prediction, curvature):
    """``negative_log_likelihood`` whose Hessian in the raw prediction is ``diag(curvature)`` at
    the evaluation point (no cross-derivatives), its value and every first derivative exact.

    The likelihood enters as its first-order expansion about the point, whose gradient in the
    raw prediction is held fixed there (no second derivative), and ``curvature`` as a quadratic
    term that is zero, with a zero gradient, at the point. So the value, the gradient in the raw
    prediction, the derivatives in the label and the loss's parameters (and those of the
    gradient: the mixed second derivatives) are the likelihood's, and autodiff's Hessian in the
    raw prediction is ``diag(curvature)``. The exact Hessian is never formed: computing it only to
    subtract it (nested in the round's own derivatives) had made the Student t's derivatives'
    program 2.4 times the Gaussian's.

    A curvature that is not finite (the Student t's Fisher information in ``mu`` overflows
    float32 below a scale of ``e^-44``) would make the term NaN at the point (infinity times a
    zero step), and the value and gradient with it: there the curvature reported is -1 instead,
    which training rejects as a negative Hessian, and the value and gradient stay finite."""
    point = lax.stop_gradient(raw_prediction)
    value, gradient = jax.value_and_grad(negative_log_likelihood)(point)
    step = raw_prediction - point
    curvature = lax.stop_gradient(curvature)
    curvature = jnp.where(jnp.isfinite(curvature), curvature, -1.0)
    return value + jnp.dot(gradient, step) + 0.5 * jnp.dot(curvature, jnp.square(step))


def gaussian_nll(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Gaussian negative log-likelihood, ``-log N(y; mu, sigma^2)``, with ``sigma = exp(s)``:
    ``s + z^2 / 2 + log(2 pi) / 2`` where ``z = (y - mu) / sigma``.

    Hessian diagonal: ``exp(-2 s)`` in ``mu`` and ``2 z^2`` in ``s``, both ``>= 0``. The value is
    finite while ``|y - mu| exp(-s) < 1e19`` (float32).

    Args:
      raw_prediction: ``(mu, s)`` for one example, shape ``(2,)``: the mean and the log of the
        standard deviation.
      y: the target, a scalar.

    Returns:
      the loss, a scalar.
    """
    mu, log_sigma = _location_and_log_scale(raw_prediction, "gaussian_nll")
    z = _standardised_residual(y, mu, log_sigma)
    return log_sigma + 0.5 * jnp.square(z) + _HALF_LOG_2PI


def lognormal_nll(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Log-normal negative log-likelihood: ``log y`` is Gaussian with mean ``mu`` and standard
    deviation ``sigma = exp(s)``; ``gaussian_nll((mu, s), log y) + log y``.

    Same Hessian diagonal as ``gaussian_nll`` at ``log y``, so ``>= 0``.

    Args:
      raw_prediction: ``(mu, s)`` for one example, shape ``(2,)``: mean and log standard
        deviation of ``log y``.
      y: the target, a scalar ``> 0``.

    Returns:
      the loss, a scalar.
    """
    mu, log_sigma = _location_and_log_scale(raw_prediction, "lognormal_nll")
    log_y = jnp.log(y)
    z = _standardised_residual(log_y, mu, log_sigma)
    return log_sigma + 0.5 * jnp.square(z) + _HALF_LOG_2PI + log_y


def _student_t_log_normaliser(df):
    return gammaln(0.5 * df) - gammaln(0.5 * (df + 1.0)) + 0.5 * jnp.log(df * math.pi)


def student_t_nll(
    raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike, df: float = 5.0
) -> jax.Array:
    """Student-t negative log-likelihood with ``df`` degrees of freedom, location ``mu`` and
    scale ``sigma = exp(s)``: ``s + (df + 1)/2 log(1 + z^2/df) + log normaliser``, with
    ``z = (y - mu) / sigma``. Heavy tails make ``mu`` robust to outliers.

    The value and the gradient are exact. The exact curvature in ``mu``,
    ``(df + 1) (df - z^2) / (df + z^2)^2 exp(-2 s)``, is negative for ``|z| > sqrt(df)``, which
    the library does not accept; the Hessian reported to autodiff is therefore the Fisher
    information, ``(df + 1)/(df + 3) exp(-2 s)`` in ``mu`` and ``2 df/(df + 3)`` in ``s`` on the
    diagonal and zero off it (Fisher scoring: the expected curvature, positive definite
    everywhere; the expected cross-derivative vanishes, the likelihood being symmetric in
    ``y - mu``), which the full Hessian of vector leaves reads too. It tends to the Gaussian's
    as ``df`` grows.

    Args:
      raw_prediction: ``(mu, s)`` for one example, shape ``(2,)``: the location and the log of
        the scale.
      y: the target, a scalar.
      df: degrees of freedom, ``> 0``; the variance ``sigma^2 df/(df - 2)`` exists for
        ``df > 2``.

    Returns:
      the loss, a scalar.
    """
    check_parameter("student_t_nll", "df", df, lambda value: value > 0, "df > 0")
    mu, log_sigma = _location_and_log_scale(raw_prediction, "student_t_nll")
    raw = jnp.stack([mu, log_sigma])

    def exact(raw_prediction):
        z = _standardised_residual(y, raw_prediction[0], raw_prediction[1])
        return raw_prediction[1] + 0.5 * (df + 1.0) * _log1p_square_over(z, df) + _student_t_log_normaliser(df)

    location_information = (df + 1.0) / (df + 3.0) * jnp.exp(-2.0 * log_sigma)
    log_scale_information = jnp.asarray(2.0 * df / (df + 3.0), location_information.dtype)
    fisher_information = jnp.stack([location_information, log_scale_information])
    return _with_curvature(exact, raw, fisher_information)


def _parameters(params, loss_name: str):
    params = jnp.asarray(params)
    if params.ndim == 0 or params.shape[-1] != 2:
        raise ValueError(
            f"'{loss_name}' quantiles take parameters (..., 2) = (mu, sigma) as predict returns them; "
            f"got shape {params.shape}"
        )
    return params[..., 0], params[..., 1]


def _check_level(level) -> jax.Array:
    """Concrete levels are checked on the host; traced ones (inside ``jax.jit``) cannot be."""
    try:
        concrete = np.asarray(level, dtype=np.float64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return jnp.asarray(level)
    if not np.all((concrete > 0) & (concrete < 1)):
        raise ValueError(f"quantile levels must be in (0, 1); got {concrete}")
    return jnp.asarray(level)


def gaussian_quantile(params: jax.typing.ArrayLike, level: jax.typing.ArrayLike) -> jax.Array:
    """Quantile of N(mu, sigma^2) at ``level``: ``mu + sigma * Phi^-1(level)``.

    Args:
      params: ``(..., 2)`` = ``(mu, sigma)``, as ``predict`` of a ``gaussian_nll`` model returns.
      level: probability in (0, 1), a scalar or an array broadcasting against ``params[..., 0]``.

    Returns:
      the quantiles, shaped like ``params[..., 0]`` broadcast with ``level``.
    """
    mu, sigma = _parameters(params, "gaussian_nll")
    return mu + sigma * ndtri(_check_level(level))


def lognormal_quantile(params: jax.typing.ArrayLike, level: jax.typing.ArrayLike) -> jax.Array:
    """Quantile of the log-normal distribution at ``level``: ``exp(mu + sigma * Phi^-1(level))``.

    Args:
      params: ``(..., 2)`` = ``(mu, sigma)`` of ``log y``, as ``predict`` of a ``lognormal_nll``
        model returns.
      level: probability in (0, 1), a scalar or an array broadcasting against ``params[..., 0]``.

    Returns:
      the quantiles of ``y``.
    """
    mu, sigma = _parameters(params, "lognormal_nll")
    return jnp.exp(mu + sigma * ndtri(_check_level(level)))


def _standard_student_t_quantile(level, df):
    """Quantile of the standard t distribution, by bisection on its CDF: the upper tail
    probability of ``|t|`` is ``betainc(df/2, 1/2, df/(df + t^2))``, decreasing in ``|t|``."""
    tail = 2.0 * jnp.minimum(level, 1.0 - level)  # P(|T| > t) at the wanted |t|

    def tail_probability(t):
        return betainc(0.5 * df, 0.5, df / (df + jnp.square(t)))

    def halve(_, bracket):
        low, high = bracket
        middle = 0.5 * (low + high)
        beyond = tail_probability(middle) < tail  # middle is past the wanted |t|
        return jnp.where(beyond, low, middle), jnp.where(beyond, middle, high)

    start = (jnp.zeros_like(tail), jnp.full_like(tail, _QUANTILE_SEARCH_LIMIT))
    low, high = lax.fori_loop(0, _QUANTILE_BISECTIONS, halve, start)
    return jnp.sign(level - 0.5) * 0.5 * (low + high)


def student_t_quantile(
    params: jax.typing.ArrayLike, level: jax.typing.ArrayLike, df: float = 5.0
) -> jax.Array:
    """Quantile of the Student-t distribution with location ``mu`` and scale ``sigma`` at
    ``level``: ``mu + sigma * t_df^-1(level)``.

    Args:
      params: ``(..., 2)`` = ``(mu, sigma)``, as ``predict`` of a ``student_t_nll`` model returns.
      level: probability in (0, 1), a scalar or an array broadcasting against ``params[..., 0]``.
      df: degrees of freedom, ``> 0``: the value the model was trained with.

    Returns:
      the quantiles; accurate to about 1e-6 relative (the resolution of ``betainc``).
    """
    check_parameter("student_t_nll", "df", df, lambda value: value > 0, "df > 0")
    mu, sigma = _parameters(params, "student_t_nll")
    level = _check_level(level)
    dtype = jnp.result_type(level.dtype, jnp.asarray(params).dtype, jnp.float32)
    return mu + sigma * _standard_student_t_quantile(level.astype(dtype), jnp.asarray(df, dtype))
