"""Closed forms of the best constant raw prediction, for the built-ins that have one.

Boosting starts from the constant that minimises the weighted training loss. For any loss the
library finds it numerically (exact 1-D minimisation; Newton steps for several outputs), a
program of its own to trace and compile in every new shape's first fit: 1.3 s of XLA time for
softmax's 10 classes on 2 cores, 0.4 s for a quantile's bisection. Where the minimiser has a
closed form, the record's ``optimal_constant`` gives it from the labels and weights on the host,
in float64, with no program at all. The Student t likelihood has no closed form, but its two
parameters are minimised here too, by Newton steps over the labels on the host (``student_t``):
its program (Newton steps whose derivatives traced the Fisher curvature's correction) had been
1.0 s of a first fit's 3.0 s compile at 100k rows, and 0.8 s of every fit at 640k. Each one
here is checked against the numerical minimiser on the same data (``tests/test_line_search.py``).

Signature: ``optimal_constant(y, sample_weight, num_outputs, **loss_params) -> (num_outputs,)
float64``, for rows whose weights sum to more than zero; ``loss_params`` are the loss's keyword
parameters as host numbers, its defaults included. Only the quantile's (``tau``) moves its
constant: Tweedie's power and the negative binomial's alpha do not.

Where no minimiser exists, the constant stops where float32 can follow it:

- a mean of 0 on a log scale (all labels 0 for Poisson, or all of one class for logistic):
  ``log`` of float32's smallest normal number, -87.3, where the numerical minimisation also
  stops;
- labels without spread for the Gaussian likelihoods: a standard deviation of float32's
  resolution at the mean's scale (``eps * max(|mean|, 1)``), where the
  numerical minimisation ran off to ``1e19`` (the trees' Hessians would then overflow).
"""

from __future__ import annotations

import math

import numpy as np

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_RESOLUTION = float(np.finfo(np.float32).eps)


def _weighted_total(weights: np.ndarray, values: np.ndarray) -> float:
    """The sum of ``weights * values`` over rows, in NumPy's own loop: ``np.dot`` of long
    vectors hands them to the BLAS threads, which then spin on the cores for a while after it
    returns (about 0.1 s of CPU time in each 100-round fit of 40k rows, of 0.6-0.8 s, that the
    round's kernels could have had; ``experiments/results/profile_round_cpu.md``)."""
    return float(np.einsum("i,i->", weights, values))


def _weighted_mean(values: np.ndarray, sample_weight: np.ndarray) -> float:
    weights = np.asarray(sample_weight, np.float64)
    return _weighted_total(weights, np.asarray(values, np.float64).ravel()) / float(weights.sum())


def _clamped_log(value):
    return np.log(np.maximum(value, _FLOAT32_TINY))


def _output(value, num_outputs: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, np.float64), (num_outputs,)).copy()


