"""Regularizer: the leaf value and the split score, derived in one place from the leaf penalty.

A leaf holding rows with gradient sum ``G`` and Hessian sum ``H`` gets the value ``w`` that
minimises the second-order objective plus the penalty,

    objective(w) = G w + 1/2 (H + lambda) w^2 + alpha |w|

which is ``w* = -T_alpha(G) / (H + lambda)`` (``T_alpha`` the soft threshold), clipped to
``[-max_delta_step, max_delta_step]`` when ``max_delta_step > 0``. A node's score is
``-2 objective(w*)`` (``T_alpha(G)^2 / (H + lambda)`` without clipping), and a split's
``loss_chg`` is ``score(left) + score(right) - score(parent)``, XGBoost's convention, so that
``gamma`` (``min_split_loss``) means the same number in both libraries. Nothing else in
jaxboost derives a leaf value or a gain.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Regularization(NamedTuple):
    """Leaf penalty parameters; traced values so that changing them does not recompile."""

    reg_lambda: jax.Array
    reg_alpha: jax.Array
    max_delta_step: jax.Array  # 0 means no clipping


def soft_threshold(G: jax.Array, alpha: jax.Array) -> jax.Array:
    return jnp.sign(G) * jnp.maximum(jnp.abs(G) - alpha, 0.0)


def leaf_penalty(w: jax.Array, reg: Regularization) -> jax.Array:
    """The penalty on a leaf value: lambda/2 w^2 + alpha |w| (the ``gamma T`` term is per split)."""
    return 0.5 * reg.reg_lambda * w * w + reg.reg_alpha * jnp.abs(w)


def clip_leaf_value(w: jax.Array, reg: Regularization) -> jax.Array:
    bound = reg.max_delta_step
    return jnp.where(bound > 0, jnp.clip(w, -bound, bound), w)


def leaf_value(sum_gradients: jax.Array, sum_hessians: jax.Array, reg: Regularization) -> jax.Array:
    """The minimiser of ``G w + 1/2 H w^2 + penalty(w)`` (before the learning rate)."""
    denominator = sum_hessians + reg.reg_lambda
    # A node with no Hessian mass and no lambda has nothing to fit: value 0 rather than 0/0.
    safe_denominator = jnp.where(denominator > 0, denominator, 1.0)
    w = jnp.where(denominator > 0, -soft_threshold(sum_gradients, reg.reg_alpha) / safe_denominator, 0.0)
    return clip_leaf_value(w, reg)


def node_score(sum_gradients: jax.Array, sum_hessians: jax.Array, reg: Regularization) -> jax.Array:
    """``-2 x`` the regularised objective at the node's optimal value (larger is better)."""

    def closed_form():
        # Without clipping the objective at w* is -T_alpha(G)^2 / (2 (H + lambda)): cheaper
        # than evaluating it, which matters in the split scan over every candidate.
        denominator = sum_hessians + reg.reg_lambda
        threshold = soft_threshold(sum_gradients, reg.reg_alpha)
        return jnp.where(denominator > 0, threshold * threshold / jnp.where(denominator > 0, denominator, 1.0), 0.0)

    def at_clipped_value():
        w = leaf_value(sum_gradients, sum_hessians, reg)
        return -2.0 * (sum_gradients * w + 0.5 * sum_hessians * w * w + leaf_penalty(w, reg))

    return jax.lax.cond(reg.max_delta_step > 0, at_clipped_value, closed_form)


def split_loss_change(left_gradients, left_hessians, right_gradients, right_hessians, reg: Regularization,
                      parent_score: jax.Array | None = None):
    """XGBoost's ``loss_chg`` of splitting a node into the given children (pass the parent's
    ``node_score`` when many candidates share one parent)."""
    if parent_score is None:
        parent_score = node_score(left_gradients + right_gradients, left_hessians + right_hessians, reg)
    return node_score(left_gradients, left_hessians, reg) + node_score(right_gradients, right_hessians, reg) - parent_score
