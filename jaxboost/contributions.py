"""Contributions: exact path-dependent TreeSHAP values of the raw prediction, compiled with JAX.

For one tree, the expected output when only the features in ``S`` are known follows a row's
own branch at splits on features in ``S`` and averages both branches by cover (Hessian sum)
at the others: XGBoost's ``pred_contribs`` (Lundberg et al. 2018, "Consistent individualized
feature attribution for tree ensembles"). Written per leaf ``l`` with value ``v``, and per
distinct feature ``j`` on its path (``M`` of them),

    E[f | x_S] = sum_l v_l prod_j (o_j if j in S else z_j),

where ``z_j`` is the product of the cover fractions ``cover(child) / cover(node)`` of the
path's splits on ``j`` and ``o_j`` is 1 when the row takes every one of those branches, else 0.
The Shapley value of feature ``i`` is then, per leaf,

    v (o_i - z_i) sum_k k! (M - k - 1)! / M! * [t^k] prod_{j != i} (z_j + o_j t),

with ``[t^k]`` a coefficient of the polynomial. The product over all slots is built once per
leaf and slot ``i``'s factor divided out again: by ``z_i`` when ``o_i = 0``, and by ``z_i + t``
from the top coefficient down when ``o_i = 1`` (each step multiplies the error by ``z_i <= 1``).
Everything is vectorised: rows and leaves in arrays, rounds by ``lax.scan``, outputs by
``vmap``, row chunks by ``lax.map``, and static loops over the path's depth. The bias column is
the starting value plus every tree's cover-weighted mean, so each row sums to the raw
prediction.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .node_list import reached_nodes
from .tree import depth_of_heap

# Rows per compiled chunk are chosen so one chunk's polynomial tables stay near this size.
CHUNK_ELEMENTS = 2 ** 22


class PathTables(NamedTuple):
    """Every leaf's root-to-leaf path, fields ``(rounds, outputs, leaves, depth, ...)``.

    Leaves are packed to ``2^depth`` slots per tree (padding has value 0); path positions past
    the leaf's depth are invalid. A "slot" is the first path position of each distinct feature.
    """

    feature: np.ndarray  # int32 (R, K, L, D): split feature at each path position
    threshold_bin: np.ndarray  # int32 (R, K, L, D)
    default_left: np.ndarray  # bool (R, K, L, D)
    goes_right: np.ndarray  # bool (R, K, L, D): the branch the path takes
    member: np.ndarray  # bool (R, K, L, D, D): position k belongs to the slot j
    is_slot: np.ndarray  # bool (R, K, L, D)
    zero_fraction: np.ndarray  # float32 (R, K, L, D): z_j of each slot (1 elsewhere)
    n_slots: np.ndarray  # int32 (R, K, L): M, the distinct features on the path
    leaf_value: np.ndarray  # float32 (R, K, L)


def _heap_paths(depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every heap slot: its ancestor at each depth, whether the path turns right there, and
    whether that depth lies above the slot."""
    num_nodes = 2 ** (depth + 1) - 1
    ancestor = np.zeros((num_nodes, max(depth, 1)), np.int64)
    turns_right = np.zeros((num_nodes, max(depth, 1)), bool)
    on_path = np.zeros((num_nodes, max(depth, 1)), bool)
    for node in range(1, num_nodes):
        level = (node + 1).bit_length() - 1
        child = node
        for position in range(level - 1, -1, -1):
            parent = (child - 1) // 2
            ancestor[node, position] = parent
            turns_right[node, position] = child == 2 * parent + 2
            on_path[node, position] = True
            child = parent
    return ancestor, turns_right, on_path


