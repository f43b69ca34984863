"""Link: raw predictions (margins) -> predictions (``y_pred``), the inverse link of a loss."""

from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp

from . import losses


# Module-level functions (not lambdas or jitted callables), so that a Model holding one pickles.
def identity(raw_prediction):
    return raw_prediction


def sigmoid(raw_prediction):
    return jax.nn.sigmoid(raw_prediction)


def sigmoid_2x(raw_prediction):
    # AdaBoost's exponential loss estimates half the log-odds.
    return jax.nn.sigmoid(2.0 * raw_prediction)


def softmax(raw_prediction):
    return jax.nn.softmax(raw_prediction, axis=-1)


def exp(raw_prediction):
    return jnp.exp(raw_prediction)


def step(raw_prediction):
    return (raw_prediction > 0).astype(jnp.float32)


LINKS: dict[str, Callable] = {
    "identity": identity,
    "sigmoid": sigmoid,
    "sigmoid_2x": sigmoid_2x,
    "softmax": softmax,
    "exp": exp,
    "step": step,
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
