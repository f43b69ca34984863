"""Benchmark: scikit-learn's GridSearchCV over jaxboost's and XGBoost's estimators, its folds
fitted one at a time (``n_jobs=1``) and in parallel worker processes (``n_jobs=2`` or more),
each setting in a fresh process, the settings alternating, medians of ``--repeats``.

joblib's process workers are where a library's own threads meet: each worker's library would
use every core, so joblib sets ``OMP_NUM_THREADS`` in them to the cores over the workers, which
XGBoost's OpenMP threads follow (and jaxboost's host devices and threads,
``jaxboost.available_cpu_cores``).

Usage: python experiments/bench_grid_search.py [--rows 150000] [--jobs 1,2] [--repeats 3]
           [--output experiments/results/grid_search.md]
Prints one line a process and a Markdown table, written to ``--output`` with the command and
the versions when given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

GRID = {"max_depth": [4, 6], "learning_rate": [0.1, 0.3]}
FOLDS = 3
ROUNDS = 100


def child(library: str, rows: int, jobs: int) -> dict:
    """In this process: one GridSearchCV fit; its seconds and best score."""
    from sklearn.datasets import make_classification
    from sklearn.model_selection import GridSearchCV

    X, y = make_classification(n_samples=rows, n_features=28, n_informative=14, n_redundant=4, random_state=0)
    X = X.astype("float32")
    if library == "xgboost":
        import xgboost as xgb

        estimator = xgb.XGBClassifier(n_estimators=ROUNDS, tree_method="hist", max_bin=256)
    else:
        import jaxboost as jb

        estimator = jb.JaxBoostClassifier(n_estimators=ROUNDS)
    search = GridSearchCV(estimator, GRID, cv=FOLDS, n_jobs=jobs, scoring="roc_auc")
    start = time.perf_counter()
    search.fit(X, y)
    return {"seconds": time.perf_counter() - start, "best_auc": search.best_score_}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=150_000)
    parser.add_argument("--jobs", default="1,2", help="comma-separated GridSearchCV n_jobs values")
    parser.add_argument("--libraries", default="jaxboost,xgboost")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the table here")
    parser.add_argument("--child", nargs=2, metavar=("LIBRARY", "JOBS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.rows, int(args.child[1]))))
        return
    settings = [(library, int(jobs)) for library in args.libraries.split(",") for jobs in args.jobs.split(",")]
    results: dict[tuple[str, int], list[dict]] = {setting: [] for setting in settings}
    for _ in range(args.repeats):
        for library, jobs in settings:
            output = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--child", library, str(jobs)],
                                    capture_output=True, text=True, check=True).stdout
            result = json.loads(output.strip().splitlines()[-1])
            results[(library, jobs)].append(result)
            print(f"{library}, n_jobs={jobs}: {result['seconds']:.2f} s, best AUC {result['best_auc']:.4f}", flush=True)
    lines = [f"{args.rows:,} rows x 28 features, {len(GRID['max_depth']) * len(GRID['learning_rate'])} settings x "
             f"{FOLDS} folds, {ROUNDS} rounds, runs alternating", "",
             "| library | n_jobs | seconds, each run | median | best AUC |", "|---|---|---|---|---|"]
    for (library, jobs), runs in results.items():
        seconds = [run["seconds"] for run in runs]
        lines.append(f"| {library} | {jobs} | {', '.join(f'{value:.2f}' for value in seconds)} | "
                     f"{statistics.median(seconds):.2f} | {runs[0]['best_auc']:.4f} |")
    print("\n" + "\n".join(lines))
    if args.output:
        versions = ", ".join(f"{name} {version(name)}" for name in ("jax", "scikit-learn", "joblib", "xgboost"))
        header = ["# GridSearchCV: folds one at a time and in worker processes", "",
                  f"- command: `python experiments/bench_grid_search.py {' '.join(sys.argv[1:])}`",
                  f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
                  f"- machine: {os.cpu_count()} CPUs, {platform.platform()}; Python {platform.python_version()}; {versions}",
                  ""]
        args.output.write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