def path_tables(trees) -> PathTables:
    """Host-side per-leaf path tables of heap trees with fields ``(R, K, nodes)``.

    Raises ValueError when a split node's cover is not positive: the cover fractions that
    weigh unknown features' branches are then undefined.
    """
    is_leaf = np.asarray(trees.is_leaf, bool)
    rounds, outputs, num_nodes = is_leaf.shape
    depth = depth_of_heap(num_nodes)
    positions = max(depth, 1)
    num_leaves = 2 ** depth
    reached = reached_nodes(is_leaf)
    leaf = reached & is_leaf
    cover = np.asarray(trees.sum_hessians, np.float64)
    bad_cover = reached & ~is_leaf & ~(cover > 0)
    if bad_cover.any():
        round_index, output, node = np.argwhere(bad_cover)[0]
        raise ValueError(f"TreeSHAP weighs branches by node cover (sum_hessians), but the split node {node} of "
                         f"round {round_index}, output {output} has cover {cover[round_index, output, node]}: "
                         "contributions are undefined for this model")
    # Leaves first, in heap order, then padding (any slot: its value is zeroed below).
    order = np.argsort(~leaf, axis=-1, kind="stable")[..., :num_leaves]
    leaf_valid = np.take_along_axis(leaf, order, axis=-1)
    ancestor, turns_right, on_path = _heap_paths(depth)
    path_node = ancestor[order]  # (R, K, L, D)
    valid = on_path[order] & leaf_valid[..., None]
    goes_right = turns_right[order] & valid
    child = np.where(valid, 2 * path_node + 1 + goes_right, 0)

    def along_path(field, nodes):
        flat = np.asarray(field).reshape(rounds, outputs, num_nodes)
        return np.take_along_axis(flat, nodes.reshape(rounds, outputs, -1), axis=-1).reshape(nodes.shape)

    feature = np.where(valid, along_path(trees.feature, path_node), -1).astype(np.int32)
    threshold_bin = along_path(trees.threshold_bin, path_node).astype(np.int32)
    default_left = along_path(trees.default_left, path_node).astype(bool)
    parent_cover = along_path(cover, path_node)
    fraction = np.where(valid, along_path(cover, child) / np.where(valid, parent_cover, 1.0), 1.0)

    # Position k joins the slot of the first position j <= k with the same feature.
    same = (feature[..., :, None] == feature[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    earlier_or_same = np.tril(np.ones((positions, positions), bool))
    first = np.argmax(same & earlier_or_same, axis=-1)  # (R, K, L, D): slot of position k
    member = (first[..., :, None] == np.arange(positions)) & valid[..., :, None]
    is_slot = valid & (first == np.arange(positions))
    zero_fraction = np.where(member, fraction[..., :, None], 1.0).prod(axis=-2)
    zero_fraction = np.where(is_slot, zero_fraction, 1.0)
    leaf_value = np.where(leaf_valid, np.take_along_axis(np.asarray(trees.value, np.float32), order, axis=-1), 0.0)
    return PathTables(
        feature=np.maximum(feature, 0).astype(np.int32),
        threshold_bin=threshold_bin,
        default_left=default_left,
        goes_right=goes_right,
        member=member,
        is_slot=is_slot,
        zero_fraction=zero_fraction.astype(np.float32),
        n_slots=is_slot.sum(axis=-1).astype(np.int32),
        leaf_value=leaf_value.astype(np.float32),
    )


def expected_values(tables: PathTables) -> np.ndarray:
    """Each output's summed cover-weighted tree means, ``(K,)`` float64."""
    zero = np.asarray(tables.zero_fraction, np.float64)
    per_leaf = np.asarray(tables.leaf_value, np.float64) * zero.prod(axis=-1)
    return per_leaf.sum(axis=(0, 2))


def shapley_weights(positions: int) -> np.ndarray:
    """``W[M, k] = k! (M - k - 1)! / M!`` for ``k < M`` (0 otherwise), float32 ``(positions + 1, positions)``."""
    weights = np.zeros((positions + 1, positions), np.float64)
    for n_slots in range(1, positions + 1):
        for k in range(n_slots):
            weights[n_slots, k] = math.factorial(k) * math.factorial(n_slots - k - 1) / math.factorial(n_slots)
    return weights.astype(np.float32)


def _tree_contributions(tree: PathTables, X_binned, missing_bin: int, n_features: int, weights):
    """Contributions ``(n, n_features)`` of one tree (fields ``(L, D, ...)``) to each row.

    Per path slot the arrays are ``(n, L)``, one per polynomial coefficient, kept in Python
    lists over the static depth: plain elementwise work that the compiler fuses.
    """
    positions = tree.feature.shape[-1]
    codes = X_binned[:, tree.feature].astype(jnp.int32)  # (n, L, D)
    row_goes_right = jnp.where(codes == missing_bin, ~tree.default_left, codes > tree.threshold_bin)
    follows = [row_goes_right[..., k] == tree.goes_right[:, k] for k in range(positions)]
    # o_j: the row takes every branch of slot j's feature on this path (positions k >= j).
    one, zero = [], []
    for slot in range(positions):
        takes_all = tree.is_slot[:, slot]
        for k in range(slot, positions):
            takes_all = takes_all & (follows[k] | ~tree.member[:, k, slot])
        one.append(takes_all.astype(jnp.float32))
        zero.append(tree.zero_fraction[:, slot])
    # Coefficients of prod_j (z_j + o_j t) over the slots (padding slots are the factor 1).
    product = [jnp.ones_like(one[0])] + [jnp.zeros_like(one[0])] * positions
    for slot in range(positions):
        product = [product[0] * zero[slot]] + [product[c] * zero[slot] + product[c - 1] * one[slot]
                                                for c in range(1, positions + 1)]
    shapley = weights[tree.n_slots]  # (L, D): W[M, k] of each leaf
    # o_i = 0: the product without slot i is product / z_i, the same weighted sum for every i.
    weighted_product = sum(product[c] * shapley[:, c] for c in range(positions))
    per_slot = []
    for slot in range(positions):
        # o_i = 1: divide by (z_i + t) from the top coefficient down (stable: z_i <= 1).
        quotient = product[positions]
        weighted_one = quotient * shapley[:, positions - 1]
        for c in range(positions - 1, 0, -1):
            quotient = product[c] - zero[slot] * quotient
            weighted_one = weighted_one + quotient * shapley[:, c - 1]
        # A zero fraction of 0 with o_i = 0 gives o_i - z_i = 0: the division's value is unused.
        weighted_zero = weighted_product / jnp.where(zero[slot] > 0, zero[slot], 1.0)
        weighted = jnp.where(one[slot] > 0, weighted_one, weighted_zero)
        per_slot.append(jnp.where(tree.is_slot[:, slot], tree.leaf_value * (one[slot] - zero[slot]) * weighted, 0.0))
    to_feature = jax.nn.one_hot(tree.feature.T, n_features, dtype=jnp.float32).reshape(-1, n_features)  # (D*L, d)
    # HIGHEST: on a GPU a float32 product defaults to TF32, 1e-4 off the prediction it explains.
    return jnp.matmul(jnp.concatenate(per_slot, axis=1), to_feature, precision=lax.Precision.HIGHEST)


@partial(jax.jit, static_argnames=("missing_bin", "n_features", "chunk_rows"))
def contributions_binned(tables: PathTables, X_binned, weights, missing_bin: int, n_features: int,
                         chunk_rows: int):
    """Feature contributions ``(n, K, n_features)`` of all trees; ``n`` a multiple of ``chunk_rows``."""
    n_rows = X_binned.shape[0]
    chunks = X_binned.reshape(n_rows // chunk_rows, chunk_rows, X_binned.shape[1])
    num_outputs = tables.feature.shape[1]

    def one_chunk(rows):
        def add_round(total, round_tables):
            per_output = jax.vmap(lambda tree: _tree_contributions(tree, rows, missing_bin, n_features, weights),
                                  out_axes=1)(round_tables)
            return total + per_output, None

        start = jnp.zeros((chunk_rows, num_outputs, n_features), jnp.float32)
        return lax.scan(add_round, start, tables)[0]

    return lax.map(one_chunk, chunks).reshape(n_rows, num_outputs, n_features)


def chunk_size(n_rows: int, num_leaves: int, positions: int) -> int:
    """Rows per compiled chunk: a power of two keeping one chunk's tables near CHUNK_ELEMENTS."""
    largest = max(CHUNK_ELEMENTS // (num_leaves * positions * positions), 8)
    size = 8
    while size * 2 <= min(largest, max(n_rows, 8)):
        size *= 2
    return size


def tree_shap(trees, X_binned: np.ndarray, missing_bin: int, initial: np.ndarray) -> np.ndarray:
    """TreeSHAP values ``(n, K, n_features + 1)`` of heap trees (fields ``(R, K, nodes)``) on
    binned rows; the last column is ``initial`` (``(n, K)`` starting margins) plus the trees'
    expected value."""
    n_rows, n_features = X_binned.shape
    num_outputs = np.asarray(trees.is_leaf).shape[1]
    tables = path_tables(trees)
    bias = np.asarray(initial, np.float64) + expected_values(tables)[None, :]
    positions = tables.feature.shape[-1]
    chunk_rows = chunk_size(n_rows, tables.feature.shape[-2], positions)
    padded_rows = -(-n_rows // chunk_rows) * chunk_rows
    X_padded = np.zeros((padded_rows, n_features), X_binned.dtype)
    X_padded[:n_rows] = X_binned
    if tables.feature.shape[0] == 0:
        phi = np.zeros((n_rows, num_outputs, n_features), np.float32)
    else:
        phi = np.asarray(contributions_binned(tables, X_padded, shapley_weights(positions), missing_bin=missing_bin,
                                              n_features=n_features, chunk_rows=chunk_rows))[:n_rows]
    return np.concatenate([phi, bias[:, :, None].astype(np.float32)], axis=-1)
