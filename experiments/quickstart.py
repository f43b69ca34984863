"""jaxboost quickstart: train on scikit-learn's bundled datasets, side by side with XGBoost.

Run with ``python experiments/quickstart.py`` (a few minutes on a 2-core CPU). It trains

* breast cancer (binary, ``loss="logistic"``), digits (10 classes, ``loss="softmax"``) and
  diabetes (regression, ``loss="squared_error"``) with jaxboost and with XGBoost
  (``tree_method="hist"``) on the same rounds, depth, learning rate, lambda and max_bin;
* a custom focal loss, written below in ten lines of JAX, on breast cancer;
* a 0.9-quantile model on diabetes, with its test coverage;

and prints one table of test metrics (all computed with scikit-learn, for both libraries).
It exits with status 1 if any jaxboost metric is far off XGBoost's, so it doubles as a check.
"""

from __future__ import annotations

import functools
import sys
import time

import jaxboost as jb  # import before any JAX computation: it gives JAX one CPU device per core

import jax
import numpy as np

try:  # the comparison and the datasets come from the test extra, not from jaxboost's dependencies
    import xgboost as xgb
    from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
    from sklearn.metrics import accuracy_score, log_loss, mean_squared_error, roc_auc_score
    from sklearn.model_selection import train_test_split
except ImportError as error:
    sys.exit(f"the quickstart needs scikit-learn and xgboost ({error}); install them with: pip install -e \".[test]\"")

NUM_ROUNDS = 100
MAX_DEPTH = 4
LEARNING_RATE = 0.1
REG_LAMBDA = 1.0
MAX_BIN = 256
SEED = 0
QUANTILE = 0.9

# How far jaxboost may trail XGBoost before the run counts as failed.
AUC_SLACK = 0.02
ACCURACY_SLACK = 0.03
MLOGLOSS_SLACK = 0.05
RMSE_RATIO = 1.10
COVERAGE_SLACK = 0.10


def focal(raw_prediction, y, gamma=2.0):
    """Binary focal loss (Lin et al., 2017) on a logit: log loss scaled by (1 - p_true)^gamma,
    so well-classified examples count less. Plain JAX; jaxboost differentiates it twice."""
    sign = 2.0 * y - 1.0  # labels 0/1 -> -1/+1
    margin = sign * raw_prediction
    p_true = jax.nn.sigmoid(margin)
    return -((1.0 - p_true) ** gamma) * jax.nn.log_sigmoid(margin)


def split(X, y, stratify: bool):
    """A 75/25 train/test split, stratified for classification."""
    return train_test_split(X, y, test_size=0.25, random_state=SEED, stratify=y if stratify else None)


def train_jaxboost(X, y, loss, **kwargs):
    """Trains jaxboost; returns the model and the wall time of ``jb.train`` in seconds."""
    start = time.perf_counter()
    model = jb.train(X, y, loss=loss, num_rounds=NUM_ROUNDS, max_depth=MAX_DEPTH, learning_rate=LEARNING_RATE,
                     reg_lambda=REG_LAMBDA, max_bin=MAX_BIN, seed=SEED, **kwargs)
    return model, time.perf_counter() - start


def train_xgboost(X, y, objective, **params):
    """Trains XGBoost's ``hist`` method with the same hyperparameters."""
    params = dict(objective=objective, tree_method="hist", max_depth=MAX_DEPTH, eta=LEARNING_RATE,
                  reg_lambda=REG_LAMBDA, max_bin=MAX_BIN, seed=SEED, **params)
    return xgb.train(params, xgb.DMatrix(X, label=y), num_boost_round=NUM_ROUNDS)


def xgb_predict(booster, X):
    return booster.predict(xgb.DMatrix(X))


def row(dataset, loss, metric, ours, theirs, seconds, ok):
    return dict(dataset=dataset, loss=loss, metric=metric, ours=ours, theirs=theirs, seconds=seconds, ok=ok)


def breast_cancer_rows():
    X_train, X_test, y_train, y_test = split(*load_breast_cancer(return_X_y=True), stratify=True)
    model, seconds = train_jaxboost(X_train, y_train, "logistic")
    p_ours = model.predict(X_test)
    p_theirs = xgb_predict(train_xgboost(X_train, y_train, "binary:logistic"), X_test)
    auc_ours, auc_theirs = roc_auc_score(y_test, p_ours), roc_auc_score(y_test, p_theirs)
    acc_ours, acc_theirs = accuracy_score(y_test, p_ours > 0.5), accuracy_score(y_test, p_theirs > 0.5)

    # The custom loss: a plain JAX function; link="sigmoid" makes predict() return probabilities.
    focal_model, focal_seconds = train_jaxboost(X_train, y_train, focal, link="sigmoid")
    auc_focal = roc_auc_score(y_test, focal_model.predict(X_test))
    return [
        row("breast_cancer", "logistic", "AUC", auc_ours, auc_theirs, seconds, auc_ours >= auc_theirs - AUC_SLACK),
        row("breast_cancer", "logistic", "accuracy", acc_ours, acc_theirs, seconds,
            acc_ours >= acc_theirs - ACCURACY_SLACK),
        # XGBoost has no focal loss: its logistic AUC is the yardstick.
        row("breast_cancer", "focal (custom)", "AUC", auc_focal, auc_theirs, focal_seconds,
            auc_focal >= auc_theirs - AUC_SLACK),
    ]


