"""Link: raw predictions (margins) -> predictions (``y_pred``), the inverse link of a loss."""

from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp

from . import losses


def _step(raw_prediction):
    return (raw_prediction > 0).astype(jnp.float32)


LINKS: dict[str, Callable] = {
    "identity": lambda raw_prediction: raw_prediction,
    "sigmoid": jax.nn.sigmoid,
    # AdaBoost's exponential loss estimates half the log-odds.
    "sigmoid_2x": lambda raw_prediction: jax.nn.sigmoid(2.0 * raw_prediction),
    "softmax": lambda raw_prediction: jax.nn.softmax(raw_prediction, axis=-1),
    "exp": jnp.exp,
    "step": _step,
    # Distributional losses: raw (mu, log_sigma) -> (mu, sigma).
    "location_scale": losses.location_scale,
}

Link = Union[str, Callable]


def resolve_link(link: Link) -> Callable:
    """A link function from its name or a JAX function of the raw prediction array."""
    if callable(link):
        return link
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; known links: {sorted(LINKS)} (or pass a JAX function)")
    return LINKS[link]
