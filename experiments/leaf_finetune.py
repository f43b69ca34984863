"""Leaf fine-tuning: adapt a trained model to an objective it was not trained on.

Run with ``python experiments/leaf_finetune.py`` (about two minutes on a 2-core CPU). For each
dataset and split seed it

1. trains a jaxboost logistic model (early stopping on a validation split);
2. fine-tunes its leaf values with ``jb.differentiable.fine_tune_leaves`` (tree shapes fixed)
   on the *training* rows for two objectives the trees were not grown for:
   * a smooth AUC surrogate: the mean over sampled (positive, negative) pairs of
     ``sigmoid(raw_negative - raw_positive)``, a non-decomposable objective;
   * a cost-sensitive log loss in which positives weigh 5x;
   each twice: the values after the last step, and the values of the best step on the
   validation split (early stopping);
3. reports the held-out (test) numbers before and after, as medians over the seeds.

It writes ``experiments/results/leaf_finetune.md`` and ``leaf_finetune.png`` (objective curves
on training and validation rows for one seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time

import jaxboost as jb  # import before any JAX computation: it gives JAX one CPU device per core

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_breast_cancer, make_classification
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split

from jaxboost import differentiable as jd

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
POSITIVE_WEIGHT = 5.0
STEPS = 300
PAIRS_PER_STEP = 20_000


def sampled_auc_surrogate(raw_prediction, y, key=None):
    """1 - smooth AUC of the standardised scores, on pairs drawn afresh every step (all pairs
    when no key is given). Standardising makes it depend on the ranking only: on raw margins,
    the sigmoid of differences also falls by merely scaling every score up."""
    scores = (raw_prediction - jnp.mean(raw_prediction)) / jnp.std(raw_prediction)
    return jd.pairwise_auc_loss(scores, y, temperature=0.3, num_pairs=None if key is None else PAIRS_PER_STEP,
                                key=key)


def weighted_log_loss(raw_prediction, y, positive_weight):
    """Mean log loss with positives weighing ``positive_weight``: a cost-sensitive objective."""
    weight = jnp.where(y > 0.5, positive_weight, 1.0)
    return jnp.sum(weight * (jax.nn.softplus(raw_prediction) - y * raw_prediction)) / jnp.sum(weight)


OBJECTIVES = {
    "smooth AUC surrogate": (sampled_auc_surrogate, optax.adam(3e-3)),
    f"log loss, positives x{POSITIVE_WEIGHT:g}": (functools.partial(weighted_log_loss, positive_weight=POSITIVE_WEIGHT),
                                                   optax.adam(3e-3)),
}


def datasets(seed: int):
    """(name, X, y) pairs: a real dataset and a larger noisy synthetic one."""
    X, y = load_breast_cancer(return_X_y=True)
    yield "breast_cancer (569 x 30)", X.astype(np.float32), y.astype(np.float64)
    X, y = make_classification(n_samples=12_000, n_features=20, n_informative=6, flip_y=0.1, class_sep=0.8,
                               weights=[0.8, 0.2], random_state=1000 + seed)
    yield "synthetic (12,000 x 20, 10% flipped labels)", X.astype(np.float32), y.astype(np.float64)


def held_out_metrics(model, X, y) -> dict:
    raw = jnp.asarray(model.predict_raw(X))
    labels = jnp.asarray(y)
    return {
        "AUC": roc_auc_score(y, np.asarray(raw)),
        "smooth AUC surrogate": float(sampled_auc_surrogate(raw, labels)),
        f"log loss, positives x{POSITIVE_WEIGHT:g}": float(weighted_log_loss(raw, labels, POSITIVE_WEIGHT)),
    }


def run_one(X, y, seed: int):
    X_rest, X_test, y_rest, y_test = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=y)
    X_train, X_val, y_train, y_val = train_test_split(X_rest, y_rest, test_size=0.25, random_state=seed,
                                                      stratify=y_rest)
    model = jb.train(X_train, y_train, loss="logistic", num_rounds=300, max_depth=4, learning_rate=0.1,
                     eval_set=[(X_val, y_val)], eval_metric="logloss", early_stopping_rounds=20, seed=seed)
    rows = {"before": held_out_metrics(model, X_test, y_test)}
    # Reference for the weighted loss: weighting positives by w moves the optimal logit by log(w),
    # which a shift of the base score alone achieves.
    shifted = dataclasses.replace(model, base_score=model.base_score + np.float32(np.log(POSITIVE_WEIGHT)))
    rows["base score + log w"] = held_out_metrics(shifted, X_test, y_test)
    curves = {}
    for name, (objective, optimizer) in OBJECTIVES.items():
        # Both runs share one compiled program (same objective, optimizer and shapes).
        last = jd.fine_tune_leaves(model, X_train, y_train, objective, optimizer=optimizer, steps=STEPS, seed=seed,
                                   X_val=X_val, y_val=y_val, restore_best=False)
        best = jd.fine_tune_leaves(model, X_train, y_train, objective, optimizer=optimizer, steps=STEPS, seed=seed,
                                   X_val=X_val, y_val=y_val)
        rows[(name, "last step")] = held_out_metrics(last, X_test, y_test)
        rows[(name, "early stopped")] = held_out_metrics(best, X_test, y_test)
        rows[(name, "best step")] = int(np.argmin(best.evals_result["fine_tune"]["validation_objective"]))
        curves[name] = best.evals_result["fine_tune"]
    return model, rows, curves


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.time()
    RESULTS.mkdir(exist_ok=True)
    table = []
    summary = []
    plotted = None
    for dataset_index in range(2):
        per_seed = []
        for seed in range(args.seeds):
            name, X, y = list(datasets(seed))[dataset_index]
            model, rows, curves = run_one(X, y, seed)
            per_seed.append(rows)
            if plotted is None and dataset_index == 1:
                plotted = (name, curves)
            print(f"{name} seed {seed}: rounds {model.best_iteration + 1}, {time.time() - started:.0f} s", flush=True)
        for objective in OBJECTIVES:
            metric = objective
            before = np.median([rows["before"][metric] for rows in per_seed])
            reference = (f"{np.median([rows['base score + log w'][metric] for rows in per_seed]):.4f}"
                         if "log loss" in objective else "n/a (shift-invariant)")
            last = np.median([rows[(objective, "last step")][metric] for rows in per_seed])
            stopped = np.median([rows[(objective, "early stopped")][metric] for rows in per_seed])
            auc_before = np.median([rows["before"]["AUC"] for rows in per_seed])
            auc_last = np.median([rows[(objective, "last step")]["AUC"] for rows in per_seed])
            auc_stopped = np.median([rows[(objective, "early stopped")]["AUC"] for rows in per_seed])
            better = sum(rows[(objective, "early stopped")][metric] < rows["before"][metric] for rows in per_seed)
            best_steps = [rows[(objective, "best step")] for rows in per_seed]
            reference_value = (np.median([rows["base score + log w"][metric] for rows in per_seed])
                               if "log loss" in objective else None)
            summary.append((name.split(" (")[0], objective, before, reference_value, last, stopped))
            table.append(f"| {name.split(' (')[0]} | {objective} | {before:.4f} | {reference} | {last:.4f} | {stopped:.4f} "
                         f"({better}/{len(per_seed)} better; best steps {best_steps}) | "
                         f"{auc_before:.4f} / {auc_last:.4f} / {auc_stopped:.4f} |")
    seconds = time.time() - started
    write_plot(plotted)
    header = [
        "# Leaf fine-tuning on objectives the trees were not grown for",
        "",
        f"- command: `python experiments/leaf_finetune.py --seeds {args.seeds}` ({seconds:.0f} s)",
        "- model: jaxboost logistic, depth 4, learning rate 0.1, early stopping (20 rounds) on validation log loss;",
        "  splits: 70% train+validation (3:1), 30% test, stratified, one split per seed.",
        f"- fine-tuning: `jb.differentiable.fine_tune_leaves`, Adam (3e-3), {STEPS} steps on the training rows; "
        f"smooth AUC surrogate on {PAIRS_PER_STEP:,} sampled pairs per step; tree shapes fixed.",
        "- 'last step': values after the last step; 'early stopped': values of the step with the best validation",
        "  objective (the starting values included). 'base score + log w': the trained model with log(5) added to",
        "  its base score, the exact optimum shift for a loss that weighs positives w = 5 times (a reference).",
        f"- numbers: test-set medians over {args.seeds} seeds; lower is better for the objectives, higher for AUC.",
        "",
        "| dataset | objective (test, lower is better) | before | base score + log w | last step | early stopped | test AUC before / last / early stopped |",
        "|---|---|---|---|---|---|---|",
    ]
    footer = ["", "Reading (from the medians above):"]
    for dataset, objective, before, reference, last, stopped in summary:
        verdict = "improves" if stopped < before else "does not improve"
        line = (f"- {dataset}, {objective}: the last step is {'better' if last < before else 'worse'} than before "
                f"({last:.4f} vs {before:.4f}); early stopping {verdict} it ({stopped:.4f})")
        if reference is not None:
            line += f"; the exact base-score shift gives {reference:.4f}"
        footer.append(line + ".")
    (RESULTS / "leaf_finetune.md").write_text("\n".join(header + table + footer) + "\n")
    print("\n".join(header + table + footer))


def write_plot(plotted):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, curves = plotted
    figure, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4))
    for axis, (objective, record) in zip(axes, curves.items()):
        axis.plot(record["objective"], label="training rows")
        axis.plot(record["validation_objective"], label="validation rows")
        axis.axvline(int(np.argmin(record["validation_objective"])), color="grey", linestyle=":", label="best validation step")
        axis.set_title(objective)
        axis.set_xlabel("fine-tuning step")
        axis.legend()
    figure.suptitle(f"Leaf fine-tuning, {name}, seed 0")
    figure.tight_layout()
    figure.savefig(RESULTS / "leaf_finetune.png", dpi=110)


if __name__ == "__main__":
    main()
