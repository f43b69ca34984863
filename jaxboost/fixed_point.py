"""Order-independent sums: float32 values added as whole-number pieces.

A GPU's scatter adds its rows with atomic adds in whatever order its threads reach them, and
float addition is not associative, so two runs of one program may differ in a sum's last bits
and, through near ties, in a split. Sums of whole numbers are exact as long as no partial sum
leaves the range where they are exact (2**24 in float32, 2**31 in int32), and then they are the
same in every order. Each value ``v`` is written as ``pieces`` whole numbers of ``bits`` bits
relative to a power of two ``scale`` taken from the largest magnitude summed,
``v * scale ~ p0 + p1 / 2**bits + p2 / 2**(2 bits) + ...``, each ``|p| <= 2**(bits - 1)``, with
``bits`` chosen from the most terms one sum can take so that no sum leaves its exact range.
Converting the summed pieces back to float32 rounds the same way every time.

Two uses: the accelerators' histogram kernel adds float32 pieces (on a GPU float32 channels
cost less than int32 ones, presumably vector float atomics: 3.45 against 4.59 ms a tree on an
H100, ``experiments/results/gpu_level_copies.md``) into copies that each get a share of the
rows, and folds the copies in int32; leaf refits' segment sums add two int32 pieces.
A value is rounded by at most ``2 max|v| 2**-(pieces * bits)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Float32 holds every whole number up to 2**24, so sums of whole numbers that stay there are
# exact; int32 sums are kept to 2**30.
FLOAT_EXACT_BITS = 24
INT_EXACT_BITS = 30
# Bits of a value the histogram's pieces keep together (float32's own precision).
TARGET_BITS = 24
# More bits a piece than a value needs are not used.
MAX_PIECE_BITS = 15
# Fewer bits would round values by more than 2**-8 of the largest one (two int32 pieces), or
# need more than 12 float32 pieces.
MIN_INT_PIECE_BITS = 4
MIN_FLOAT_PIECE_BITS = 2
# The scale's exponent stays where the scale and the pieces' units are normal float32 numbers;
# magnitudes below 2**-100 count as zero.
_EXPONENT_RANGE = (-100, 100)


def power_of_two(exponent) -> jax.Array:
    """float32 ``2**exponent`` (exact) for an int32 exponent, traced or not, in [-126, 127]."""
    biased = jnp.asarray(exponent, jnp.int32) + 127
    return lax.bitcast_convert_type(biased << 23, jnp.float32)


def ceil_log2(count) -> jax.Array:
    """int32 ``ceil(log2(count))`` (0 for 1) of a traced positive int32 count."""
    count = jnp.maximum(jnp.asarray(count, jnp.int32), 1)
    return (32 - lax.clz(count - 1)).astype(jnp.int32)


def _folded_bits(n_terms: int) -> int:
    """Bits a piece within ``MAX_PIECE_BITS`` such that ``n_terms`` pieces sum within int32's bound."""
    return min(INT_EXACT_BITS + 1 - math.ceil(math.log2(max(n_terms, 2))), MAX_PIECE_BITS)


def int_piece_bits(n_terms: int) -> int:
    """Bits of each int32 piece for sums of ``n_terms`` values: ``n_terms`` pieces of magnitude
    at most ``2**(bits - 1)`` sum to at most ``2**30``."""
    bits = _folded_bits(n_terms)
    if bits < MIN_INT_PIECE_BITS:
        raise ValueError(f"order-independent sums take at most {2 ** (INT_EXACT_BITS + 1 - MIN_INT_PIECE_BITS)} "
                         f"terms a sum; got {n_terms}")
    return bits


def float_piece_bits(most_terms, n_terms: int) -> jax.Array:
    """int32 bits of each float32 piece when one float32 sum takes at most ``most_terms`` terms
    (traced) and the int32 sums that fold those together at most ``n_terms``: the float32 sums
    stay within ``2**24`` and the int32 ones within ``2**30`` (``float_pieces_needed`` checks
    that the fewest bits are enough)."""
    return jnp.minimum(FLOAT_EXACT_BITS + 1 - ceil_log2(most_terms), _folded_bits(n_terms))


