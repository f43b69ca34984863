"""Classification losses on raw scores (logits or margins)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._elementary import softplus


def _signed_label(y: jax.typing.ArrayLike) -> jax.Array:
    """Maps labels 0/1 to -1/+1."""
    return 2.0 * y - 1.0


def logistic(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Binary log loss on a logit, ``softplus(F) - y F``.

    Equals ``-y log p - (1 - y) log(1 - p)`` with ``p = sigmoid(F)``, without forming ``p``.

    Args:
      raw_prediction: the logit ``F`` for one example, a scalar.
      y: the label, a scalar in ``[0, 1]`` (0/1 or a probability).

    Returns:
      the loss, a scalar.
    """
    return softplus(raw_prediction) - y * raw_prediction


def softmax(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Multiclass log loss on logits, ``logsumexp(F) - F[y]``.

    Args:
      raw_prediction: the logits ``F`` for one example, a vector of length ``K``.
      y: the class label, an integer scalar in ``0..K-1``.

    Returns:
      the loss, a scalar.
    """
    # The label's logit picked by a mask rather than an index: an index's derivative is a
    # scatter, which XLA's CPU compiler turns into a loop over the rows, one row a step.
    picked = jnp.where(jnp.arange(jnp.shape(raw_prediction)[-1]) == y, raw_prediction, 0.0)
    return jax.nn.logsumexp(raw_prediction) - jnp.sum(picked)


def exponential(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Exponential (AdaBoost) loss, ``exp(-s F)`` with ``s = 2 y - 1``.

    Its population minimiser is half the log-odds, hence the ``sigmoid(2 F)`` link.

    Args:
      raw_prediction: the margin ``F`` for one example, a scalar.
      y: the label, 0 or 1.

    Returns:
      the loss, a scalar.
    """
    return jnp.exp(-_signed_label(y) * raw_prediction)


def hinge(raw_prediction: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Hinge loss, ``max(0, 1 - s F)`` with ``s = 2 y - 1``.

    The Hessian is zero everywhere it exists, so leaves are refit by exact minimisation.

    Args:
      raw_prediction: the margin ``F`` for one example, a scalar.
      y: the label, 0 or 1.

    Returns:
      the loss, a scalar.
    """
    return jax.nn.relu(1.0 - _signed_label(y) * raw_prediction)
