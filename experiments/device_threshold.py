"""Study: training on one CPU device against rows sharded over every device, by rows, depth and
features, for choosing ``devices.MIN_ROWS_SHARDED`` (the rows from which jaxboost shards
training rows over the cores, rather than keep them on one device whose kernels take the cores
by ranges of rows).

Run from the repository root: ``python experiments/device_threshold.py --rows 30000,60000,100000
--depths 6,8 --features 28``. For each shape it fits the benchmark's classification data
(``make_classification``, all rows train) in one process, alternating between one device whose
kernels sum the rows in one pass, one device whose kernels sum them in ranges, one a core
(``devices.ROWS_IN_RANGES``), and every device (``MIN_ROWS_SHARDED`` and
``MIN_ROWS_PER_DEVICE`` set before each fit; the rounds of each are compiled on the first turn),
and prints ms a tree by the difference method ((``--rounds``-round fit - 1-round fit) /
(rounds - 1)), the median of ``--turns`` turns. The trees of the three are not the same bit for
bit: the rows are summed in other orders.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from sklearn.datasets import make_classification  # noqa: E402

import jaxboost as jb  # noqa: E402


def ms_a_tree(dataset: jb.Dataset, rounds: int, settings: dict) -> float:
    """The difference method's ms a tree for one fit of ``rounds`` against one of 1 round."""
    jb.train(dataset, num_rounds=1, **settings)  # compiled (or found) before the timed fits
    start = time.perf_counter()
    jb.train(dataset, num_rounds=1, **settings)
    one = time.perf_counter() - start
    start = time.perf_counter()
    jb.train(dataset, num_rounds=rounds, **settings)
    many = time.perf_counter() - start
    return (many - one) / (rounds - 1) * 1000


LABELS = {"one": "one device", "ranges": "one device, ranges", "all": "sharded"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="30000,60000,100000", help="comma-separated row counts")
    parser.add_argument("--depths", default="6", help="comma-separated tree depths")
    parser.add_argument("--features", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    devices = jb.available_cpu_cores()
    print(f"- command: `python experiments/device_threshold.py --rows {args.rows} --depths {args.depths} "
          f"--features {args.features} --rounds {args.rounds} --turns {args.turns}`")
    print(f"- {devices} cores; medians of {args.turns} alternating turns; ms a tree\n")
    print(f"| rows | depth | one device | one device, rows in {devices} ranges | {devices} devices | fastest |\n"
          "|---|---|---|---|---|---|")
    for rows in (int(value) for value in args.rows.split(",")):
        X, y = make_classification(n_samples=rows, n_features=args.features,
                                   n_informative=min(14, args.features - 2),
                                   n_redundant=min(4, max(0, args.features - 16)), random_state=0)
        dataset = jb.Dataset(X.astype(np.float32), y)
        for depth in (int(value) for value in args.depths.split(",")):
            settings = dict(loss="logistic", max_depth=depth, learning_rate=0.1, reg_lambda=1.0,
                            min_child_weight=1.0)
            times = {"one": [], "ranges": [], "all": []}
            for _ in range(args.turns):
                for name, sharded_from, in_ranges in (("one", rows + 1, False), ("ranges", rows + 1, True),
                                                      ("all", 0, False)):
                    jb.devices.MIN_ROWS_SHARDED = sharded_from
                    jb.devices.MIN_ROWS_PER_DEVICE = rows + 1 if sharded_from else 1
                    jb.devices.ROWS_IN_RANGES = in_ranges
                    times[name].append(ms_a_tree(dataset, args.rounds, settings))
            medians = {name: statistics.median(values) for name, values in times.items()}
            fastest = min(medians, key=medians.get)
            print(f"| {rows:,} | {depth} | {medians['one']:.2f} | {medians['ranges']:.2f} | {medians['all']:.2f} | "
                  f"{LABELS[fastest]} |", flush=True)


if __name__ == "__main__":
    main()