def float_pieces_needed(most_terms: int, n_terms: int) -> int:
    """The even number of float32 pieces (cells of a multiple of four float32 channels, as measured) that
    keep ``TARGET_BITS`` of a value when one float32 sum takes up to ``most_terms`` terms (the
    fewest bits ``float_piece_bits`` gives for at most that many)."""
    bits = min(FLOAT_EXACT_BITS + 1 - math.ceil(math.log2(max(most_terms, 1))), _folded_bits(n_terms))
    if bits < MIN_FLOAT_PIECE_BITS:
        raise ValueError(f"order-independent histograms take at most {2 ** (FLOAT_EXACT_BITS - 1)} rows a copy "
                         f"of a node's histogram; got {most_terms} (use fewer rows a device or a shallower tree)")
    pieces = -(-TARGET_BITS // bits)
    return pieces + pieces % 2


def fixed_point_scale(magnitude: jax.Array, bits) -> jax.Array:
    """The float32 power of two that maps ``[-magnitude, magnitude]`` into ``[-2**(bits - 1),
    2**(bits - 1)]`` (a power of two, so multiplying by it is exact)."""
    _, exponent = jnp.frexp(jnp.asarray(magnitude, jnp.float32))  # magnitude < 2**exponent
    return power_of_two(jnp.asarray(bits, jnp.int32) - 1 - jnp.clip(exponent, *_EXPONENT_RANGE))


def magnitude_scale(values: jax.Array, bits, counted: jax.Array | None = None) -> jax.Array:
    """``fixed_point_scale`` of the largest ``|values|`` (of the ``counted`` rows only, when
    given: the others are not summed)."""
    magnitudes = jnp.abs(values)
    if counted is not None:
        magnitudes = jnp.where(counted, magnitudes, 0.0)
    return fixed_point_scale(jnp.max(magnitudes), bits)


def to_pieces(values: jax.Array, scale: jax.Array, bits, pieces: int) -> list[jax.Array]:
    """``pieces`` float32 whole numbers ``p_j``, each in ``[-2**(bits - 1), 2**(bits - 1)]``, with
    ``values * scale ~ sum_j p_j 2**(-j bits)`` (for ``|values| * scale <= 2**(bits - 1)``)."""
    rest = values.astype(jnp.float32) * scale
    unit = power_of_two(bits)
    result = []
    for _ in range(pieces):
        piece = jnp.round(rest)
        result.append(piece)
        # Exact: rest - piece is rest's low bits, and times a power of two.
        rest = (rest - piece) * unit
    return result


def from_pieces(piece_sums: list[jax.Array], scale: jax.Array, bits) -> jax.Array:
    """float32 value of the summed pieces (one rounding per piece, the same in every run)."""
    unit = power_of_two(-jnp.asarray(bits, jnp.int32))
    value = piece_sums[-1].astype(jnp.float32)
    for piece_sum in reversed(piece_sums[:-1]):  # the smallest pieces first
        value = value * unit + piece_sum.astype(jnp.float32)
    return value / scale


def fixed_point_segment_sum(values: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``jax.ops.segment_sum`` of float32 ``values`` (rows on the first axis) whose result does not
    depend on the order in which the rows are added: two int32 pieces a value. Ids outside
    ``[0, num_segments)`` are dropped."""
    bits = int_piece_bits(values.shape[0])
    scale = magnitude_scale(values, bits)
    pieces = [piece.astype(jnp.int32) for piece in to_pieces(values, scale, bits, 2)]
    sums = jax.ops.segment_sum(jnp.stack(pieces, axis=-1), segment_ids, num_segments)
    return from_pieces([sums[..., 0], sums[..., 1]], scale, bits)
