"""Checks for a GPU (they run on a CPU too): whether repeated fits grow the same trees, with and
without ``deterministic_histogram``, and a new process's first fit with the program store.

Run from the repository root: ``python experiments/gpu_first_fits.py`` (``--rows``,
``--output``). Three parts:

* repeats: in one process, 4 fits each of logistic (30 rounds) and of weighted absolute error
  (15 rounds, whose leaf refits sum rows too) on ``--rows`` x 28 rows (make_classification),
  depth 6, with and without ``deterministic_histogram``: are fits 2-4 fit 1's trees bit for bit,
  and if not, how far apart are their leaves?
* store: five processes in turn on one cache folder (100k rows, logistic, 100 rounds, depth 6,
  ``deterministic_histogram=True`` so that the models can be compared bit for bit): the store
  with empty caches, the store loading, the compilation cache alone, the store, the compilation
  cache alone; each process's first and second fit, and whether its trees are the first's.
* cold: first fits with empty caches, each process with a folder of its own, the store on and
  off in turns, with the time the store's export (trace and lower) took and the compiles that
  JAX logged above 0.15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE_ROWS = 100_000


def data(rows):
    from sklearn.datasets import make_classification
    X, y = make_classification(n_samples=rows, n_features=28, n_informative=14, n_redundant=4, random_state=0)
    return X.astype(np.float32), y.astype(np.float32)


def same_bits(model, other) -> bool:
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(model.trees, other.trees))


def repeats(rows: int) -> list[str]:
    os.environ["JAXBOOST_CACHE_DIR"] = ""  # before jaxboost is imported
    import jax

    import jaxboost as jb
    X, y = data(rows)
    weight = np.random.default_rng(0).uniform(0.5, 2.0, len(y)).astype(np.float32)
    cases = {"logistic": (jb.Dataset(X, y), dict(loss="logistic", num_rounds=30)),
             "absolute error, weighted": (jb.Dataset(X, X[:, 0] + np.sin(X[:, 1]), weight),
                                          dict(loss="absolute_error", num_rounds=15))}
    lines = [f"devices: {jax.devices()}", "",
             "| loss | deterministic_histogram | fits 2-4 the same bits as fit 1 | largest leaf difference | "
             "share of nodes splitting on another feature | s for 4 fits |", "|---|---|---|---|---|---|"]
    for name, (dataset, settings) in cases.items():
        for deterministic in (True, False):
            start = time.perf_counter()
            models = [jb.train(dataset, max_depth=6, deterministic_histogram=deterministic, **settings)
                      for _ in range(4)]
            took = time.perf_counter() - start
            same = ", ".join("yes" if same_bits(models[0], other) else "no" for other in models[1:])
            leaf_gap = max(float(np.max(np.abs(np.asarray(models[0].trees.value) - np.asarray(m.trees.value))))
                           for m in models[1:])
            other_feature = max(float(np.mean(np.asarray(models[0].trees.feature) != np.asarray(m.trees.feature)))
                                for m in models[1:])
            lines.append(f"| {name} | {deterministic} | {same} | {leaf_gap:.3g} | {other_feature:.4f} | {took:.1f} |")
            print(lines[-1], flush=True)
    return lines


# A child process's fit, timed; the store's export and save timed by wrapping them.
CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[2])
from gpu_first_fits import STORE_ROWS, data
import jaxboost as jb
from jaxboost import program_store
spent = {}
def timed(name, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return wrapper
program_store._exported = timed("export", program_store._exported)
X, y = data(STORE_ROWS)
dataset = jb.Dataset(X, y)
settings = dict(loss="logistic", num_rounds=100, max_depth=6, deterministic_histogram=True)
start = time.perf_counter()
model = jb.train(dataset, **settings)
first = time.perf_counter() - start
start = time.perf_counter()
jb.train(dataset, **settings)
second = time.perf_counter() - start
np.savez(sys.argv[1], *[np.asarray(field) for field in model.trees])
print("RESULT " + json.dumps(dict(first=first, second=second, export=spent.get("export", 0.0))))
"""


def child(folder: str, store: str, trees_file: str, log_compiles: bool = False) -> tuple[dict | None, str]:
    env = dict(os.environ, JAXBOOST_CACHE_DIR=folder, JAXBOOST_PROGRAM_STORE=store,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD, trees_file, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not found:
        print(done.stderr[-3000:], flush=True)
        return None, done.stderr
    return json.loads(found[-1][len("RESULT "):]), done.stderr


def load_trees(path):
    with np.load(path) as loaded:
        return [loaded[key] for key in sorted(loaded.files, key=lambda name: int(name.split("_")[1]))]


def store() -> list[str]:
    folder = tempfile.mkdtemp(prefix="jaxboost_first_fits_")
    runs = [("store, empty caches", "1"), ("store, loads", "1"), ("compilation cache only", "0"),
            ("store, loads", "1"), ("compilation cache only", "0")]
    lines = ["| process (in turn, one cache folder) | first fit s | second fit s | trees the first process's bits |",
             "|---|---|---|---|"]
    first_trees = None
    for index, (name, flag) in enumerate(runs):
        trees_file = os.path.join(folder, f"trees{index}.npz")
        result, _ = child(folder, flag, trees_file)
        if result is None:
            lines.append(f"| {name} | failed | | |")
            continue
        trees = load_trees(trees_file)
        first_trees = trees if first_trees is None else first_trees
        same = all(np.array_equal(a, b) for a, b in zip(first_trees, trees))
        lines.append(f"| {name} | {result['first']:.2f} | {result['second']:.2f} | {'yes' if same else 'no'} |")
        print(lines[-1], flush=True)
    return lines


def cold() -> list[str]:
    lines = ["| process (each its own empty cache folder) | first fit s | second fit s | store's export s | "
             "compiles above 0.15 s |", "|---|---|---|---|---|"]
    for turn in range(2):
        for flag in ("1", "0"):
            folder = tempfile.mkdtemp(prefix="jaxboost_cold_")
            result, log = child(folder, flag, os.path.join(folder, "trees.npz"), log_compiles=True)
            if result is None:
                lines.append(f"| store={flag}, turn {turn + 1} | failed | | | |")
                continue
            compiles = [f"{found.group(1)} {float(found.group(2)):.2f}"
                        for found in re.finditer(r"Finished XLA compilation of (\S+) in ([0-9.e-]+) sec", log)
                        if float(found.group(2)) > 0.15]
            lines.append(f"| {'store' if flag == '1' else 'no store'}, turn {turn + 1} | {result['first']:.2f} | "
                         f"{result['second']:.2f} | {result['export']:.2f} | {', '.join(compiles)} |")
            print(lines[-1], flush=True)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the repeats' fits")
    parser.add_argument("--parts", default="repeats,store,cold")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    parts = args.parts.split(",")
    text = ["# Repeated fits and a new process's first fit", "",
            f"- command: `python experiments/gpu_first_fits.py --rows {args.rows} --parts {args.parts}`",
            f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}", ""]
    # The children first: the repeats part imports JAX in this process.
    sections = {"store": store if "store" in parts else None, "cold": cold if "cold" in parts else None}
    results = {name: function() for name, function in sections.items() if function is not None}
    if "repeats" in parts:
        text += ["## Repeats", ""] + repeats(args.rows) + [""]
    for name, lines in results.items():
        text += [f"## {name.capitalize()}", ""] + lines + [""]
    print("\n".join(text))
    if args.output:
        args.output.write_text("\n".join(text))


if __name__ == "__main__":
    main()