def digits_rows():
    X_train, X_test, y_train, y_test = split(*load_digits(return_X_y=True), stratify=True)
    model, seconds = train_jaxboost(X_train, y_train, "softmax")
    p_ours = model.predict(X_test)
    p_theirs = xgb_predict(train_xgboost(X_train, y_train, "multi:softprob", num_class=10), X_test)
    acc_ours, acc_theirs = accuracy_score(y_test, p_ours.argmax(1)), accuracy_score(y_test, p_theirs.argmax(1))
    nll_ours, nll_theirs = log_loss(y_test, p_ours, labels=range(10)), log_loss(y_test, p_theirs, labels=range(10))
    return [
        row("digits", "softmax", "accuracy", acc_ours, acc_theirs, seconds, acc_ours >= acc_theirs - ACCURACY_SLACK),
        row("digits", "softmax", "mlogloss", nll_ours, nll_theirs, seconds, nll_ours <= nll_theirs + MLOGLOSS_SLACK),
    ]


def diabetes_rows():
    X_train, X_test, y_train, y_test = split(*load_diabetes(return_X_y=True), stratify=False)
    model, seconds = train_jaxboost(X_train, y_train, "squared_error")
    rmse_ours = np.sqrt(mean_squared_error(y_test, model.predict(X_test)))
    booster = train_xgboost(X_train, y_train, "reg:squarederror")
    rmse_theirs = np.sqrt(mean_squared_error(y_test, xgb_predict(booster, X_test)))

    # A built-in loss with a parameter bound; its Hessian is zero, so leaves are refit exactly.
    quantile_model, quantile_seconds = train_jaxboost(X_train, y_train,
                                                      functools.partial(jb.losses.quantile, tau=QUANTILE))
    coverage_ours = np.mean(y_test <= quantile_model.predict(X_test))
    booster = train_xgboost(X_train, y_train, "reg:quantileerror", quantile_alpha=QUANTILE)
    coverage_theirs = np.mean(y_test <= xgb_predict(booster, X_test))
    return [
        row("diabetes", "squared_error", "RMSE", rmse_ours, rmse_theirs, seconds,
            rmse_ours <= rmse_theirs * RMSE_RATIO),
        row("diabetes", f"quantile tau={QUANTILE}", "coverage", coverage_ours, coverage_theirs, quantile_seconds,
            abs(coverage_ours - QUANTILE) <= abs(coverage_theirs - QUANTILE) + COVERAGE_SLACK),
    ]


def print_table(rows):
    header = f"{'dataset':<14} {'loss':<20} {'metric':<9} {'jaxboost':>9} {'xgboost':>9} {'jb train s*':>12}  check"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['dataset']:<14} {r['loss']:<20} {r['metric']:<9} {r['ours']:>9.4f} {r['theirs']:>9.4f} "
              f"{r['seconds']:>12.2f}  {'ok' if r['ok'] else 'FAIL'}")
    print(f"\n* wall time of jb.train, {NUM_ROUNDS} rounds, depth {MAX_DEPTH}, learning rate {LEARNING_RATE}; rows of "
          "one model repeat its time. The first call\n  for each loss and data shape includes JIT compilation (or, "
          "on a later run, loading it from jaxboost's on-disk compilation\n  cache); later calls with the same "
          "shapes reuse the compiled round.")
    print("  focal (custom): XGBoost has no focal loss, its column is XGBoost's logistic AUC.")
    print(f"  coverage: share of test targets at or below the predicted {QUANTILE} quantile "
          "(XGBoost: reg:quantileerror).")


def main() -> int:
    print(f"jaxboost {jb.__version__} on {len(jax.devices())} {jax.default_backend()} device(s); "
          f"xgboost {xgb.__version__}\n")
    rows = breast_cancer_rows() + digits_rows() + diabetes_rows()
    print_table(rows)
    failed = [f"{r['dataset']}/{r['loss']}/{r['metric']}" for r in rows if not r["ok"]]
    if failed:
        print(f"\nFAILED: jaxboost is far off XGBoost on {', '.join(failed)}", file=sys.stderr)
        return 1
    print("\nAll jaxboost metrics are within tolerance of XGBoost's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
