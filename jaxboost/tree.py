"""Tree arrays: one tree as heap-indexed node arrays of static size.

Node ``i`` has children ``2i + 1`` (left) and ``2i + 2`` (right); a tree of depth ``D`` has
``2^(D+1) - 1`` slots. Nodes that were never reached keep zeros and are never visited. Every
reached node stores its value (the leaf value it would have, learning rate included), its
Hessian sum (cover) and, for split nodes, XGBoost's ``loss_chg``. A stack of trees is the same
record with leading axes ``(rounds, outputs)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def num_heap_nodes(max_depth: int) -> int:
    return 2 ** (max_depth + 1) - 1


def depth_of_heap(num_nodes: int) -> int:
    return (num_nodes + 1).bit_length() - 2


class Tree(NamedTuple):
    """Node arrays, each ``(..., 2^(max_depth+1) - 1)``."""

    feature: jax.Array  # int32: split feature
    threshold_bin: jax.Array  # int32: bins <= threshold_bin go left
    default_left: jax.Array  # bool: where missing values go
    is_leaf: jax.Array  # bool
    value: jax.Array  # float32: leaf value times the learning rate (also kept for inner nodes)
    loss_change: jax.Array  # float32: XGBoost's loss_chg of the split (0 for leaves)
    sum_hessians: jax.Array  # float32: the node's Hessian sum (XGBoost's cover)


def pack_fields(tree: Tree) -> jax.Array:
    """Every field of ``tree`` flattened into one uint32 array, in field order: int32 and
    float32 fields as their bit patterns, bools as 0 or 1. The host reads a round's trees as
    this one array: NumPy took 5-13 us to read each of the seven fields, up to a quarter of a
    round on 200 rows."""
    words = [(field.astype(jnp.uint32) if field.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(field, jnp.uint32))
             for field in tree]
    return jnp.concatenate([w.reshape(-1) for w in words])


def unpack_fields(packed: np.ndarray, template: Tree) -> Tree:
    """The trees that ``pack_fields`` packed into the last axis of ``packed``, leading axes
    (rounds, models) kept; ``template``: the fields' shapes and dtypes (``ShapeDtypeStruct``)."""
    lead, fields, start = packed.shape[:-1], [], 0
    for field in template:
        words = packed[..., start:start + math.prod(field.shape)]
        start += words.shape[-1]
        values = words != 0 if field.dtype == np.bool_ else words.view(field.dtype)
        fields.append(np.ascontiguousarray(values.reshape(lead + tuple(field.shape))))
    if start != packed.shape[-1]:
        raise ValueError(f"packed trees hold {packed.shape[-1]} words; the template's fields {start}")
    return Tree(*fields)
