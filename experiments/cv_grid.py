"""5-fold cross-validated grid over reg_lambda x learning_rate, every model in one compiled program.

Each (fold, lambda, learning rate) triple is one model of ``jb.train_many``: folds are 0/1
sample weights, lambda and the learning rate are batched hyperparameters, and the bin edges are
built once. The script reports the validation RMSE surface (mean over folds) for two datasets
(scikit-learn's diabetes and Friedman #1), the best cell, the time of the one batched call
against one model trained alone, and writes ``experiments/results/cv_grid.png`` and
``experiments/results/cv_grid.md``.

Usage: python experiments/cv_grid.py
"""

from __future__ import annotations

import pathlib
import time

import numpy as np
from sklearn.datasets import load_diabetes, make_friedman1

import jaxboost as jb

RESULTS = pathlib.Path(__file__).parent / "results"
LAMBDAS = np.array([0.0, 0.3, 1.0, 3.0, 10.0, 30.0])
RATES = np.array([0.02, 0.05, 0.1, 0.2, 0.4])
FOLDS = 5
ROUNDS = 150


def cross_validated_grid(X, y, max_depth):
    n = len(y)
    fold_of_row = np.random.default_rng(0).permutation(n) % FOLDS
    lam, rate, fold = np.meshgrid(LAMBDAS, RATES, np.arange(FOLDS), indexing="ij")
    lam, rate, fold = lam.ravel(), rate.ravel(), fold.ravel()
    weights = np.stack([(fold_of_row != k).astype(np.float32) for k in fold])
    data = jb.Dataset(X, y)
    start = time.perf_counter()
    models = jb.train_many(data, batch={"reg_lambda": lam, "learning_rate": rate}, sample_weights=weights,
                           num_rounds=ROUNDS, max_depth=max_depth)
    batched_seconds = time.perf_counter() - start
    start = time.perf_counter()
    jb.train(jb.Dataset(X, y, sample_weight=weights[0], bin_edges=data.bin_edges), num_rounds=ROUNDS,
             max_depth=max_depth, reg_lambda=float(lam[0]), learning_rate=float(rate[0]))
    single_seconds = time.perf_counter() - start
    rmse = np.array([np.sqrt(np.mean((model.predict(X[fold_of_row == k]) - y[fold_of_row == k]) ** 2))
                     for model, k in zip(models, fold)])
    surface = rmse.reshape(len(LAMBDAS), len(RATES), FOLDS).mean(axis=2)
    return surface, len(models), batched_seconds, single_seconds


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diabetes = load_diabetes()
    friedman_X, friedman_y = make_friedman1(n_samples=5000, noise=1.0, random_state=0)
    datasets = {"diabetes (442 x 10)": (diabetes.data.astype(np.float32), diabetes.target.astype(np.float32), 3),
                "Friedman #1 (5000 x 10)": (friedman_X.astype(np.float32), friedman_y.astype(np.float32), 4)}
    figure, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5))
    lines = ["# Cross-validated grid in one program (`python experiments/cv_grid.py`)", "",
             f"{FOLDS}-fold CV, {len(LAMBDAS)} lambdas x {len(RATES)} learning rates, {ROUNDS} rounds: "
             f"{FOLDS * len(LAMBDAS) * len(RATES)} models per dataset trained by one `jb.train_many` call.", "",
             "| dataset | models | one batched call (s) | one model alone (s) | ratio | best lambda | best rate | "
             "best CV RMSE |", "|---|---|---|---|---|---|---|---|"]
    for axis, (name, (X, y, depth)) in zip(axes, datasets.items()):
        surface, count, batched, single = cross_validated_grid(X, y, depth)
        i, j = np.unravel_index(np.argmin(surface), surface.shape)
        lines.append(f"| {name} | {count} | {batched:.1f} | {single:.1f} | {batched / single:.1f}x | {LAMBDAS[i]:g} | "
                     f"{RATES[j]:g} | {surface[i, j]:.3f} |")
        image = axis.imshow(surface, origin="lower", cmap="viridis", aspect="auto")
        axis.set_xticks(range(len(RATES)), [f"{r:g}" for r in RATES])
        axis.set_yticks(range(len(LAMBDAS)), [f"{v:g}" for v in LAMBDAS])
        axis.set_xlabel("learning rate")
        axis.set_ylabel("reg_lambda")
        axis.set_title(f"{name}: CV RMSE")
        axis.plot(j, i, "r*", markersize=14)
        for (a, b), value in np.ndenumerate(surface):
            axis.text(b, a, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white")
        figure.colorbar(image, ax=axis)
        print(lines[-1])
    figure.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    figure.savefig(RESULTS / "cv_grid.png", dpi=120)
    lines += ["", "Times include compilation (one trace for all models). The batched call grows every model's "
              "trees in the same compiled round."]
    (RESULTS / "cv_grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
