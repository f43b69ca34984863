"""The record describing one built-in objective."""

from __future__ import annotations

from typing import Callable, NamedTuple


class BuiltinLoss(NamedTuple):
    """A built-in objective: the per-example loss and what the library needs to know about it."""

    name: str
    # function(raw_prediction, y, **params) -> scalar, for ONE example; the library gets
    # gradients and Hessians from it by autodiff.
    function: Callable
    # Inverse link used by predict: "identity", "sigmoid", "softmax", "exp",
    # "sigmoid_2x" (AdaBoost: sigmoid(2F)) or "step" (hinge: 1 if F > 0 else 0); for the
    # distributional losses a JAX function raw (n, K) -> parameters (n, K).
    link: str | Callable
    # check_labels(y: np.ndarray) -> None; raises ValueError naming the loss and the
    # offending value(s).
    check_labels: Callable
    # True when the Hessian is zero or undefined on a set of positive measure, so Newton
    # leaf values are meaningless: leaves are refit by exact 1-D minimisation instead.
    leaf_refit: bool
    # True for softmax: K raw outputs per row, labels 0..K-1.
    multiclass: bool
    # K raw outputs per row for a loss taking a length-K vector whose K is fixed by the loss
    # (the distributional losses: 2); None for scalar losses and for softmax, whose K comes
    # from the labels.
    num_outputs: int | None = None
    # quantile(params, level, **loss_params) -> quantiles of the predictive distribution,
    # from the parameters predict returns; None for losses that are not a likelihood.
    quantile: Callable | None = None
    # optimal_constant(y, sample_weight, num_outputs, **loss_params) -> (num_outputs,) float64:
    # the constant raw prediction minimising the weighted loss, in closed form on the host
    # (``_optimal_constants``); None: the library finds it numerically.
    optimal_constant: Callable | None = None
