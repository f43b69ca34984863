"""Micro-benchmark of the histogram kernels: XLA scatter vs the native CPU kernel, in one process.

Run from the repository root: ``python experiments/bench_histogram.py`` (``--rows``, ``--nodes``,
``--repeats``). Every kernel runs on one device and one thread, interleaved with the others, on
the same data: ``--rows`` x 28 uint8 codes, 256 bins, a random node per row out of K, and a row
mask keeping a fraction of the rows (1.0: every row, as at the root; 0.4: the smaller children of
a level). Reported: median wall and process-CPU milliseconds per call and the ratio to the XLA
kernel; on a busy machine trust the CPU column and the ratios more than the wall times.

Kernels:
* xla: ``build_histogram(kernel="xla")``, rows outside the mask add zeros;
* native: ``build_histogram(kernel="native", row_mask=...)``, rows outside the mask are skipped;
* xla route+hist / native route+hist: ``route_and_build_histogram`` (row routing to the children
  of a level's splits fused with the smaller children's histograms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from jaxboost.histogram import build_histogram, route_and_build_histogram

N_FEATURES = 28
MAX_BIN = 256


def timed(fn, args):
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.4])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    device = jax.devices("cpu")[0]
    X_T = jax.device_put(rng.integers(0, MAX_BIN, size=(N_FEATURES, args.rows), dtype=np.uint8), device)
    g = jax.device_put(rng.normal(size=args.rows).astype(np.float32), device)
    h = jax.device_put(rng.uniform(0.1, 1.0, size=args.rows).astype(np.float32), device)
    print(f"rows {args.rows:,} x {N_FEATURES} features, {MAX_BIN} bins; jax {jax.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| nodes K | rows kept | kernel | wall ms | CPU ms | CPU vs xla |")
    print("|---|---|---|---|---|---|")
    for num_nodes in args.nodes:
        nodes = jax.device_put(rng.integers(0, num_nodes, size=args.rows).astype(np.int32), device)
        for fraction in args.fractions:
            mask = jax.device_put(rng.uniform(size=args.rows) < fraction, device)
            kernels = {
                kernel: (jax.jit(partial(build_histogram, num_nodes=num_nodes, max_bin=MAX_BIN, kernel=kernel)),
                         (X_T, nodes, g, h), {"row_mask": mask})
                for kernel in ("xla", "native")
            }
            # A level whose nodes all split, with the smaller child chosen so that about
            # `fraction` of the rows is histogrammed (thresholds at the matching quantile).
            threshold = np.full(num_nodes, int(MAX_BIN * min(fraction, 1 - fraction)) if fraction < 1 else MAX_BIN - 2,
                                np.int32)
            level = (jnp.asarray(rng.integers(0, N_FEATURES, num_nodes).astype(np.int32)), jnp.asarray(threshold),
                     jnp.zeros(num_nodes, bool), jnp.ones(num_nodes, bool), jnp.ones(num_nodes, bool))
            for kernel in ("xla", "native"):
                kernels[f"{kernel} route+hist"] = (
                    jax.jit(partial(route_and_build_histogram, max_bin=MAX_BIN, kernel=kernel)),
                    (X_T, nodes, g, h, *level), {})
            calls = {name: partial(fn, **kwargs) for name, (fn, _, kwargs) in kernels.items()}
            inputs = {name: call_args for name, (_, call_args, _) in kernels.items()}
            reference = np.asarray(calls["xla"](*inputs["xla"]))
            np.testing.assert_allclose(np.asarray(calls["native"](*inputs["native"])), reference, rtol=1e-4, atol=1e-2)
            times = {name: [] for name in calls}
            for _ in range(args.repeats):
                for name, call in calls.items():
                    times[name].append(timed(call, inputs[name]))
            base_cpu = statistics.median(cpu for _, cpu in times["xla"])
            for name, samples in times.items():
                wall = statistics.median(w for w, _ in samples)
                cpu = statistics.median(c for _, c in samples)
                print(f"| {num_nodes} | {fraction:.0%} | {name} | {1e3 * wall:.1f} | {1e3 * cpu:.1f} | "
                      f"{cpu / base_cpu:.2f} |", flush=True)


if __name__ == "__main__":
    main()
