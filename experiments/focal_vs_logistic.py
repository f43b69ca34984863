"""Focal loss vs logistic loss on imbalanced binary data (3% positives).

Run with ``python experiments/focal_vs_logistic.py`` (about two minutes on a 2-core CPU). For
several seeds it generates imbalanced data (``make_classification``, ``weights=[0.97, 0.03]``)
and trains, with the same rounds, depth, learning rate and lambda:

* jaxboost with a focal loss written below as a plain JAX function of one example, its ``gamma``
  bound with ``functools.partial`` (one partial object, reused for every seed);
* jaxboost with the built-in logistic loss;
* XGBoost ``binary:logistic`` (``tree_method="hist"``) as a reference.

It reports test PR-AUC (average precision), ROC-AUC, log loss and recall at precision >= 0.8,
as medians over the seeds, in ``experiments/results/focal_vs_logistic.md``, and plots the
precision-recall curves of one seed in ``focal_vs_logistic.png``.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jaxboost as jb  # import before any JAX computation: it gives JAX one CPU device per core

import jax
import numpy as np
import xgboost as xgb
from sklearn.datasets import make_classification
from sklearn.metrics import average_precision_score, log_loss, precision_recall_curve, roc_auc_score
from sklearn.model_selection import train_test_split

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
NUM_ROUNDS = 200
MAX_DEPTH = 4
LEARNING_RATE = 0.1
REG_LAMBDA = 1.0
GAMMA = 2.0
PRECISION_FLOOR = 0.8


def focal(raw_prediction, y, gamma):
    """Binary focal loss (Lin et al., 2017) on a logit: ``-(1 - p_true)^gamma * log(p_true)``, so
    well-classified examples count less; ``gamma = 0`` is the log loss."""
    margin = (2.0 * y - 1.0) * raw_prediction
    p_true = jax.nn.sigmoid(margin)
    return -((1.0 - p_true) ** gamma) * jax.nn.log_sigmoid(margin)


FOCAL = functools.partial(focal, gamma=GAMMA)


def recall_at_precision(y, score, floor=PRECISION_FLOOR) -> float:
    precision, recall, _ = precision_recall_curve(y, score)
    reachable = recall[precision >= floor]
    return float(reachable.max()) if reachable.size else 0.0


def metrics(y, probability) -> dict:
    probability = np.clip(probability, 1e-7, 1 - 1e-7)
    return {"PR-AUC": average_precision_score(y, probability), "ROC-AUC": roc_auc_score(y, probability),
            "log loss": log_loss(y, probability),
            f"recall @ precision {PRECISION_FLOOR}": recall_at_precision(y, probability)}


def run_seed(seed: int):
    X, y = make_classification(n_samples=20_000, n_features=20, n_informative=6, n_redundant=4, weights=[0.97, 0.03],
                               flip_y=0.01, class_sep=0.8, random_state=seed)
    X = X.astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.5, random_state=seed, stratify=y)
    common = dict(num_rounds=NUM_ROUNDS, max_depth=MAX_DEPTH, learning_rate=LEARNING_RATE, reg_lambda=REG_LAMBDA,
                  seed=seed)
    probabilities = {
        f"jaxboost focal (gamma={GAMMA:g})": jb.train(X_train, y_train, loss=FOCAL, link="sigmoid", **common).predict(X_test),
        "jaxboost logistic": jb.train(X_train, y_train, loss="logistic", **common).predict(X_test),
    }
    booster = xgb.train({"objective": "binary:logistic", "tree_method": "hist", "max_depth": MAX_DEPTH,
                         "eta": LEARNING_RATE, "lambda": REG_LAMBDA, "max_bin": 256, "nthread": 2, "seed": seed},
                        xgb.DMatrix(X_train, label=y_train), num_boost_round=NUM_ROUNDS)
    probabilities["XGBoost logistic"] = booster.predict(xgb.DMatrix(X_test))
    return y_test, probabilities


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    started = time.time()
    RESULTS.mkdir(exist_ok=True)
    per_seed = []
    curves = None
    for seed in range(args.seeds):
        y_test, probabilities = run_seed(seed)
        per_seed.append({name: metrics(y_test, p) for name, p in probabilities.items()})
        if curves is None:
            curves = (y_test, probabilities)
        print(f"seed {seed}: {time.time() - started:.0f} s", flush=True)
    names = list(per_seed[0])
    metric_names = list(per_seed[0][names[0]])
    table = ["| model | " + " | ".join(metric_names) + " |", "|---" * (len(metric_names) + 1) + "|"]
    for name in names:
        cells = []
        for metric in metric_names:
            values = [seed_metrics[name][metric] for seed_metrics in per_seed]
            cells.append(f"{np.median(values):.4f} ({min(values):.3f}-{max(values):.3f})")
        table.append(f"| {name} | " + " | ".join(cells) + " |")
    focal_name, logistic_name = names[0], names[1]
    wins = {metric: sum((seed_metrics[focal_name][metric] < seed_metrics[logistic_name][metric]) == (metric == "log loss")
                        for seed_metrics in per_seed) for metric in metric_names}
    paired = {metric: np.median([seed_metrics[focal_name][metric] - seed_metrics[logistic_name][metric]
                                 for seed_metrics in per_seed]) for metric in metric_names}
    seconds = time.time() - started
    header = [
        "# Focal loss vs logistic loss on imbalanced data",
        "",
        f"- command: `python experiments/focal_vs_logistic.py --seeds {args.seeds}` ({seconds:.0f} s)",
        "- data: `make_classification(n_samples=20000, n_features=20, n_informative=6, n_redundant=4, "
        "weights=[0.97, 0.03], flip_y=0.01, class_sep=0.8, random_state=seed)`, 50/50 stratified train/test split.",
        f"- models: {NUM_ROUNDS} rounds, depth {MAX_DEPTH}, learning rate {LEARNING_RATE}, lambda {REG_LAMBDA}; "
        f"focal loss = a plain JAX function with `gamma` bound by `functools.partial`, `link=\"sigmoid\"`.",
        f"- cells: test-set median over {args.seeds} seeds (min-max). Log loss of the focal model uses "
        "sigmoid(raw) as the probability: focal loss is not a proper scoring rule, so it is expected to be worse there.",
        "- focal better than jaxboost logistic in: " + ", ".join(f"{metric} {count}/{args.seeds} seeds"
                                                                 for metric, count in wins.items()) + ".",
        "- median paired difference, focal minus jaxboost logistic (same seed): "
        + ", ".join(f"{metric} {value:+.4f}" for metric, value in paired.items()) + ".",
        "",
    ]
    text = "\n".join(header + table) + "\n"
    (RESULTS / "focal_vs_logistic.md").write_text(text)
    print(text)
    write_plot(*curves)


def write_plot(y_test, probabilities):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 5))
    for name, probability in probabilities.items():
        precision, recall, _ = precision_recall_curve(y_test, probability)
        axis.plot(recall, precision, label=f"{name} (AP {average_precision_score(y_test, probability):.3f})")
    axis.axhline(PRECISION_FLOOR, color="grey", linestyle=":", label=f"precision {PRECISION_FLOOR}")
    axis.set_xlabel("recall")
    axis.set_ylabel("precision")
    axis.set_title(f"Precision-recall, {y_test.mean():.1%} positives (seed 0, test split)")
    axis.legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(RESULTS / "focal_vs_logistic.png", dpi=110)


if __name__ == "__main__":
    main()
