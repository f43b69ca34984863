"""Compile time of a new shape, configuration by configuration, each in a fresh process.

Usage: ``python experiments/compile_survey.py [--configs a,b,...] [--rows N] [--repeats R]
[--rounds N] [--depth D] [--baseline PATH] [--output FILE]``

For each configuration a fresh process (JAX's persistent cache and jaxboost's program store
off) generates its data, builds a ``jb.Dataset`` and trains 1 round twice: the compile column is
the first fit's time minus the second's, as in ``bench.py``; the first fit's CPU time (all
threads) is reported too, and the second fit's time: what every later fit of those shapes pays,
its starting value included (a change can move cost from the compile into every fit). With
``--baseline PATH`` (a checkout of another jaxboost, e.g. a git worktree of an earlier commit)
every repeat runs that checkout and this one in turn, the order alternating, and the table adds
the baseline's medians and the median of the run-by-run differences: on a noisy machine two runs
minutes apart differ by more than most changes. With ``--rounds N`` each process then trains N
rounds too, and the table adds the time a round (the N-round fit's time minus the second 1-round
fit's, over N - 1) and a checksum of the N-round model's predictions on 2,000 rows, equal
between checkouts that grow the same trees.

The data: 100k rows by default (the shapes a program is compiled for depend on the padded row
count, the compile time little), the benchmark's generators (``make_classification`` with 28
features, ``make_regression`` with 50).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "SURVEY_RESULT "

# name: (task, settings) where task is classification, regression, multiclass or wide.
CONFIGS = {
    "classification": ("classification", dict(loss="logistic")),
    "regression": ("regression", dict(loss="squared_error")),
    "depth-10": ("classification", dict(loss="logistic", max_depth=10)),
    "wide-500-features": ("wide", dict(loss="logistic")),
    "softmax-10-classes": ("multiclass", dict(loss="softmax")),
    "softmax-vector-leaves": ("multiclass", dict(loss="softmax", multi_strategy="multi_output_tree")),
    "softmax-3-classes": ("multiclass-3", dict(loss="softmax")),
    "softmax-3-classes-vector-leaves-diagonal": ("multiclass-3", dict(loss="softmax", multi_strategy="multi_output_tree",
                                                                      multi_output_hessian="diagonal")),
    "absolute-error-refit": ("regression", dict(loss="absolute_error")),
    "eval-set-early-stopping": ("classification", dict(loss="logistic", eval_set=True, early_stopping_rounds=5)),
    "monotone": ("classification", dict(loss="logistic", monotone_constraints=[1, -1] + [0] * 26)),
    "colsample-bytree-0.5": ("classification", dict(loss="logistic", colsample_bytree=0.5)),
    "colsample-bynode-0.5": ("classification", dict(loss="logistic", colsample_bynode=0.5)),
    "subsample-0.8": ("classification", dict(loss="logistic", subsample=0.8)),
    "custom-focal": ("classification", dict(loss="focal")),
    "custom-hinge-refit-found": ("classification", dict(loss="hinge")),
    "custom-three-quantiles": ("regression", dict(loss="quantiles", num_outputs=3)),
    "student-t-vector-leaves": ("regression", dict(loss="student_t_nll", multi_strategy="multi_output_tree")),
    "custom-gaussian-vector-leaves": ("regression", dict(loss="gaussian", num_outputs=2,
                                                         multi_strategy="multi_output_tree")),
    # The labels scaled to unit variance, as a distributional model's usually are: the trees grow
    # fuller than on the raw labels (a standard deviation of 200), so a round's children weigh more.
    "student-t-vector-leaves-unit-labels": ("regression", dict(loss="student_t_nll", multi_strategy="multi_output_tree",
                                                               unit_labels=True)),
    "custom-gaussian-vector-leaves-unit-labels": ("regression", dict(loss="gaussian", num_outputs=2,
                                                                     multi_strategy="multi_output_tree",
                                                                     unit_labels=True)),
    "custom-softmax-10-classes": ("multiclass", dict(loss="softmax", num_outputs=10, custom=True)),
    # Custom leaf penalties (experiments/bench_penalty.py's): their leaf values and gains come
    # from Newton steps in XLA, where the built-in ones have closed forms.
    "custom-penalty-quadratic": ("classification", dict(loss="logistic", penalty="quadratic")),
    "custom-penalty-smooth-l1": ("classification", dict(loss="logistic", penalty="smooth_l1")),
    "custom-penalty-smooth-l1-monotone": ("classification", dict(loss="logistic", penalty="smooth_l1",
                                                                 monotone_constraints=[1, -1] + [0] * 26)),
}


def _custom_loss(name: str):
    import jax
    import jax.numpy as jnp

    if name == "focal":
        def focal(raw_prediction, y, gamma=2.0):
            p = jax.nn.sigmoid(raw_prediction)
            p_true = jnp.where(y > 0, p, 1 - p)
            return -((1 - p_true) ** gamma) * jnp.log(jnp.clip(p_true, 1e-7, 1.0))
        return focal
    if name == "gaussian":
        def gaussian(raw_prediction, y):  # (mean, log deviation)
            return raw_prediction[1] + 0.5 * jnp.square((y - raw_prediction[0]) * jnp.exp(-raw_prediction[1]))
        return gaussian
    if name == "softmax":
        def softmax(raw_prediction, y):
            return jax.nn.logsumexp(raw_prediction) - raw_prediction[y.astype(jnp.int32)]
        return softmax
    if name == "quantiles":
        def quantiles(raw_prediction, y):  # the 0.1, 0.5 and 0.9 quantiles, one output each
            residual = y - raw_prediction
            taus = jnp.array([0.1, 0.5, 0.9])
            return jnp.sum(jnp.maximum(taus * residual, (taus - 1) * residual))
        return quantiles
    return lambda raw_prediction, y: jnp.maximum(0.0, 1.0 - (2 * y - 1) * raw_prediction)


def worker(config: str, rows: int, rounds: int, depth: int | None) -> dict:
    import numpy as np
    from sklearn.datasets import make_classification, make_regression

    import jaxboost as jb

    task, settings = CONFIGS[config]
    settings = dict(settings, max_depth=depth or settings.get("max_depth", 6), learning_rate=0.1)
    if task == "regression":
        X, y = make_regression(rows, 50, n_informative=20, noise=10, random_state=0)
    elif task.startswith("multiclass"):
        classes = int(task.partition("-")[2] or 10)
        X, y = make_classification(rows, 28, n_informative=14, n_classes=classes, n_clusters_per_class=1,
                                   random_state=0)
    elif task == "wide":
        X, y = make_classification(rows // 4, 500, n_informative=50, random_state=0)
    else:
        X, y = make_classification(rows, 28, n_informative=14, n_redundant=4, random_state=0)
    if settings.pop("unit_labels", False):
        y = (y - y.mean()) / y.std()
    X, y = X.astype(np.float32), y.astype(np.float32)
    if settings.pop("custom", False) or settings["loss"] in ("focal", "hinge", "quantiles", "gaussian"):
        settings["loss"] = _custom_loss(settings["loss"])
    penalty = settings.pop("penalty", None)
    if penalty is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_penalty import quadratic, smooth_l1
        settings["regularizer"] = (jb.regularizers.custom(quadratic) if penalty == "quadratic" else
                                   jb.regularizers.custom(smooth_l1, reg_lambda=1.0))
    if settings.pop("eval_set", False):
        settings["eval_set"] = [(X[:5000], y[:5000])]
    dataset = jb.Dataset(X, y)

    def cpu_s():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cpu_before, started = cpu_s(), time.perf_counter()
    jb.train(dataset, num_rounds=1, **settings)
    first_s, cpu = time.perf_counter() - started, cpu_s() - cpu_before
    started = time.perf_counter()
    jb.train(dataset, num_rounds=1, **settings)
    second_s = time.perf_counter() - started
    timed_rounds = {}
    if rounds > 1:
        started = time.perf_counter()
        model = jb.train(dataset, num_rounds=rounds, **settings)
        predictions = np.asarray(model.predict(X[:2000]), np.float64).ravel()
        timed_rounds = dict(ms_a_round=1000 * (time.perf_counter() - started - second_s) / (rounds - 1),
                            checksum=float(predictions @ np.linspace(1.0, 2.0, predictions.size)))
    return dict(compile_s=first_s - second_s, first_fit_s=first_s, second_fit_s=second_s, first_fit_cpu_s=cpu,
                **timed_rounds,
                jaxboost=os.path.dirname(os.path.dirname(os.path.abspath(jb.__file__))),
                losses=os.path.dirname(os.path.dirname(os.path.abspath(jb.losses.__file__))))


def run_once(checkout: str, config: str, rows: int, rounds: int, depth: int | None) -> dict | None:
    env = dict(os.environ, JAXBOOST_CACHE_DIR="", PYTHONPATH=checkout)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", config, "--rows", str(rows),
                                "--rounds", str(rounds)] + (["--depth", str(depth)] if depth else []),
                               capture_output=True, text=True, env=env, cwd=checkout)
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            # Both the package and its losses (an editable install elsewhere maps jaxboost.losses).
            if {os.path.realpath(result.pop(name)) for name in ("jaxboost", "losses")} != {os.path.realpath(checkout)}:
                raise RuntimeError(f"the run for {checkout} imported another jaxboost or its losses")
            return result
    print(f"  {config} in {checkout}: failed\n{completed.stderr[-2000:]}", file=sys.stderr)
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="also train this many rounds: the time a round and the model's checksum")
    parser.add_argument("--depth", type=int, help="every configuration at this depth (default: its own, 6 unless named)")
    parser.add_argument("--baseline", help="another jaxboost checkout to compare with, run by run")
    parser.add_argument("--output", default=os.path.join(REPO_ROOT, "experiments", "results", "compile_survey.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(worker(args.worker, args.rows, args.rounds, args.depth)), flush=True)
        return
    configs = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    checkouts = {"this": REPO_ROOT}
    if args.baseline:
        checkouts["baseline"] = os.path.abspath(args.baseline)
    started = time.time()
    results = {name: {which: [] for which in checkouts} for name in configs}
    for repeat in range(args.repeats):
        for name in configs:
            order = list(checkouts) if repeat % 2 == 0 else list(reversed(checkouts))
            for which in order:
                results[name][which].append(run_once(checkouts[which], name, args.rows, args.rounds, args.depth))
            print(f"  repeat {repeat + 1}/{args.repeats} {name}: "
                  + ", ".join(f"{which} {run['compile_s']:.2f} s" for which in order
                              if (run := results[name][which][-1]) is not None), file=sys.stderr)
    write_report(args, configs, checkouts, results, time.time() - started)


def _median(runs: list, field: str) -> float | None:
    values = [run[field] for run in runs if run is not None]
    return statistics.median(values) if values else None


def write_report(args, configs, checkouts, results, took_s: float) -> None:
    command = "python experiments/compile_survey.py " + " ".join(
        part for part in (f"--rows {args.rows}", f"--repeats {args.repeats}",
                          f"--rounds {args.rounds}" if args.rounds > 1 else "",
                          f"--depth {args.depth}" if args.depth else "",
                          "--baseline PATH" if args.baseline else "",
                          f"--configs '{args.configs}'" if args.configs != ",".join(CONFIGS) else "") if part)
    lines = ["# Compile time of a new shape, by configuration", "",
             f"- command: `{command}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} "
             f"(took {took_s / 60:.1f} min); machine: {os.cpu_count()} CPUs, {platform.machine()}, "
             f"Python {platform.python_version()}",
             f"- each cell: the median of {args.repeats} fresh processes, {args.rows:,} rows (wide: a quarter), "
             f"depth {args.depth or '6 unless named'}, caches off; compile s = first 1-round fit - second; "
             "CPU s: the first fit's, all threads; later fit s: the second 1-round fit (what every fit of those "
             "shapes pays, its starting value included)", ""]
    fields = {"compile_s": "compile s", "first_fit_cpu_s": "first fit CPU s", "second_fit_s": "later fit s"}
    compared = {"compile_s": "compile", "first_fit_cpu_s": "CPU"}
    if args.rounds > 1:
        fields["ms_a_round"] = "ms a round"
        compared["ms_a_round"] = "ms a round"
    header = "| configuration | " + " | ".join(fields.values()) + " |"
    if args.rounds > 1:
        header += " checksums |"
    if "baseline" in checkouts:
        header += "".join(f" baseline {label} |" for label in fields.values())
        header += "".join(f" {label}, run by run |" for label in compared.values())
    lines += [header, "|---" * header.count(" |") + "|"]
    for name in configs:
        this = results[name]["this"]
        row = f"| {name} |" + "".join(f" {_cell(_median(this, field))} |" for field in fields)
        if args.rounds > 1:
            row += " " + _checksums(results[name]) + " |"
        if "baseline" in checkouts:
            base = results[name]["baseline"]
            row += "".join(f" {_cell(_median(base, field))} |" for field in fields)
            for field in compared:
                differences = [new[field] - old[field] for new, old in zip(this, base) if new and old]
                row += (f" {statistics.median(differences):+.2f} ({sum(d < 0 for d in differences)} of "
                        f"{len(differences)} lower) |" if differences else " n/a |")
        lines.append(row)
    lines += ["", "## Raw runs", "", "```"]
    for name in configs:
        for which, runs in results[name].items():
            for run in runs:
                lines.append(json.dumps(dict(configuration=name, checkout=which, **(run or {"status": "failed"}))))
    lines += ["```", ""]
    with open(args.output, "w") as report:
        report.write("\n".join(lines))
    print(f"results written to {args.output}", file=sys.stderr)


def _checksums(runs_by_checkout: dict) -> str:
    """The distinct model checksums of each checkout's runs: one value each where every run
    grew the same trees."""
    return "; ".join(f"{which} " + ", ".join(sorted({f"{run['checksum']:.10g}" for run in runs if run}))
                     for which, runs in runs_by_checkout.items())


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
