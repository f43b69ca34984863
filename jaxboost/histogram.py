"""Histograms: per (node, feature, bin) sums of gradients and Hessians.

The kernel builds the histogram of the rows at hand (one device's shard); the caller sums it
over the row axis (``lax.psum`` when rows are sharded over devices), so the multi-core and
multi-device paths are a wrapper around this function rather than a rewrite.

On CPU, XLA runs one scatter on one core and a flat scatter over ``n * d`` indices spills out of
cache; a scatter per feature into a small ``(nodes * bins)`` target (``lax.map`` over features)
is about twice as fast, and carrying ``(g, h)`` as one complex64 value halves the scatters
(measurements in the project's kernel notes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def build_histogram(X_binned_T: jax.Array, node_index: jax.Array, gradients: jax.Array,
                    hessians: jax.Array, num_nodes: int, max_bin: int) -> jax.Array:
    """Histogram of the local rows.

    Args:
      X_binned_T: uint8 ``(n_features, n_rows)``, feature-major so each feature's codes are
        contiguous.
      node_index: int32 ``(n_rows,)`` in ``[0, num_nodes)``; rows that belong to no node being
        built must carry zero gradient and Hessian (their index is then irrelevant).
      gradients, hessians: float32 ``(n_rows,)``.
      num_nodes, max_bin: static sizes.

    Returns:
      float32 ``(num_nodes, n_features, max_bin, 2)``: ``[..., 0]`` sums of gradients,
      ``[..., 1]`` sums of Hessians.
    """
    n_features = X_binned_T.shape[0]
    packed = lax.complex(gradients.astype(jnp.float32), hessians.astype(jnp.float32))
    node_offset = node_index.astype(jnp.int32) * max_bin

    def one_feature(codes):
        return jax.ops.segment_sum(packed, node_offset + codes.astype(jnp.int32),
                                   num_segments=num_nodes * max_bin, indices_are_sorted=False)

    per_feature = lax.map(one_feature, X_binned_T)  # (d, nodes * bins) complex64
    per_feature = per_feature.reshape(n_features, num_nodes, max_bin).transpose(1, 0, 2)
    return jnp.stack([per_feature.real, per_feature.imag], axis=-1)
