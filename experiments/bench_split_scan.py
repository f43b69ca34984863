"""Micro-benchmark of the native split scan of scalar leaves: microseconds a node, by how many
rows the nodes hold.

Run from the repository root: ``python experiments/bench_split_scan.py`` (``--features``,
``--bins``, ``--directions``, ``--repeats``, ``--output FILE.md``). One level of 32 node slots is
scanned by ``split.find_best_splits_of_live_nodes(kernel="native")`` (one FFI call, one CPU
device); each node's histogram holds ``rows`` rows dropped into random bins of each feature
(normal gradients, unit Hessians), so a node of few rows has most of its bins empty (the
kernel's sparse path) and one of thousands has them all held (its dense path). ``--directions
2`` puts rows in the missing-value bin too, so both of its directions are scanned. Reported: the
median time of a call with every slot scanned, less that of the same call with no slot scanned
(the call's XLA work and dispatch), per node; the calls of the two kinds alternate.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxboost.regularizer import Regularization  # noqa: E402
from jaxboost.split import find_best_splits_of_live_nodes  # noqa: E402

SLOTS = 32
ROWS_A_NODE = (6, 25, 60, 100, 200, 2000)


def level_histograms(rng, features: int, bins: int, rows: int, missing: bool) -> np.ndarray:
    """(SLOTS, features, bins, 2) sums of ``rows`` rows a node, each feature's rows in random
    value bins (and with ``missing``, a tenth of them in the last, missing-value bin)."""
    histograms = np.zeros((SLOTS, features, bins, 2), np.float32)
    for node in range(SLOTS):
        for feature in range(features):
            codes = rng.integers(0, bins - 1, rows)
            if missing:
                codes[rng.uniform(size=rows) < 0.1] = bins - 1
            np.add.at(histograms[node, feature, :, 0], codes, rng.normal(size=rows).astype(np.float32))
            np.add.at(histograms[node, feature, :, 1], codes, 1.0)
    return histograms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=28)
    parser.add_argument("--bins", type=int, default=256, help="bins a feature, the missing-value bin included")
    parser.add_argument("--directions", type=int, choices=(1, 2), default=1,
                        help="1: no missing values; 2: missing values, both directions scanned")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    missing = args.directions == 2
    reg = Regularization(np.float32(1.0), np.float32(0.0), np.float32(0.0)).with_max_delta_step(0.0)
    allowed = np.ones((SLOTS, args.features), bool)
    scan = jax.jit(lambda histograms, live: find_best_splits_of_live_nodes(
        histograms, allowed, reg, np.float32(1.0), live_nodes=live, missing_values=missing, kernel="native"))
    lines = [f"# The native split scan, us a node ({args.features} features x {args.bins} bins, "
             f"{args.directions} direction(s))", "",
             f"- command: `python experiments/bench_split_scan.py --features {args.features} --bins {args.bins} "
             f"--directions {args.directions} --repeats {args.repeats}`",
             f"- {platform.processor() or platform.machine()}; jax {jax.__version__}; medians of {args.repeats} "
             "alternating calls", "",
             "| rows a node | bins held | us a node |", "|---|---|---|"]
    for rows in ROWS_A_NODE:
        histograms = jnp.asarray(level_histograms(rng, args.features, args.bins, rows, missing))
        held = float(np.mean(np.any(np.asarray(histograms)[..., :-1, :] != 0, axis=-1)))
        everything, nothing = jnp.int32(SLOTS), jnp.int32(0)
        jax.block_until_ready(scan(histograms, everything))
        jax.block_until_ready(scan(histograms, nothing))
        scanned, empty = [], []
        for _ in range(args.repeats):
            for live, times in ((everything, scanned), (nothing, empty)):
                start = time.perf_counter()
                jax.block_until_ready(scan(histograms, live))
                times.append(time.perf_counter() - start)
        per_node = (statistics.median(scanned) - statistics.median(empty)) / SLOTS * 1e6
        lines.append(f"| {rows} | {held:.0%} | {per_node:.2f} |")
        print(lines[-1], flush=True)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
