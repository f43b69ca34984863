"""Sums over rows (or bins) that compile small on CPU, as accurate as XLA's own.

XLA's CPU compiler rewrites a sum over more than 32 elements into a chain of reduce-window
kernels, 32 elements a step (for accuracy), and generates machine code for every step afresh:
50-100 KB of LLVM IR a step, three steps for a device's rows. Those chains were most of what the
programs of a custom loss compile: the derivatives' program (two sums over rows, the round's
health marks: 263 of its 315 KB of IR) and the starting value's (the line search's derivative
sums: 385 of 500 KB).

``row_sum`` adds the rows 32 at a time as a matrix product (a ones vector times the rows laid out
as 32 rows of blocks), then adds those partial sums in a compensated (Neumaier) reduction: a
reduction of two operands, which the compiler does not rewrite, carrying each partial sum's
rounding error. The result is as accurate as the chain's (relative errors of 1-2e-8 on 100k to
1M uniform values; a plain one-pass sum of two operands had 2e-6 to 5e-6).

The product keeps the summed values in a loop of their own. A sum written as a reduction let
XLA fuse the values' computation into it, one row at a time: a loss's derivatives, which a
separate loop computes in vectors and over threads (a starting value's line search went from
5 to 25 ms at 100k rows).

``row_sums`` sums several arrays of the same rows: each keeps its own product (its values'
loop), and their partial sums share one compensated pass, the same sums bit for bit. Each pass
is a kernel that LLVM unrolls over its columns (47 KB of optimised IR for ten): with ten
classes, softmax's starting value went from 941 to 808 KB and its derivatives' program from 465
to 376 KB.

Other backends get ``jnp.sum``: the rewrite is the CPU compiler's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .native import per_platform

# Rows summed together before the compensated pass.
BLOCK_ROWS = 32


def _neumaier_merge(left, right):
    """Two (sum, compensation) pairs as one: the pair's sum, and its rounding error added to
    the compensations."""
    (sum_left, error_left), (sum_right, error_right) = left, right
    added = sum_left + sum_right
    rounding = jnp.where(jnp.abs(sum_left) >= jnp.abs(sum_right), (sum_left - added) + sum_right,
                         (sum_right - added) + sum_left)
    return added, error_left + error_right + rounding


def _block_partials(values: jax.Array) -> jax.Array:
    """The sums of ``values``' rows 32 at a time (as one matrix product), ``(blocks, ...)``."""
    n_rows = values.shape[0]
    padded_rows = -(-n_rows // BLOCK_ROWS) * BLOCK_ROWS
    if padded_rows != n_rows:
        values = jnp.pad(values, [(0, padded_rows - n_rows)] + [(0, 0)] * (values.ndim - 1))
    # Row i * blocks + j of the values is element (i, j) here: each column sums 32 rows.
    blocks = values.reshape((BLOCK_ROWS, -1))
    # Two rows of ones, not one: XLA's CPU compiler calls Eigen for a product of matrices but
    # generates code of its own for a matrix times a vector, which LLVM took 35-45 ms to compile
    # each (seven in softmax's starting value: a quarter of its code generation). Eigen sums the
    # 32 rows in the same order, and as fast.
    partial = jnp.matmul(jnp.ones((2, BLOCK_ROWS), values.dtype), blocks, precision=jax.lax.Precision.HIGHEST)[0]
    return partial.reshape((padded_rows // BLOCK_ROWS,) + values.shape[1:])


def _compensated_sum(partial: jax.Array) -> jax.Array:
    """The Neumaier sum of ``partial`` over its leading axis."""
    zero = jnp.zeros((), partial.dtype)
    added, error = jax.lax.reduce((partial, jnp.zeros_like(partial)), (zero, zero), _neumaier_merge, (0,))
    # An infinite sum leaves a NaN error (inf - inf): the sum is that infinity, as a plain one's.
    return jnp.where(jnp.isfinite(added), added + error, added)


def _blocked_sums(*arrays: jax.Array) -> tuple:
    """The blocked sum of each array (the same rows), their partial sums side by side in one
    compensated pass: each pass is a kernel of its own, unrolled over its columns."""
    partials = [_block_partials(values) for values in arrays]
    total = _compensated_sum(jnp.concatenate([partial.reshape(partial.shape[0], -1) for partial in partials], axis=1))
    ends = np.cumsum([math.prod(values.shape[1:]) for values in arrays])[:-1]
    return tuple(part.reshape(values.shape[1:]) for part, values in zip(jnp.split(total, ends), arrays))


def row_sum(values: jax.Array) -> jax.Array:
    """``jnp.sum(values, axis=0)`` for an array of rows ``(n, ...)``; on CPU 32 rows at a time,
    then a compensated sum of those (see the module's docstring)."""
    return row_sums(values)[0]


def row_sums(*arrays: jax.Array) -> tuple:
    """``row_sum`` of each array of rows (all with the same rows and dtype), the same sums as
    each alone; on CPU their compensated passes are one."""
    if arrays[0].shape[0] <= BLOCK_ROWS:
        return _plain_sums(*arrays)
    return per_platform(*arrays, cpu=_blocked_sums, default=_plain_sums)


def _plain_sums(*arrays: jax.Array) -> tuple:
    return tuple(jnp.sum(values, axis=0) for values in arrays)