def mean(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Squared error: the weighted mean."""
    return _output(_weighted_mean(y, sample_weight), num_outputs)


def weighted_quantile(y, sample_weight, num_outputs: int, *, tau, **_) -> np.ndarray:
    """Pinball loss: the weighted ``tau``-quantile, the smallest label whose rows at or below it
    carry at least ``tau`` of the weight; where they carry exactly ``tau`` of it, every point up
    to the next label minimises, and the midpoint is taken (unit weights, ``tau`` 0.5 and an even
    count: the usual median). Rows of equal weight (no weights given) take a selection, the
    others a sort: at 800k rows 14 ms and 72 ms a fit (a stable sort had taken 155 ms; the
    numerical bisection takes 24-31 ms, but is a program of its own to compile)."""
    weights = np.asarray(sample_weight).ravel()
    kept = weights > 0
    values, weights = np.asarray(y).ravel()[kept], weights[kept]
    if np.all(weights == weights[0]):
        # The k-th smallest (0-based) is the first whose k + 1 rows reach tau of the count.
        target = float(tau) * values.size
        k = max(math.ceil(target) - 1, 0)
        tie = k + 1 == target and k + 1 < values.size
        selected = np.partition(values, [k, k + 1] if tie else k)
        value = 0.5 * (float(selected[k]) + float(selected[k + 1])) if tie else float(selected[k])
        return _output(value, num_outputs)
    # Any order of equal labels gives the same answer, so the sort need not be stable.
    order = np.argsort(values)
    values, cumulative = values[order].astype(np.float64), np.cumsum(weights[order], dtype=np.float64)
    target = float(tau) * cumulative[-1]
    k = int(np.searchsorted(cumulative, target, side="left"))
    value = values[k]
    if cumulative[k] == target and k + 1 < values.size:
        value = 0.5 * (value + values[k + 1])
    return _output(value, num_outputs)


def weighted_median(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Absolute error: the weighted median (``weighted_quantile`` at 0.5)."""
    return weighted_quantile(y, sample_weight, num_outputs, tau=0.5)


def log_mean(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Log-link count and amount losses (Poisson, gamma, Tweedie, negative binomial): their
    constant's score equation is ``sum w (y - exp(F)) c(F) = 0`` with ``c`` free of the row, so
    ``exp(F)`` is the weighted mean."""
    return _output(_clamped_log(_weighted_mean(y, sample_weight)), num_outputs)


def log_odds(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Logistic: the log-odds of the weighted mean label."""
    p = _weighted_mean(y, sample_weight)
    return _output(_clamped_log(p) - _clamped_log(1.0 - p), num_outputs)


def half_log_odds(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Exponential (AdaBoost): half the log-odds of the weighted mean label."""
    return 0.5 * log_odds(y, sample_weight, num_outputs)


def hinge_side(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Hinge: the margin 1 towards the heavier class (the loss falls with slope equal to its
    weight until the margin reaches 1), 0 where both weigh the same (every point of [-1, 1]
    minimises)."""
    weights = np.asarray(sample_weight, np.float64)
    positive = _weighted_total(weights, (np.asarray(y, np.float64).ravel() > 0.5).astype(np.float64))
    return _output(np.sign(positive - (weights.sum() - positive)), num_outputs)


def log_class_frequencies(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Softmax: the logs of the weighted class frequencies, less their mean over the classes
    present (softmax's value is the same for any shift; this one is the numerical minimiser's
    when every class is present)."""
    weights = np.asarray(sample_weight, np.float64)
    totals = np.bincount(np.asarray(y).astype(np.int64).ravel(), weights=weights, minlength=num_outputs)
    present = totals > 0
    logs = _clamped_log(totals / weights.sum())
    return logs - logs[present].mean()


def _float32_log_scale(location: float) -> float:
    """The log of the smallest scale float32 resolves at ``location``: where a scale without a
    minimiser (labels without spread) stops."""
    return math.log(_FLOAT32_RESOLUTION * max(abs(location), 1.0))


def _location_and_log_scale(values: np.ndarray, sample_weight) -> np.ndarray:
    location = _weighted_mean(values, sample_weight)
    variance = _weighted_mean(np.square(np.asarray(values, np.float64) - location), sample_weight)
    return np.array([location, max(0.5 * math.log(variance) if variance > 0 else -math.inf,
                                   _float32_log_scale(location))])


def gaussian(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Gaussian likelihood ``(mu, log sigma)``: the weighted mean and the log of the weighted
    standard deviation (divided by the weights' sum)."""
    del num_outputs  # always 2
    return _location_and_log_scale(y, sample_weight)


def lognormal(y, sample_weight, num_outputs: int, **_) -> np.ndarray:
    """Log-normal likelihood: ``gaussian`` of ``log y``."""
    del num_outputs
    return _location_and_log_scale(np.log(np.asarray(y, np.float64)), sample_weight)


# Student-t's iterations: at most this many, ending where a step moves (mu, log sigma) by less
# than this (times max(1, |value|)), far below the float32 constant's resolution.
STUDENT_T_MAX_STEPS = 200
STUDENT_T_STEP_TOLERANCE = 1e-12


def _student_t_terms(parameters, values, weights, df):
    """The weighted negative log-likelihood (less its constant) at ``(mu, log sigma)``, its
    gradient and Hessian, and the rows' EM weights ``(df + 1) / (df + z^2)``, in float64."""
    mu, log_sigma = parameters
    scale = math.exp(-log_sigma)
    z = (values - mu) * scale
    square = z * z
    denominator = df + square
    precision = (df + 1.0) / denominator  # each row's expected precision given its residual
    total = weights.sum()
    value = total * log_sigma + 0.5 * (df + 1.0) * _weighted_total(weights, np.log1p(square / df))
    gradient = np.array([-scale * _weighted_total(weights, precision * z), total - _weighted_total(weights, precision * square)])
    squared_denominator = denominator * denominator
    cross = 2.0 * (df + 1.0) * df * scale * _weighted_total(weights, z / squared_denominator)
    hessian = np.array([[(df + 1.0) * scale * scale * _weighted_total(weights, (df - square) / squared_denominator), cross],
                        [cross, 2.0 * (df + 1.0) * df * _weighted_total(weights, square / squared_denominator)]])
    return value, gradient, hessian, precision


def student_t(y, sample_weight, num_outputs: int, *, df, **_) -> np.ndarray:
    """Student-t likelihood ``(mu, log sigma)`` with ``df`` degrees of freedom: no closed form,
    so it is minimised on the host in float64, from the weighted mean and deviation: Newton
    steps on the exact likelihood where its Hessian is positive definite and a step (halved
    up to 30 times) lowers it, else the EM step for a t's location and scale (rows weighted by
    their expected precision ``(df + 1) / (df + z^2)``), which always lowers it: 5-7
    evaluations of the likelihood, about 0.1 s on 640k labels (df 2.5-30). Labels without
    spread stop where ``gaussian``'s do, and so do labels whose likelihood falls without bound
    as the scale shrinks (more than ``df / (df + 1)`` of the weight on one label): the scale
    stops at float32's resolution of the location."""
    del num_outputs  # always 2
    weights = np.asarray(sample_weight, np.float64).ravel()
    kept = weights > 0
    values, weights = np.asarray(y, np.float64).ravel()[kept], weights[kept]
    df = float(df)
    parameters = _location_and_log_scale(values, weights)
    if np.all(values == values[0]):
        return parameters
    value, gradient, hessian, precision = _student_t_terms(parameters, values, weights, df)
    for _ in range(STUDENT_T_MAX_STEPS):
        moved = None
        if hessian[0, 0] > 0 and np.linalg.det(hessian) > 0:
            step = -np.linalg.solve(hessian, gradient)
            if _negligible(step, parameters):  # where the likelihood no longer resolves a decrease
                return parameters + step
            for _ in range(30):
                if not _below_resolution(parameters + step):
                    trial = _student_t_terms(parameters + step, values, weights, df)
                    if trial[0] <= value:
                        moved = parameters + step, trial
                        break
                step = 0.5 * step
        if moved is None:
            precision_weights = weights * precision
            location = _weighted_total(precision_weights, values) / precision_weights.sum()
            variance = _weighted_total(precision_weights, np.square(values - location)) / weights.sum()
            expected = np.array([location, 0.5 * math.log(variance) if variance > 0 else -math.inf])
            if _below_resolution(expected):  # no minimiser: the scale would shrink without end
                return np.array([location, _float32_log_scale(location)])
            step = expected - parameters
            moved = expected, _student_t_terms(expected, values, weights, df)
        parameters, (value, gradient, hessian, precision) = moved[0], moved[1]
        if _negligible(step, parameters):
            break
    return parameters


def _below_resolution(parameters) -> bool:
    return bool(parameters[1] < _float32_log_scale(parameters[0]))


def _negligible(step, parameters) -> bool:
    return bool(np.all(np.abs(step) <= STUDENT_T_STEP_TOLERANCE * np.maximum(1.0, np.abs(parameters))))
