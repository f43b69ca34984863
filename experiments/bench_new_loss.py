"""What a new loss costs before its trees: a session that fits a built-in loss, then losses of its own.

A researcher trying losses fits one after another on the same data: each new loss, and the same
loss defined again (a notebook cell run again makes a new function), pays whatever its round
must compile. Each run is a fresh process with an empty cache folder that times, in order, a
fit of the built-in logistic loss, a custom focal loss, the focal loss defined again, another
custom loss (``softplus(F) - y F``), a custom hinge loss (zero Hessians: its leaves are refit on
the loss, the session's first refit), the hinge defined again, and a warm fit of the built-in
(its rounds alone: what every fit pays besides compiling). A later process with the same cache
folder then fits the five custom losses again. 20 rounds of depth 6 on ``make_classification`` rows, 28 features.
Two cold processes (caches off) then time a built-in's 1-round fit, and one with the last 20k
rows as an eval set scored by AUC, each with the seconds XLA spent compiling (all programs,
summed: some compile side by side).

``--baseline`` names another checkout of jaxboost (e.g. a git worktree of an earlier commit)
whose runs alternate with this one's, so the results file holds the change and what came
before it from the same machine and hour.

    python experiments/bench_new_loss.py [--rows 100000] [--repeats 3] [--baseline PATH]
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
rows, process = int(sys.argv[1]), sys.argv[2]
import numpy as np
from sklearn.datasets import make_classification
X, y = make_classification(n_samples=rows, n_features=28, n_informative=14, random_state=0)
X, y = X.astype(np.float32), y.astype(np.float32)
import jax
import jaxboost as jb

def focal():
    def loss(raw_prediction, y, gamma=2.0):
        margin = (2.0 * y - 1.0) * raw_prediction
        return -((1.0 - jax.nn.sigmoid(margin)) ** gamma) * jax.nn.log_sigmoid(margin)
    return loss

def softplus(raw_prediction, y):
    return jax.nn.softplus(raw_prediction) - y * raw_prediction

def hinge():
    def loss(raw_prediction, y):
        return jax.nn.relu(1.0 - (2.0 * y - 1.0) * raw_prediction)
    return loss

def fit(loss):
    begin = time.perf_counter()
    jb.train(X, y, loss=loss, num_rounds=20, max_depth=6, learning_rate=0.1,
             link=None if isinstance(loss, str) else "sigmoid")
    return time.perf_counter() - begin

times = {}
if process.startswith("cold"):
    import jax.monitoring
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(seconds) if event.endswith("backend_compile_duration") else None)
    scored = process == "cold, eval AUC"
    begin = time.perf_counter()
    jb.train(X[:-20000] if scored else X, y[:-20000] if scored else y, loss="logistic", num_rounds=1, max_depth=6,
             eval_set=[(X[-20000:], y[-20000:])] if scored else None, eval_metric=["auc"] if scored else None)
    times["fit"], times["XLA compile"] = time.perf_counter() - begin, sum(compiles)
else:
    if process == "first":
        times["built-in"] = fit("logistic")
    times["focal"] = fit(focal())
    times["focal defined again"] = fit(focal())
    times["softplus"] = fit(softplus)
    times["hinge (refit)"] = fit(hinge())
    times["hinge defined again"] = fit(hinge())
    if process == "first":
        times["built-in, warm"] = fit("logistic")
print(jb.__file__)
print(json.dumps(times))
"""


def run(rows: int, process: str, env: dict, folder: str) -> dict:
    # Run in ``folder``: a script's own folder comes first on its import path, and the
    # repository root's would shadow the checkout on PYTHONPATH.
    done = subprocess.run([sys.executable, "-c", WORKER, str(rows), process], capture_output=True, text=True, env=env,
                          cwd=folder, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    module, times = done.stdout.strip().splitlines()[-2:]
    if not Path(module).resolve().is_relative_to(Path(env["PYTHONPATH"].split(os.pathsep)[0]).resolve()):
        raise RuntimeError(f"imported {module}, not the checkout's jaxboost")
    return json.loads(times)


def session(rows: int, checkout: Path) -> dict:
    """A first process and a later one, sharing a fresh cache folder."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAXBOOST_CACHE_DIR=cache, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])))
        first = run(rows, "first", env, cache)
        later = run(rows, "later", env, cache)
        cold = {kind: run(rows, kind, dict(env, JAXBOOST_CACHE_DIR=""), cache) for kind in ("cold", "cold, eval AUC")}
    return {**{f"first process: {name}": value for name, value in first.items()},
            **{f"later process: {name}": value for name, value in later.items()},
            **{f"{kind} process: {name}": value for kind, times in cold.items() for name, value in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another jaxboost checkout, run alternately")
    parser.add_argument("--output", default=str(REPO_ROOT / "experiments" / "results" / "new_loss.md"))
    args = parser.parse_args()
    checkouts = {"this checkout": REPO_ROOT}
    if args.baseline:
        checkouts["baseline"] = args.baseline.resolve()
    results = {name: [] for name in checkouts}
    names = list(checkouts)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            results[name].append(session(args.rows, checkouts[name]))
            print(name, json.dumps({k: round(v, 2) for k, v in results[name][-1].items()}), flush=True)
    command = f"python experiments/bench_new_loss.py --rows {args.rows} --repeats {args.repeats}"
    if args.baseline:
        command += " --baseline BASELINE"
    lines = ["# What a new loss costs before its trees", "",
             f"- command: `{command}`",
             f"- {args.rows:,} x 28 rows (make_classification), 20 rounds of depth 6, seconds a fit; medians of "
             f"{args.repeats} sessions (ranges in brackets), each a first process with an empty cache folder "
             "and a later one with the same folder, then two cold processes (caches off); the checkouts' "
             "sessions alternate", ""]
    steps = list(results[names[0]][0])
    lines += ["| fit | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in steps:
        cells = []
        for name in names:
            values = [result[step] for result in results[name]]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
