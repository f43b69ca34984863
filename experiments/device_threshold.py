"""Study: training on one CPU device against rows sharded over every device, by rows, depth and
features, for choosing ``devices.MIN_ROWS_PER_DEVICE`` (the rows a device needs before jaxboost
shards training rows over the cores).

Run from the repository root: ``python experiments/device_threshold.py --rows 30000,60000,100000
--depths 6,8 --features 28``. For each shape it fits the benchmark's classification data
(``make_classification``, all rows train) in one process, alternating between one device and
every device (``MIN_ROWS_PER_DEVICE`` set either way before each fit; the rounds of each are
compiled on the first turn), and prints ms a tree by the difference method ((``--rounds``-round
fit - 1-round fit) / (rounds - 1)), the median of ``--turns`` turns. The trees of the two are not
the same bit for bit: sharded rows are summed in another order.
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
    print(f"| rows | depth | one device | {devices} devices | faster |\n|---|---|---|---|---|")
    for rows in (int(value) for value in args.rows.split(",")):
        X, y = make_classification(n_samples=rows, n_features=args.features,
                                   n_informative=min(14, args.features - 2),
                                   n_redundant=min(4, max(0, args.features - 16)), random_state=0)
        dataset = jb.Dataset(X.astype(np.float32), y)
        for depth in (int(value) for value in args.depths.split(",")):
            settings = dict(loss="logistic", max_depth=depth, learning_rate=0.1, reg_lambda=1.0,
                            min_child_weight=1.0)
            times = {"one": [], "all": []}
            for _ in range(args.turns):
                for name, min_rows in (("one", rows + 1), ("all", 1)):
                    jb.devices.MIN_ROWS_PER_DEVICE = min_rows
                    times[name].append(ms_a_tree(dataset, args.rounds, settings))
            one, sharded = (statistics.median(times[name]) for name in ("one", "all"))
            print(f"| {rows:,} | {depth} | {one:.2f} | {sharded:.2f} | {'one' if one < sharded else 'sharded'} |",
                  flush=True)


if __name__ == "__main__":
    main()
