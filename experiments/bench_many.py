"""Benchmark: K models in one ``jb.train_many`` program against one model trained alone.

The issue's target: K = 16 models on 100k x 20 rows, 100 rounds, depth 6, in <= 4x the time of
one. Models differ in reg_lambda, learning rate and seed (subsample 0.8). Reports medians of
``--repeats`` runs, compile (first call) separately, and writes ``--output``
(``experiments/results/train_many.md``).

Usage: python experiments/bench_many.py [--models 16] [--rows 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import time

import jax
import numpy as np
from sklearn.datasets import make_regression

import jaxboost as jb

RESULTS = pathlib.Path(__file__).parent / "results"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scatter-variant", help="time the accelerators' histogram scatter of "
                        "experiments/scatter_variants.py of this name instead of the library's")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "train_many.md")
    args = parser.parse_args()
    if args.scatter_variant:
        import scatter_variants
        jb.histogram._pair_scatter_histogram = scatter_variants.VARIANTS[args.scatter_variant]
    X, y = make_regression(args.rows, args.features, n_informative=10, noise=10, random_state=0)
    data = jb.Dataset(X.astype(np.float32), y.astype(np.float32))
    K = args.models
    batch = {"reg_lambda": np.geomspace(0.1, 10, K), "learning_rate": np.linspace(0.05, 0.3, K)}
    settings = dict(num_rounds=args.rounds, max_depth=args.depth, subsample=0.8)

    def timed(function):
        start = time.perf_counter()
        function()
        return time.perf_counter() - start

    def one():
        jb.train(data, reg_lambda=1.0, learning_rate=0.1, seed=0, **settings)

    def many():
        jb.train_many(data, batch=batch, seeds=np.arange(K), **settings)

    first_one, first_many = timed(one), timed(many)  # include compilation
    ones = [timed(one) for _ in range(args.repeats)]
    manys = [timed(many) for _ in range(args.repeats)]
    one_s, many_s = float(np.median(ones)), float(np.median(manys))
    lines = [
        "# train_many: K models in one compiled program",
        "",
        f"Command: `python experiments/bench_many.py --models {K} --rows {args.rows} --repeats {args.repeats}"
        + (f" --scatter-variant '{args.scatter_variant}'" if args.scatter_variant else "") + "`",
        f"Machine: {platform.processor() or platform.machine()}, {jax.device_count()} JAX device(s) "
        f"({jax.default_backend()}), jax {jax.__version__}",
        "",
        f"{args.rows} x {args.features} regression, {args.rounds} rounds, depth {args.depth}, subsample 0.8; "
        f"models differ in reg_lambda, learning rate and seed. Medians of {args.repeats} runs.",
        "",
        "| | seconds | per model (s) | first call incl. compile (s) |",
        "|---|---|---|---|",
        f"| one model (`jb.train`) | {one_s:.2f} | {one_s:.2f} | {first_one:.2f} |",
        f"| {K} models (`jb.train_many`) | {many_s:.2f} | {many_s / K:.2f} | {first_many:.2f} |",
        "",
        f"**{K} models cost {many_s / one_s:.2f}x one model** (target <= 4x).",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
