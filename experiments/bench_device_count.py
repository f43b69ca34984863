"""Benchmark: jaxboost's ms a tree on CPU against the number of JAX host devices the rows are
sharded over, with XGBoost (all threads) beside, in alternating fresh processes.

jaxboost gives JAX one host device per core by default; this checks that choice on a machine
(and XLA options with it). Each process is one run of the benchmark's worker
(``bench_worker.py``, the classification task without predictions: ms a tree by its difference
method), with ``XLA_FLAGS`` choosing the number of host devices.

Usage: python experiments/bench_device_count.py [--rows 1000000] [--devices 16,8,4] [--turns 2]
           [--extra-flags="--xla_cpu_multi_thread_eigen=false"]
(one process per setting per turn; ``--extra-flags=...`` adds a setting: the first device count
with those XLA flags). Prints one line a process and the medians; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench import run_worker

DEVICE_FLAG = "--xla_force_host_platform_device_count="


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--devices", default=str(os.cpu_count()), help="comma-separated device counts")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--extra-flags", default="", help="XLA flags of one more setting, at the first count")
    args = parser.parse_args()
    counts = [int(count) for count in args.devices.split(",")]
    settings = [(f"jaxboost, {count} device{'s' * (count != 1)}", "jaxboost", f"{DEVICE_FLAG}{count}")
                for count in counts]
    if args.extra_flags:
        settings.append((f"jaxboost, {counts[0]} devices, {args.extra_flags}", "jaxboost",
                         f"{DEVICE_FLAG}{counts[0]} {args.extra_flags}"))
    settings.append((f"xgboost, {os.cpu_count()} threads", "xgboost", os.environ.get("XLA_FLAGS", "")))
    times: dict[str, list[float]] = {label: [] for label, _, _ in settings}
    for _ in range(args.turns):
        for label, library, flags in settings:
            result = run_worker(["--library", library, "--task", "classification", "--rows", str(args.rows),
                                 "--no-predict"], extra_env={"XLA_FLAGS": flags})
            if result["status"] != "ok":
                raise SystemExit(f"{label}: {result['status']}")
            times[label].append(result["ms_per_tree"])
            print(f"{label}: {result['ms_per_tree']:.2f} ms/tree", flush=True)
    print("\n| setting | ms/tree, each turn | median |\n|---|---|---|")
    for label, values in times.items():
        print(f"| {label} | {', '.join(f'{value:.2f}' for value in values)} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
