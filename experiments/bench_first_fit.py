"""A new process's first fit: what a script run again and again pays before its trees.

Each run is a fresh Python process that imports the library, makes the data and times its first
``train`` (100 rounds), a second one with the same shapes, and a first prediction of the
training rows. jaxboost runs with its caches in a folder of this benchmark's: once primed by a
first process, later processes find the compiled round in JAX's persistent compilation cache,
and with the program store (``jaxboost.program_store``) its lowered form too, so they skip
tracing it, and on a CPU its executable, so they skip lowering it (a built-in link's as well).
The settings alternate run by run; XGBoost, which compiles nothing, is the reference.

    python experiments/bench_first_fit.py [--rows 455] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import json, sys, time
rows, library = int(sys.argv[1]), sys.argv[2]
import numpy as np
from sklearn.datasets import make_classification
X, y = make_classification(n_samples=rows, n_features=30, n_informative=10, random_state=0)
X = X.astype(np.float32)
start = time.perf_counter()
if library == "jaxboost":
    import jaxboost as jb
    imported = time.perf_counter()
    fit = lambda: jb.train(X, y, loss="logistic", num_rounds=100, max_depth=4, learning_rate=0.1)
else:
    import xgboost as xgb
    imported = time.perf_counter()
    fit = lambda: xgb.train(dict(objective="binary:logistic", max_depth=4, eta=0.1, tree_method="hist"),
                            xgb.DMatrix(X, y), num_boost_round=100)
times = []
for _ in range(2):
    begin = time.perf_counter()
    model = fit()
    times.append(time.perf_counter() - begin)
begin = time.perf_counter()
if library == "jaxboost":
    model.predict(X)
else:
    model.inplace_predict(X)
predict_s = time.perf_counter() - begin
print(json.dumps(dict(import_s=imported - start, first_fit_s=times[0], second_fit_s=times[1],
                      first_predict_s=predict_s)))
"""

SETTINGS = {
    "jaxboost, program store": ("jaxboost", {"JAXBOOST_PROGRAM_STORE": "1"}),
    "jaxboost, compilation cache only": ("jaxboost", {"JAXBOOST_PROGRAM_STORE": "0"}),
    "xgboost": ("xgboost", {}),
}


def run(rows: int, library: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, str(rows), library], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=455)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(REPO_ROOT / "experiments" / "results" / "first_fit.md"))
    args = parser.parse_args()
    results = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as cache:
        base = dict(os.environ, JAXBOOST_CACHE_DIR=cache, JAX_PLATFORMS="cpu",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        cold = {name: run(args.rows, library, dict(base, **extra))
                for name, (library, extra) in SETTINGS.items()}  # primes the caches
        names = list(SETTINGS)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                library, extra = SETTINGS[name]
                results[name].append(run(args.rows, library, dict(base, **extra)))
    lines = ["# A new process's first fit", "",
             f"- command: `python experiments/bench_first_fit.py --rows {args.rows} --repeats {args.repeats}`",
             f"- {args.rows} x 30 rows (make_classification), logistic, 100 rounds, depth 4; each run a fresh "
             "process, the settings alternating; medians (and ranges) of the runs after a priming one, whose "
             "figures are the cold column", "",
             "| setting | import s | first fit s | first fit s, each run | second fit s | first predict s | "
             "cold first fit s |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        first = [r["first_fit_s"] for r in runs]
        lines.append(f"| {name} | {statistics.median(r['import_s'] for r in runs):.2f} | "
                     f"{statistics.median(first):.3f} | {', '.join(f'{x:.2f}' for x in first)} | "
                     f"{statistics.median(r['second_fit_s'] for r in runs):.3f} | "
                     f"{statistics.median(r['first_predict_s'] for r in runs):.3f} | {cold[name]['first_fit_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
