"""Benchmark: what a custom leaf penalty costs a round, against the built-in L2 penalty.

Run from the repository root: ``python experiments/bench_penalty.py`` (``--rows``, ``--rounds``,
``--depth``, ``--repeats``). A custom penalty (``jb.regularizers.custom``) has no closed-form
leaf value: the split scan finds every candidate's two leaf values by safeguarded Newton steps
on the penalty's autodiff derivatives, in XLA, where the built-in penalties take the native
scan's closed form. On the main benchmark's classification data (``make_classification``, 28
features, 80% for training) it trains, in turns in one process:

* ``built-in L2``: ``reg_lambda=1``;
* ``custom quadratic``: the same objective written as a custom penalty, ``0.5 w^2``; the
  models agree to float32 rounding (the largest difference of their test probabilities is
  printed);
* ``custom smooth L1``: ``1.5 (sqrt(w^2 + 0.01) - 0.1)`` with ``reg_lambda=1``, whose Newton
  steps need their safeguards.

It prints the ms a fit and a round of each (medians, and the run-by-run ratios to the built-in
penalty's fit of the same turn).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import make_classification  # noqa: E402

import jaxboost as jb  # noqa: E402
from fits_in_turns import time_in_turns, turns_table  # noqa: E402


def quadratic(w, params):
    return 0.5 * w * w


def smooth_l1(w, params):
    return 1.5 * (jnp.sqrt(w * w + 0.01) - 0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=25_000, help="rows generated (80%% train)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    X, y = make_classification(n_samples=args.rows, n_features=28, n_informative=14, n_redundant=4, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.float32)
    train = int(0.8 * args.rows)
    dataset = jb.Dataset(X[:train], y[:train])
    settings = dict(loss="logistic", num_rounds=args.rounds, max_depth=args.depth, learning_rate=0.1,
                    min_child_weight=1.0)
    penalties = {"built-in L2": dict(reg_lambda=1.0),
                 "custom quadratic": dict(regularizer=jb.regularizers.custom(quadratic)),
                 "custom smooth L1": dict(regularizer=jb.regularizers.custom(smooth_l1, reg_lambda=1.0))}
    models = {}

    def fit(name):
        return lambda: models.__setitem__(name, jb.train(dataset, **settings, **penalties[name]))

    compile_start = time.perf_counter()
    for name in penalties:
        fit(name)()
    first_fits = time.perf_counter() - compile_start
    times = time_in_turns({name: fit(name) for name in penalties}, args.repeats)
    difference = np.abs(models["custom quadratic"].predict(X[train:]) - models["built-in L2"].predict(X[train:])).max()
    print(f"- command: `python experiments/bench_penalty.py --rows {args.rows} --rounds {args.rounds} "
          f"--depth {args.depth} --repeats {args.repeats}`")
    print(f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; {train} training rows x 28, {args.rounds} rounds of depth "
          f"{args.depth}, {jb.available_cpu_cores()} cores; medians of {args.repeats} fits each, taken in turns "
          f"(the first fits, compiling: {first_fits:.1f} s together)")
    print(f"- custom quadratic against built-in L2: test probabilities differ by at most {difference:.1e}\n")
    print(turns_table(times, args.rounds, reference="built-in L2", reference_label="built-in L2",
                      first_column="penalty"))


if __name__ == "__main__":
    main()
