"""Tree arrays: one tree as heap-indexed node arrays of static size.

Node ``i`` has children ``2i + 1`` (left) and ``2i + 2`` (right); a tree of depth ``D`` has
``2^(D+1) - 1`` slots. Nodes that were never reached keep zeros and are never visited. Every
reached node stores its value (the leaf value it would have, learning rate included), its
Hessian sum (cover) and, for split nodes, XGBoost's ``loss_chg``. A stack of trees is the same
record with leading axes ``(rounds, outputs)``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


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
