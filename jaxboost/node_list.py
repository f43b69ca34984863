"""Node lists: heap tree arrays -> explicit per-tree node lists, the common step of every export.

jaxboost keeps each tree in a fixed-size heap (children ``2i + 1`` and ``2i + 2``) with split
thresholds as bin indices. Other libraries (XGBoost's JSON, treelite, shap) want the reached
nodes only, numbered breadth-first, with explicit child indices and thresholds on raw feature
values. The threshold follows from the binning convention: "bin <= t goes left" is exactly
"x < edges[feature, t]", so a split's raw threshold is that edge and the comparison is ``<``.
A split on a padded ``+inf`` edge (every non-missing value goes left) gets the largest float32
instead, which keeps the files valid JSON and still sends every finite value left.

Host-side NumPy: this is I/O, not training.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .link import LINKS

# Standing in for a +inf edge: every finite float32 is below it.
LARGEST_THRESHOLD = np.float32(np.finfo(np.float32).max)


class NodeList(NamedTuple):
    """One tree's reached nodes in breadth-first order (node 0 is the root)."""

    heap_index: np.ndarray  # int32: the node's slot in jaxboost's heap
    left_child: np.ndarray  # int32: -1 for leaves
    right_child: np.ndarray  # int32: -1 for leaves
    parent: np.ndarray  # int32: -1 for the root
    feature: np.ndarray  # int32: split feature, -1 for leaves
    threshold: np.ndarray  # float32: x < threshold goes left; 0 for leaves
    default_left: np.ndarray  # bool: where missing values go (False for leaves)
    is_leaf: np.ndarray  # bool
    value: np.ndarray  # float32: the node's value (the leaf output for leaves)
    loss_change: np.ndarray  # float32: the split's loss_chg, 0 for leaves
    sum_hessians: np.ndarray  # float32: the node's cover

    @property
    def num_nodes(self) -> int:
        return int(self.heap_index.shape[0])


def reached_nodes(is_leaf: np.ndarray) -> np.ndarray:
    """Which heap slots a row can reach, for heap trees ``(..., nodes)``: the root, and both
    children of every reached split node."""
    reached = np.zeros(is_leaf.shape, bool)
    reached[..., 0] = True
    for child in range(1, is_leaf.shape[-1]):
        parent = (child - 1) // 2
        reached[..., child] = reached[..., parent] & ~is_leaf[..., parent]
    return reached


def split_thresholds(feature: np.ndarray, threshold_bin: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Raw thresholds (float32) of splits given as bin indices: ``x < threshold`` goes left.

    Thresholds on padded ``+inf`` edges (or past the edge array) become the largest float32.
    """
    feature = np.asarray(feature, np.int64)
    threshold_bin = np.asarray(threshold_bin, np.int64)
    inside = (threshold_bin >= 0) & (threshold_bin < edges.shape[1])
    raw = edges[np.clip(feature, 0, edges.shape[0] - 1), np.clip(threshold_bin, 0, edges.shape[1] - 1)]
    raw = np.where(inside & np.isfinite(raw), raw, LARGEST_THRESHOLD)
    return raw.astype(np.float32)


def heap_to_node_list(tree, edges: np.ndarray) -> NodeList:
    """One tree's heap arrays (fields shaped ``(nodes,)``) as a breadth-first ``NodeList``."""
    is_leaf = np.asarray(tree.is_leaf, bool)
    reached = reached_nodes(is_leaf)
    # Heap order restricted to reached slots is breadth-first order: level by level, left to right.
    heap_index = np.flatnonzero(reached).astype(np.int32)
    new_index = np.full(is_leaf.shape[0], -1, np.int32)
    new_index[heap_index] = np.arange(heap_index.shape[0], dtype=np.int32)
    leaf = is_leaf[heap_index]
    split = ~leaf
    if np.any(split & (2 * heap_index + 2 >= is_leaf.shape[0])):
        raise ValueError("malformed tree: a split node in the last heap level has no children")
    left_heap = np.where(split, 2 * heap_index + 1, 0)
    right_heap = np.where(split, 2 * heap_index + 2, 0)
    left_child = np.where(split, new_index[left_heap], -1).astype(np.int32)
    right_child = np.where(split, new_index[right_heap], -1).astype(np.int32)
    parent = np.where(heap_index > 0, new_index[np.maximum(heap_index - 1, 0) // 2], -1).astype(np.int32)
    feature = np.asarray(tree.feature)[heap_index].astype(np.int32)
    if np.any(split & ((feature < 0) | (feature >= edges.shape[0]))):
        raise ValueError(f"malformed tree: a split feature is outside the model's {edges.shape[0]} features")
    threshold = split_thresholds(feature, np.asarray(tree.threshold_bin)[heap_index], edges)
    return NodeList(
        heap_index=heap_index,
        left_child=left_child,
        right_child=right_child,
        parent=parent,
        feature=np.where(split, feature, -1).astype(np.int32),
        threshold=np.where(split, threshold, np.float32(0)).astype(np.float32),
        default_left=np.asarray(tree.default_left, bool)[heap_index] & split,
        is_leaf=leaf,
        value=np.asarray(tree.value, np.float32)[heap_index],
        loss_change=np.where(split, np.asarray(tree.loss_change, np.float32)[heap_index], np.float32(0)),
        sum_hessians=np.asarray(tree.sum_hessians, np.float32)[heap_index],
    )


def model_node_lists(model, rounds: tuple[int, int] | None = None) -> list[list[NodeList]]:
    """Node lists of a model's trees, ``[round][output]``, for rounds ``a .. b-1`` (all by default)."""
    start, stop = (0, model.num_rounds) if rounds is None else rounds
    trees = model.trees
    edges = np.asarray(model.bin_edges.edges, np.float32)
    return [[heap_to_node_list(type(trees)(*(np.asarray(field)[round_index, output] for field in trees)), edges)
             for output in range(model.num_outputs)]
            for round_index in range(start, stop)]


def link_name(model) -> str | None:
    """The name of the model's inverse link in ``jaxboost.link.LINKS``, or None for a custom one."""
    for name, function in LINKS.items():
        if model.link is function:
            return name
    return None
