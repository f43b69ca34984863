"""Predictor: tree arrays + ``X_binned`` -> raw predictions, compiled and vectorised over trees.

A row walks ``max_depth`` levels of the heap; once it reaches a leaf it stays there, so every
tree costs the same fixed number of gathers and there is no data-dependent branching. Trees of
all rounds are accumulated by ``lax.scan`` (one tree's ``(n, K)`` contribution in memory at a
time), outputs by ``vmap``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from .tree import Tree, depth_of_heap


def leaf_index(tree: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Heap index of the leaf that each row of ``X_binned`` (n, d) uint8 reaches in one tree."""
    max_depth = depth_of_heap(tree.feature.shape[-1])
    n_rows = X_binned.shape[0]
    row_ids = jnp.arange(n_rows)
    node = jnp.zeros(n_rows, jnp.int32)
    for _ in range(max_depth):
        code = X_binned[row_ids, tree.feature[node]].astype(jnp.int32)
        goes_right = jnp.where(code == missing_bin, ~tree.default_left[node], code > tree.threshold_bin[node])
        node = jnp.where(tree.is_leaf[node], node, 2 * node + 1 + goes_right.astype(jnp.int32))
    return node


def predict_round(trees: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Raw contribution ``(n, K)`` of one round's K trees (``trees`` fields shaped ``(K, nodes)``)."""

    def one_output(tree):
        return tree.value[leaf_index(tree, X_binned, missing_bin)]

    return jax.vmap(one_output, out_axes=1)(trees)


@partial(jax.jit, static_argnames="missing_bin")
def predict_raw_binned(trees: Tree, X_binned: jax.Array, initial: jax.Array, missing_bin: int) -> jax.Array:
    """``initial`` (n, K) plus the sum of all rounds' trees (fields shaped ``(rounds, K, nodes)``)."""

    def add_round(raw_prediction, round_trees):
        return raw_prediction + predict_round(round_trees, X_binned, missing_bin), None

    raw_prediction, _ = lax.scan(add_round, initial, trees)
    return raw_prediction


@partial(jax.jit, static_argnames="missing_bin")
def predict_leaf_binned(trees: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Leaf heap index per row, round and output: ``(n, rounds, K)``."""
    per_tree = jax.vmap(jax.vmap(lambda tree: leaf_index(tree, X_binned, missing_bin)))(trees)
    return jnp.moveaxis(per_tree, -1, 0)
