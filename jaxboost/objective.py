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
from .boosting import Objective
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


def _builtin_record(loss) -> losses.BuiltinLoss | None:
    if isinstance(loss, str):
        return losses.get(loss)
    function = loss.func if isinstance(loss, functools.partial) else loss
    return next((record for record in losses.BUILTINS.values() if record.function is function), None)


def _loss_name(loss) -> str:
    function = loss.func if isinstance(loss, functools.partial) else loss
    return getattr(function, "__name__", type(function).__name__)


def resolve_loss(loss, labels: np.ndarray, num_outputs: int | None, link) -> ResolvedLoss:
    """Resolve ``loss`` for the given training labels (which also fix K for softmax)."""
    record = _builtin_record(loss)
    if record is None and not callable(loss):
        raise TypeError(f"loss must be a built-in name ({sorted(losses.BUILTINS)}) or a callable "
                        f"loss(raw_prediction, y) -> scalar; got {loss!r}")
    function = loss if callable(loss) else record.function
    if record is not None:
        record.check_labels(labels)
        if record.multiclass:
            inferred = int(labels.max()) + 1
            if num_outputs is not None and num_outputs < inferred:
                raise ValueError(f"num_outputs={num_outputs} but the labels go up to class {inferred - 1}")
            num_outputs = max(num_outputs or inferred, 2)
        link_function = resolve_link(record.link if link is None else link)
        objective = Objective(function, record.multiclass, num_outputs or 1, link_function)
        return ResolvedLoss(objective, record.name, np.int32 if record.multiclass else np.float32,
                            record.leaf_refit, record.check_labels)
    link_function = resolve_link("identity" if link is None else link)
    objective = Objective(function, num_outputs is not None, num_outputs or 1, link_function)
    return ResolvedLoss(objective, _loss_name(loss), np.float32, None, lambda y: None)


class EvalMetric(NamedTuple):
    """A metric evaluated on raw predictions: the link is applied first (hashable, so the
    compiled round is reused across training runs)."""

    name: str
    function: Callable | None  # metric(y, y_pred, weight); None: the training loss itself
    objective: Objective

    def __call__(self, y, raw_prediction, weight):
        objective = self.objective
        if self.function is None:
            values = jax.vmap(objective.loss)(raw_prediction if objective.vector_output else raw_prediction[:, 0], y)
            counted = weight > 0
            return jnp.sum(jnp.where(counted, weight * values, 0.0)) / jnp.sum(jnp.where(counted, weight, 0.0))
        y_pred = objective.link(raw_prediction)
        return self.function(y, y_pred if objective.vector_output else y_pred[:, 0], weight)


def resolve_metrics(eval_metric, resolved: ResolvedLoss) -> tuple[EvalMetric, ...]:
    """Eval metrics by name (``"loss"``, XGBoost names) or callables ``f(y, y_pred, weight)``."""
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
    return tuple(chosen)


def higher_is_better(metric: EvalMetric) -> bool:
    known = metrics.METRICS.get(metric.name)
    return metric.function is not None and known is not None and known.higher_is_better
