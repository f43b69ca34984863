"""Benchmark: small multiclass data, scikit-learn's digits (1797 x 64, 10 classes).

Run from the repository root: ``python experiments/bench_digits.py`` (``--repeats``,
``--rounds``, ``--depth``). jaxboost (softmax, one tree per class a round), XGBoost
(``multi:softprob``, ``hist``) and LightGBM (``multiclass``, depth-limited leaves) train on all
rows in one process, their fits taking turns after a warm-up fit each (jaxboost's compiles
there); each library's median wall time a fit is printed, with its ratio to XGBoost's and the
median of the ratios of fits taken in the same turn. jaxboost's logistic loss on the same rows
(digit > 4) is timed too: the time of one tree a round, against which the ten trees of a
softmax round can be read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxboost as jb  # noqa: E402
from fits_in_turns import time_in_turns, turns_table  # noqa: E402


def fits(rounds: int, depth: int, threads: int) -> dict:
    """Each library's fit on digits, as a function of nothing."""
    import lightgbm as lgb
    import xgboost as xgb

    X, y = load_digits(return_X_y=True)
    classes = int(y.max()) + 1
    dataset, binary = jb.Dataset(X, y), jb.Dataset(X, (y > 4).astype(np.float32))
    return {
        "jaxboost": lambda: jb.train(dataset, loss="softmax", num_rounds=rounds, max_depth=depth, learning_rate=0.1),
        "xgboost": lambda: xgb.train({"objective": "multi:softprob", "num_class": classes, "max_depth": depth,
                                      "eta": 0.1, "tree_method": "hist", "max_bin": 256, "nthread": threads},
                                     xgb.DMatrix(X, y), rounds),
        "lightgbm": lambda: lgb.train({"objective": "multiclass", "num_class": classes, "max_depth": depth,
                                       "num_leaves": 2 ** depth, "learning_rate": 0.1, "max_bin": 255,
                                       "min_data_in_leaf": 1, "verbose": -1, "num_threads": threads},
                                      lgb.Dataset(X, y), rounds),
        "jaxboost logistic (one tree a round)": lambda: jb.train(binary, loss="logistic", num_rounds=rounds,
                                                                 max_depth=depth, learning_rate=0.1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    threads = jb.available_cpu_cores()
    functions = fits(args.rounds, args.depth, threads)
    times = time_in_turns(functions, args.repeats)
    print(f"- command: `python experiments/bench_digits.py --repeats {args.repeats} --rounds {args.rounds} "
          f"--depth {args.depth}`")
    print(f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; digits 1797 x 64, 10 classes, {args.rounds} rounds of "
          f"depth {args.depth}, {threads} threads; medians of {args.repeats} fits a library, taken in turns\n")
    print(turns_table(times, args.rounds))


if __name__ == "__main__":
    main()
