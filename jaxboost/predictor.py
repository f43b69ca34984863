"""Predictor: tree arrays + ``X_binned`` -> raw predictions, compiled and vectorised over trees.

A row walks ``max_depth`` levels of the heap; once it reaches a leaf it stays there, so every
tree costs the same fixed number of gathers and there is no data-dependent branching. Trees of
all rounds are accumulated by ``lax.scan`` (one tree's ``(n, K)`` contribution in memory at a
time), outputs by ``vmap``.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from .native import ADD_POSITION_VALUES_TARGET, as_varying_as, lowering_platform, native_target, per_platform
from .tree import Tree, depth_of_heap


def packed_nodes(tree: Tree) -> jax.Array:
    """Everything a row needs about a node in one int32: feature, threshold bin, missing
    direction and leaf flag (``feature << 10 | threshold_bin << 2 | default_left << 1 | is_leaf``)."""
    return ((tree.feature << 10) | (tree.threshold_bin << 2) | (tree.default_left.astype(jnp.int32) << 1)
            | tree.is_leaf.astype(jnp.int32))


def leaf_index(tree: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Heap index of the leaf that each row of ``X_binned`` (n, d) uint8 reaches in one tree."""
    max_depth = depth_of_heap(tree.feature.shape[-1])
    n_rows = X_binned.shape[0]
    row_ids = jnp.arange(n_rows)
    # One gather per level reads everything a row needs about its node.
    packed = packed_nodes(tree)

    def descend(_, node):
        info = packed[node]
        code = X_binned[row_ids, info >> 10].astype(jnp.int32)
        default_right = (info & 2) == 0
        goes_right = jnp.where(code == missing_bin, default_right, code > ((info >> 2) & 255))
        return jnp.where((info & 1) == 1, node, 2 * node + 1 + goes_right.astype(jnp.int32))

    # On CPU the levels are a loop: unrolled, each level's gathers were a kernel of their own
    # (an eval set's walk was 118 of the trees' program's 760 KB of IR as emitted). Elsewhere a
    # loop's every step would wait on the host's test of its count.
    unroll = lowering_platform() != "cpu"
    return lax.fori_loop(0, max_depth, descend, jnp.zeros(n_rows, jnp.int32), unroll=unroll)


def predict_round(trees: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Raw contribution ``(n, K)`` of one round's K trees (``trees`` fields shaped ``(K, nodes)``)."""

    def one_output(tree):
        return tree.value[leaf_index(tree, X_binned, missing_bin)]

    return jax.vmap(one_output, out_axes=1)(trees)


def add_position_values(raw_prediction: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """A training round's update: ``raw_prediction`` ``(n, K)`` plus, for row ``i`` and output
    ``k``, ``values[k, positions[k, i]]`` (``values`` ``(K, P)``: each last-level position's
    leaf value; ``positions`` ``(K, n)`` int32). On CPU a native kernel, elsewhere a gather."""
    target = native_target(ADD_POSITION_VALUES_TARGET)

    def gathered(raw, table, at):
        return raw + jnp.take_along_axis(table, at, axis=1).T

    if target is None:
        return gathered(raw_prediction, values, positions)

    def native(raw, table, at):
        # The result aliases ``raw`` (each row is read, then written, by the same step), so with
        # the round's raw predictions donated the update is written in place: no row vector
        # for the result and no copy of it into the round's output.
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(raw.shape, jnp.float32), vmap_method="sequential",
                                input_output_aliases={0: 0})
        return as_varying_as(call(raw, table, at), (raw, table, at))

    # Chosen when lowering: the FFI target exists only on CPU.
    return per_platform(raw_prediction, values, positions.astype(jnp.int32), cpu=native, default=gathered)


def _predict_raw_local(trees: Tree, X_binned: jax.Array, initial: jax.Array, missing_bin: int) -> jax.Array:
    def add_round(raw_prediction, round_trees):
        return raw_prediction + predict_round(round_trees, X_binned, missing_bin), None

    raw_prediction, _ = lax.scan(add_round, initial, trees)
    return raw_prediction


@lru_cache(maxsize=16)
def _sharded_predictor(mesh: Mesh, missing_bin: int):
    rows = PartitionSpec(mesh.axis_names[0])
    return jax.jit(jax.shard_map(partial(_predict_raw_local, missing_bin=missing_bin), mesh=mesh,
                                 in_specs=(PartitionSpec(), rows, rows), out_specs=rows, check_vma=False))


def predict_raw_binned(trees: Tree, X_binned: jax.Array, initial: jax.Array, missing_bin: int,
                       mesh: Mesh) -> jax.Array:
    """``initial`` (n, K) plus the sum of all rounds' trees (fields shaped ``(rounds, K, nodes)``).

    Rows are split over the mesh's devices, each walking the trees for its own rows (letting
    the compiler partition the gathers instead was slower than one device).
    """
    return _sharded_predictor(mesh, missing_bin)(trees, X_binned, initial)


@partial(jax.jit, static_argnames="missing_bin")
def predict_leaf_binned(trees: Tree, X_binned: jax.Array, missing_bin: int) -> jax.Array:
    """Leaf heap index per row, round and output: ``(n, rounds, K)``."""
    per_tree = jax.vmap(jax.vmap(lambda tree: leaf_index(tree, X_binned, missing_bin)))(trees)
    return jnp.moveaxis(per_tree, -1, 0)
