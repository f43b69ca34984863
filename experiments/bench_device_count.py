"""Benchmark: jaxboost's ms a tree on CPU against the number of JAX host devices the rows are
sharded over, with XGBoost (all threads) beside, in alternating fresh processes.

jaxboost gives JAX one host device per core by default; this checks that choice on a machine
(and XLA options with it) by the benchmark's classification task and difference method: (a
100-round train - a 1-round train) / 99 in a warm process, the median of 3 such pairs a process.

Usage: python experiments/bench_device_count.py [--rows 1000000] [--devices 16,8,4] [--turns 2]
           [--extra-flags="--xla_cpu_multi_thread_eigen=false"]
(one process per setting per turn; ``--extra-flags=...`` adds a setting: the first device count with
those XLA flags). Prints one line a process and the medians; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXPERIMENTS = Path(__file__).parent
PAIRS = 3


def ms_per_tree(library: str, rows: int) -> float:
    """In this process: the median ms a tree of PAIRS (100-round - 1-round) / 99 pairs."""
    sys.path.insert(0, str(EXPERIMENTS))
    from bench_worker import make_task

    X, _, y, _ = make_task("classification", rows)
    if library == "xgboost":
        import xgboost as xgb

        dataset = xgb.QuantileDMatrix(X, y, max_bin=256)
        params = dict(objective="binary:logistic", tree_method="hist", max_depth=6, eta=0.1, max_bin=256,
                      reg_lambda=1.0, min_child_weight=1.0)
        train = lambda rounds: xgb.train(params, dataset, num_boost_round=rounds)  # noqa: E731
    else:
        import jaxboost as jb

        dataset = jb.Dataset(X, y)
        train = lambda rounds: jb.train(dataset, num_rounds=rounds, loss="logistic", max_depth=6,  # noqa: E731
                                        learning_rate=0.1, reg_lambda=1.0, min_child_weight=1.0)
    train(1)  # compiles (jaxboost), warms the caches

    def seconds(rounds: int) -> float:
        start = time.perf_counter()
        train(rounds)
        return time.perf_counter() - start

    return statistics.median((seconds(100) - seconds(1)) / 99 * 1e3 for _ in range(PAIRS))


def run_setting(label: str, library: str, rows: int, xla_flags: str) -> float:
    environment = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    result = subprocess.run([sys.executable, __file__, "--child", library, "--rows", str(rows)],
                            env=environment, capture_output=True, text=True, check=True)
    value = float(result.stdout.strip().splitlines()[-1])
    print(f"{label}: {value:.2f} ms/tree", flush=True)
    return value


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--devices", default=str(os.cpu_count()), help="comma-separated device counts")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--extra-flags", default="", help="XLA flags of one more setting, at the first count")
    parser.add_argument("--child", choices=("jaxboost", "xgboost"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(ms_per_tree(args.child, args.rows))
        return
    counts = [int(count) for count in args.devices.split(",")]
    device_flag = "--xla_force_host_platform_device_count="
    settings = [(f"jaxboost, {count} device{'s' * (count != 1)}", "jaxboost", f"{device_flag}{count}") for count in counts]
    if args.extra_flags:
        settings.append((f"jaxboost, {counts[0]} devices, {args.extra_flags}", "jaxboost",
                         f"{device_flag}{counts[0]} {args.extra_flags}"))
    settings.append((f"xgboost, {os.cpu_count()} threads", "xgboost", ""))
    times: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    for _ in range(args.turns):
        for label, library, flags in settings:
            times[label].append(run_setting(label, library, args.rows, flags))
    print("\n| setting | ms/tree, each turn | median |\n|---|---|---|")
    for label, values in times.items():
        print(f"| {label} | {', '.join(f'{value:.2f}' for value in values)} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
