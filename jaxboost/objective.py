"""Objective: what ``loss=`` means, resolved once per training run.

A built-in name (or a built-in function, possibly with parameters bound by
``functools.partial``) brings its link, its label check and whether its leaves are refit; any
other callable ``loss(raw_prediction, y) -> scalar`` is a custom loss with the identity link
unless ``link=`` says otherwise. Also the eval metrics, which are computed on device from raw
predictions.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import losses, metrics
from .boosting import Objective, bind_loss
from .link import resolve_link

# XGBoost's default eval metric per objective; other losses report their own mean value.
DEFAULT_METRIC = {"squared_error": "rmse", "absolute_error": "mae", "logistic": "logloss", "softmax": "mlogloss"}
LOSS_METRIC = "loss"


class ResolvedLoss(NamedTuple):
    objective: Objective
    name: str
    label_dtype: type
    leaf_refit: bool | None  # None: decide from the first round's Hessians (custom losses)
    check_labels: Callable[[np.ndarray], None]
    loss_params: dict  # traced keyword arguments of the loss: one compiled program serves all values
    # The built-in's closed-form best constant (``losses.BuiltinLoss.optimal_constant``); None:
    # found numerically (``boosting.starting_value``).
    optimal_constant: Callable | None = None


def _builtin_record(loss) -> losses.BuiltinLoss | None:
    if isinstance(loss, str):
        return losses.get(loss)
    function = loss.func if isinstance(loss, functools.partial) else loss
    return next((record for record in losses.BUILTINS.values() if record.function is function), None)


def _loss_name(loss) -> str:
    function = loss.func if isinstance(loss, functools.partial) else loss
    return getattr(function, "__name__", type(function).__name__)


def _split_parameters(loss, loss_params) -> tuple[Callable | None, dict]:
    """The loss function without its keyword parameters, and those parameters as traced values.

    Keywords bound by ``functools.partial`` join ``loss_params``, so that a new ``tau`` or
    ``delta`` reuses the compiled round instead of defining a new function.
    """
    loss_params = dict(loss_params or {})
    function = loss
    if isinstance(loss, functools.partial) and not loss.args:
        overlap = sorted(set(loss.keywords) & set(loss_params))
        if overlap:
            raise ValueError(f"loss parameter(s) {overlap} are given both in functools.partial and loss_params")
        loss_params = {**loss.keywords, **loss_params}
        function = loss.func
    return function, loss_params


def _check_loss_parameters(function: Callable, loss_params: dict, vector_output: bool, num_outputs: int, y0) -> dict:
    """Call the loss once on the host with concrete parameters, so its own parameter checks
    (e.g. ``0 < tau < 1``) run before training; returns the parameters as float32 arrays."""
    if not loss_params:
        return {}
    try:
        traced = jax.tree_util.tree_map(lambda value: jnp.asarray(value, jnp.float32), loss_params)
    except (TypeError, ValueError) as error:
        raise TypeError(f"loss_params must be a dict of numbers or numeric arrays: {error}") from None
    concrete = {name: (float(value) if np.ndim(value) == 0 and not isinstance(value, dict) else value)
                for name, value in loss_params.items()}
    raw = jnp.zeros(num_outputs, jnp.float32) if vector_output else jnp.float32(0)
    try:
        function(raw, jnp.asarray(y0), **concrete)
    except TypeError as error:
        raise TypeError(f"the loss does not accept loss_params {sorted(loss_params)}: {error}") from None
    return traced


def resolve_loss(loss, labels: np.ndarray, num_outputs: int | None, link, loss_params: dict | None = None
                 ) -> ResolvedLoss:
    """Resolve ``loss`` for the given training labels (which also fix K for softmax)."""
    record = _builtin_record(loss)
    if record is None and not callable(loss):
        raise TypeError(f"loss must be a built-in name ({sorted(losses.BUILTINS)}) or a callable "
                        f"loss(raw_prediction, y) -> scalar; got {loss!r}")
    function, loss_params = _split_parameters(loss if callable(loss) else record.function, loss_params)
    if record is not None:
        record.check_labels(labels)
        vector_output = record.multiclass or getattr(record, "num_outputs", None) is not None
        if record.multiclass:
            inferred = int(labels.max()) + 1
            if num_outputs is not None and num_outputs < inferred:
                raise ValueError(f"num_outputs={num_outputs} but the labels go up to class {inferred - 1}")
            num_outputs = max(num_outputs or inferred, 2)
        elif vector_output:
            if num_outputs is not None and num_outputs != record.num_outputs:
                raise ValueError(f"loss {record.name!r} has {record.num_outputs} outputs; got num_outputs={num_outputs}")
            num_outputs = record.num_outputs
        link_function = resolve_link(record.link if link is None else link)
        objective = Objective(function, vector_output, num_outputs or 1, link_function)
        traced = _check_loss_parameters(function, loss_params, vector_output, objective.num_outputs,
                                        labels[0].astype(np.int32 if record.multiclass else np.float32))
        return ResolvedLoss(objective, record.name, np.int32 if record.multiclass else np.float32,
                            record.leaf_refit, record.check_labels, traced, record.optimal_constant)
    link_function = resolve_link("identity" if link is None else link)
    objective = Objective(function, num_outputs is not None, num_outputs or 1, link_function)
    traced = _check_loss_parameters(function, loss_params, objective.vector_output, objective.num_outputs,
                                    labels[0])
    return ResolvedLoss(objective, _loss_name(loss), np.float32, None, lambda y: None, traced)


class EvalMetric(NamedTuple):
    """A metric evaluated on raw predictions: the link is applied first (hashable, so the
    compiled round is reused across training runs)."""

    name: str
    function: Callable | None  # metric(y, y_pred, weight); None: the training loss itself
    objective: Objective

    def __call__(self, y, raw_prediction, weight, loss_params=None):
        objective = self.objective
        if self.function is None:
            loss = bind_loss(objective, loss_params)
            values = jax.vmap(loss)(raw_prediction if objective.vector_output else raw_prediction[:, 0], y)
            return metrics.weighted_mean(values, weight)
        y_pred = objective.link(raw_prediction)
        return self.function(y, y_pred if objective.vector_output else y_pred[:, 0], weight)


def resolve_metrics(eval_metric, resolved: ResolvedLoss, label_shapes=()) -> tuple[EvalMetric, ...]:
    """Eval metrics by name (``"loss"``, XGBoost names) or callables ``f(y, y_pred, weight)``;
    ``label_shapes``: the eval sets' labels' shapes, which each metric must be able to score
    the loss's predictions against (``check_metric``)."""
    if eval_metric is None:
        eval_metric = [DEFAULT_METRIC.get(resolved.name, LOSS_METRIC)]
    elif isinstance(eval_metric, str) or callable(eval_metric):
        eval_metric = [eval_metric]
    chosen = []
    for entry in eval_metric:
        if entry == LOSS_METRIC:
            chosen.append(EvalMetric(LOSS_METRIC, None, resolved.objective))
        else:
            metric = metrics.get_metric(entry)
            chosen.append(EvalMetric(metric.name, metric.function, resolved.objective))
    for metric in chosen:
        for shape in label_shapes:
            check_metric(metric, tuple(shape[1:]), np.dtype(resolved.label_dtype).name, resolved.name)
    return tuple(chosen)


@functools.lru_cache(maxsize=256)
def check_metric(metric: EvalMetric, label_tail: tuple, label_dtype: str, loss_name: str) -> None:
    """Raises a ValueError naming ``metric`` where it cannot score the loss's predictions
    against labels of shape ``(n,) + label_tail`` (a metric of one output given a loss of
    several, say), before anything is compiled: the metric is traced on shapes alone, once."""
    if metric.function is None:  # the loss itself: the labels were checked against it
        return
    rows, K = 64, metric.objective.num_outputs
    try:
        jax.eval_shape(lambda y, raw_prediction, weight: metric(y, raw_prediction, weight),
                       jax.ShapeDtypeStruct((rows,) + label_tail, label_dtype),
                       jax.ShapeDtypeStruct((rows, K), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    except (TypeError, ValueError, IndexError) as error:
        labels = "one label" if not label_tail else f"labels of shape {label_tail}"
        raise ValueError(f"eval metric {metric.name!r} cannot score loss {loss_name!r}, which predicts {K} "
                         f"output(s) a row, against {labels} a row: {error}") from None


def higher_is_better(metric: EvalMetric) -> bool:
    known = metrics.METRICS.get(metric.name)
    return metric.function is not None and known is not None and known.higher_is_better
