"""Per-round gradients and Hessian diagonals of a per-example loss, by autodiff.

The loss is ``loss(raw_prediction, y) -> scalar`` for ONE example, the optax convention;
``raw_prediction`` is a scalar for single-output losses and a length-K vector otherwise. The
gradient comes from ``jax.grad`` and the Hessian diagonal from forward-over-reverse
(``jax.jvp`` of the gradient), both in one pass (the whole K x K matrix for vector leaves);
rows are batched with ``jax.vmap``, as the last axis of a loss of several outputs
(``over_rows``). Nobody writes a derivative by hand. A loss's trace alone
tells whether its Hessian is zero everywhere (``hessian_vanishes``: a piecewise-linear loss,
whose leaves are refit).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp


def over_rows(function: Callable, raw_prediction: jax.Array, y: jax.Array):
    """``jax.vmap(function)(raw_prediction, y)``: ``function`` of one example, mapped over rows.

    A vector raw prediction ``(n, K)`` is mapped with the rows as its last axis, and so is
    every value computed from it: XLA's CPU loops then run over the rows innermost, where LLVM
    vectorises an expression once, rather than over the K outputs of a row, which it unrolls
    (softmax's exponentials at 10 classes: 92-97 KB of LLVM IR a loop, 24 KB this way). The
    transposed raw predictions are a copy that XLA keeps: without the optimisation barrier its
    simplifier moved the transpose out of the way again, and the rows' loops with it. The
    results come back with the rows first. In this layout XLA stores more ``(K, n)`` values
    (a softmax's exponentials), so callers map a chunk of rows at a time (``in_row_chunks``)."""
    if raw_prediction.ndim == 1:
        return jax.vmap(function)(raw_prediction, y)
    raw_by_output = jax.lax.optimization_barrier(raw_prediction.T)
    results = jax.vmap(function, in_axes=(1, 0), out_axes=-1)(raw_by_output, y)
    return jax.tree_util.tree_map(lambda result: jnp.moveaxis(result, -1, 0), results)


def _example_value_gradient_and_hessian(loss: Callable, raw_prediction: jax.Array, y: jax.Array,
                                        full: bool = False):
    def value_and_gradient(f):
        return jax.value_and_grad(loss)(f, y)

    if raw_prediction.ndim == 0:
        (value, g), (_, h) = jax.jvp(value_and_gradient, (raw_prediction,), (jnp.ones_like(raw_prediction),))
        return value, g, h

    # One Hessian-vector product per output: the columns of the Hessian.
    basis = jnp.eye(raw_prediction.shape[0], dtype=raw_prediction.dtype)
    (value, g), (_, hessian_columns) = jax.vmap(lambda e: jax.jvp(value_and_gradient, (raw_prediction,), (e,)))(basis)
    return value[0], g[0], hessian_columns if full else jnp.diagonal(hessian_columns)


def values_gradients_and_hessians(loss: Callable, raw_prediction: jax.Array, y: jax.Array):
    """Row-wise ``(loss value, g, h)`` of ``loss`` at ``raw_prediction``.

    Args:
      loss: per-example loss.
      raw_prediction: ``(n,)`` for single-output losses or ``(n, K)``.
      y: ``(n,)`` labels.

    Returns:
      values ``(n,)``, and ``(g, h)`` shaped like ``raw_prediction``; ``h`` is the Hessian
      diagonal.
    """
    return over_rows(lambda f, label: _example_value_gradient_and_hessian(loss, f, label), raw_prediction, y)


def values_gradients_and_hessian_matrices(loss: Callable, raw_prediction: jax.Array, y: jax.Array,
                                          pack: Callable | None = None):
    """Row-wise loss values ``(n,)``, gradients ``(n, K)`` and full Hessians ``(n, K, K)`` of a
    vector loss (vector leaves solve with the whole matrix, not just its diagonal); with
    ``pack``, each row's Hessian mapped by it (one ``(K, K)`` matrix to a vector, while the rows
    are still the last axis, where its slices are whole rows)."""
    def example(f, label):
        value, g, hessian = _example_value_gradient_and_hessian(loss, f, label, full=True)
        return value, g, hessian if pack is None else pack(hessian)

    return over_rows(example, raw_prediction, y)


def gradients_and_hessians(loss: Callable, raw_prediction: jax.Array, y: jax.Array):
    """Row-wise ``(g, h)``, as :func:`values_gradients_and_hessians` without the values."""
    _, g, h = values_gradients_and_hessians(loss, raw_prediction, y)
    return g, h


def output_gradient(loss: Callable, raw_prediction: jax.Array, y: jax.Array, output: int | None) -> jax.Array:
    """Row-wise ``d loss / d raw_prediction[output]`` (the whole gradient when ``output`` is None)."""
    g = jax.vmap(jax.grad(loss))(raw_prediction, y)
    return g if output is None else g[:, output]


def hessian_vanishes(loss: Callable, y_example: jax.ShapeDtypeStruct, loss_params: dict | None = None,
                     num_outputs: int | None = None) -> bool:
    """Whether autodiff's Hessian of ``loss`` is zero at every raw prediction, as tracing alone
    shows: for a piecewise-linear loss (absolute error, hinge, quantile, several quantiles at
    once) its branches' second derivatives vanish symbolically, and the Hessian's jaxpr is the
    literal 0 (for several outputs, that literal broadcast to the K x K matrix). False where
    some input may make it nonzero (Huber's quadratic middle). The answer is kept per loss and
    shapes: the trace took 15-70 ms, a fit's worth on small data.

    Args:
      loss: per-example loss ``loss(raw_prediction, y, **loss_params)``.
      y_example: one example's label: its shape and dtype.
      loss_params: the loss's keyword parameters (traced, so only their shapes matter).
      num_outputs: the raw prediction's length K for a loss of a vector (None: a scalar).
    """
    leaves, structure = jax.tree_util.tree_flatten(dict(loss_params or {}))
    leaf_specs = tuple((jnp.shape(leaf), jnp.result_type(leaf).name) for leaf in leaves)
    raw_shape = () if num_outputs is None else (num_outputs,)
    return _hessian_is_literal_zero(loss, raw_shape, tuple(y_example.shape), jnp.dtype(y_example.dtype).name,
                                    structure, leaf_specs)


# Primitives that only place their one operand's values: a literal 0 stays 0 through them.
_PLACING_PRIMITIVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                                 "convert_element_type", "copy"})


@functools.lru_cache(maxsize=64)
def _hessian_is_literal_zero(loss: Callable, raw_shape: tuple, y_shape: tuple, y_dtype: str, params_structure,
                             leaf_specs: tuple) -> bool:
    def hessian(raw_prediction, y, loss_params):
        return _example_value_gradient_and_hessian(lambda f, label: loss(f, label, **loss_params), raw_prediction,
                                                   y, full=True)[2]

    params = jax.tree_util.tree_unflatten(params_structure,
                                          [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaf_specs])
    traced = jax.make_jaxpr(hessian)(jax.ShapeDtypeStruct(raw_shape, jnp.float32),
                                     jax.ShapeDtypeStruct(y_shape, y_dtype), params)
    producer = {id(var): equation for equation in traced.jaxpr.eqns for var in equation.outvars}
    (value,) = traced.jaxpr.outvars
    while not isinstance(value, jax.extend.core.Literal) and id(value) in producer:
        equation = producer[id(value)]
        if equation.primitive.name not in _PLACING_PRIMITIVES:
            return False
        value = equation.invars[0]
    return isinstance(value, jax.extend.core.Literal) and bool(value.val == 0)
