"""One benchmark run of one library on one task, in its own process (driven by ``bench.py``).

Usage: ``python experiments/bench_worker.py --library xgboost --task classification --rows N
--rounds R --depth D --max-bin B [--device gpu] [--no-predict]`` (or ``--info`` for machine/version
info).

It generates the task's data (fixed seed, not timed), resets the process's peak-RSS mark, then:

1. builds the library's binned dataset (timed: "binning"; sklearn bins inside ``fit``: n/a);
2. trains 1 round twice (the first call includes one-time costs such as JAX compilation;
   compile = first - second, reported for jaxboost only);
3. trains ``rounds`` rounds (timed: "boosting", a warmed-up process, so no compilation);
4. predicts the test set twice and times the second (warmed-up) call;
5. scores the test set (AUC or RMSE, with scikit-learn/NumPy);
6. records the memory figures, then times a prediction on all rows (train and test: 1M rows
   on the full classification task), whose copy of the data would otherwise count in them, and
   the median latency of predicting one row at a time.

ms/tree = (time of the R-round train - time of the warm 1-round train) / (R - 1): per-call
overhead (data placement, starting value, sklearn's binning inside ``fit``) cancels out.

With ``--device gpu`` jaxboost trains on JAX's default backend (which must then be a GPU) and
XGBoost with ``device="cuda"``; the GPU's memory in use is sampled every few milliseconds
(NVML, when ``pynvml`` is importable) to report the peak above what was in use before the
library started.

The result is one JSON line on stdout, prefixed with ``BENCH_RESULT``. A library that cannot
be imported gives ``{"status": "not installed"}``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import resource
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "BENCH_RESULT "
LEARNING_RATE = 0.1
REG_LAMBDA = 1.0
MIN_HESSIAN = 1.0  # XGBoost min_child_weight, LightGBM min_sum_hessian_in_leaf, jaxboost min_child_weight
SEED = 0
# Tasks scored as binary classification; "wide" is the classification task with 500 features,
# "missing" the classification task with MISSING_FRACTION of its values missing (NaN).
CLASSIFICATION_TASKS = ("classification", "wide", "missing")
MISSING_FRACTION = 0.1
# Softmax over NUM_CLASSES classes, scored by log loss.
MULTICLASS_TASKS = ("multiclass",)
NUM_CLASSES = 10
# The regression task's data fitted by absolute error, scored by the test MAE: a loss whose
# Hessian is zero, so every library sets its leaves by an exact weighted median of residuals.
ABSOLUTE_ERROR_TASKS = ("absolute_error",)


def task_loss(task: str) -> str:
    """jaxboost's built-in loss for ``task``."""
    return ("logistic" if task in CLASSIFICATION_TASKS else "softmax" if task in MULTICLASS_TASKS
            else "absolute_error" if task in ABSOLUTE_ERROR_TASKS else "squared_error")


TASK_FEATURES = {"classification": 28, "regression": 50, "wide": 500, "multiclass": 28, "absolute_error": 50,
                 "missing": 28}


def monotone_directions(n_features: int) -> list[int]:
    """``--monotone``: +1, -1 and 0 in turn over the features (two thirds constrained)."""
    return [(1, -1, 0)[feature % 3] for feature in range(n_features)]


# A task's samples are --rows divided by this: a regression row and a 10-class row cost more.
TASK_ROWS_DIVISOR = {"classification": 1, "regression": 2, "wide": 1, "multiclass": 5, "absolute_error": 2,
                     "missing": 1}


def reg_lambda(task: str) -> float:
    """L2 lambda for every library: 0 for absolute error. jaxboost's exact leaf refit minimises
    the loss plus the leaf penalty; XGBoost's and LightGBM's set the plain weighted median, so
    only without the penalty do all minimise the same (with lambda 1, jaxboost's leaves shrink
    by an amount that grows with the targets' scale: test MAE 54.9 against 52.1 without it, 40k
    rows, 100 trees)."""
    return 0.0 if task in ABSOLUTE_ERROR_TASKS else REG_LAMBDA


# The metric each library computes on the eval set every round with ``--eval-set``: the task's
# loss (jaxboost / XGBoost / LightGBM names).
EVAL_METRIC = {"classification": ("logloss", "logloss", "binary_logloss"),
               "wide": ("logloss", "logloss", "binary_logloss"),
               "missing": ("logloss", "logloss", "binary_logloss"),
               "regression": ("rmse", "rmse", "rmse"),
               "absolute_error": ("mae", "mae", "l1"),
               "multiclass": ("mlogloss", "mlogloss", "multi_logloss")}


def task_samples(task: str, rows: int) -> int:
    return rows // TASK_ROWS_DIVISOR[task]


# ----------------------------------------------------------------------------- data

def make_task(task: str, rows: int, features_dtype: str = "float32"):
    """The task's train/test split (80/20), always with the same seed: float32 labels, and
    features of ``features_dtype`` (float32; ``--float64``: float64, NumPy's and pandas'
    default, whose values are the float32 ones)."""
    import numpy as np
    from sklearn.datasets import make_classification, make_regression
    from sklearn.model_selection import train_test_split

    samples = task_samples(task, rows)
    if task in ("classification", "missing"):
        X, y = make_classification(n_samples=samples, n_features=TASK_FEATURES[task], n_informative=14, n_redundant=4,
                                   random_state=SEED)
    elif task == "wide":
        X, y = make_classification(n_samples=samples, n_features=TASK_FEATURES[task], n_informative=50,
                                   n_redundant=10, random_state=SEED)
    elif task == "multiclass":
        X, y = make_classification(n_samples=samples, n_features=TASK_FEATURES[task], n_informative=14,
                                   n_redundant=4, n_classes=NUM_CLASSES, random_state=SEED)
    elif task in ("regression",) + ABSOLUTE_ERROR_TASKS:
        X, y = make_regression(n_samples=samples, n_features=TASK_FEATURES[task], n_informative=20, noise=10,
                               random_state=SEED)
    else:
        raise ValueError(f"unknown task {task!r}")
    X, y = X.astype(np.float32), y.astype(np.float32)
    if task == "missing":
        # Missing completely at random, the same cells every run: each library's missing-value
        # path (a default direction learned per split) on every feature.
        X[np.random.default_rng(SEED).uniform(size=X.shape) < MISSING_FRACTION] = np.nan
    return train_test_split(X.astype(features_dtype), y, test_size=0.2, random_state=SEED)


def score(task: str, y_true, prediction) -> float:
    import numpy as np
    from sklearn.metrics import log_loss, roc_auc_score

    if task in CLASSIFICATION_TASKS:
        return float(roc_auc_score(y_true, prediction))
    if task in MULTICLASS_TASKS:
        return float(log_loss(y_true, prediction, labels=list(range(NUM_CLASSES))))
    if task in ABSOLUTE_ERROR_TASKS:
        return float(np.mean(np.abs(np.asarray(prediction, np.float64) - y_true)))
    return float(np.sqrt(np.mean((np.asarray(prediction, np.float64) - y_true) ** 2)))


# ----------------------------------------------------------------------------- memory

def _read_status_kb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
        return float(match.group(1)) if match else None
    except OSError:
        return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb(since_reset: bool) -> float:
    """Peak RSS of this process: VmHWM after a reset, else ru_maxrss (lifetime peak)."""
    hwm_kb = _read_status_kb("VmHWM") if since_reset else None
    if hwm_kb is None:
        hwm_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return hwm_kb / 1024


def current_rss_mb() -> float | None:
    rss_kb = _read_status_kb("VmRSS")
    return None if rss_kb is None else rss_kb / 1024


class PeakSampler:
    """The highest value of ``read()`` (MB), sampled every ``interval_s`` on a thread until
    ``stop``; ``peak_mb`` is None when ``read`` is None (nothing to measure)."""

    def __init__(self, read, interval_s: float):
        import threading
        self.peak_mb, self._read, self._interval_s, self._stop = None, read, interval_s, threading.Event()
        if read is None:
            return
        self.peak_mb = read()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(self._interval_s):
            self.peak_mb = max(self.peak_mb, self._read())

    def stop(self) -> float | None:
        if self.peak_mb is not None:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, self._read())
        return self.peak_mb


def gpu_memory_sampler() -> PeakSampler:
    """Peak GPU memory in use (device-wide, NVML) above the level when it started, every 2 ms;
    its ``peak_mb`` is None without ``pynvml`` or a GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML, no driver or no GPU: report nothing rather than fail the run
        return PeakSampler(None, 0.002)
    used_mb = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2 ** 20  # noqa: E731
    baseline_mb = used_mb()
    return PeakSampler(lambda: used_mb() - baseline_mb, 0.002)


def anonymous_memory_sampler() -> PeakSampler:
    """Peak anonymous resident memory (RssAnon: heaps, arrays, JIT code; not mapped files such
    as shared libraries' code), every 5 ms: the part of peak RSS that is the process's own."""
    if _read_status_kb("RssAnon") is None:
        return PeakSampler(None, 0.005)
    return PeakSampler(lambda: _read_status_kb("RssAnon") / 1024, 0.005)


# ----------------------------------------------------------------------------- libraries
# Each runner class: build(X, y) -> dataset; train(dataset, rounds) -> model; predict(model, X).

class JaxboostRunner:
    def __init__(self, task, depth, max_bin, threads, device="cpu"):
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        import jax

        import jaxboost as jb
        backend = jax.default_backend()
        if (backend == "gpu") != (device == "gpu"):
            raise RuntimeError(f"asked for a {device} run, but JAX's default backend is {backend}")
        self.jb, self.max_bin = jb, max_bin
        self.params = dict(loss=task_loss(task), max_depth=depth, learning_rate=LEARNING_RATE, reg_lambda=reg_lambda(task),
                           min_child_weight=MIN_HESSIAN)
        self.eval_metric = EVAL_METRIC[task][0]

    def build(self, X, y):
        return self.jb.Dataset(X, y, max_bin=self.max_bin)

    def build_eval(self, X, y, dataset):
        return self.jb.Dataset(X, y, reference=dataset)

    def sample_columns(self, fraction):
        self.params.update(colsample_bytree=fraction)

    def sample_rows(self, fraction):
        self.params.update(subsample=fraction)

    def constrain(self, directions):
        self.params.update(monotone_constraints=directions)

    def sum_repeatably(self):
        self.params.update(deterministic_histogram=True)

    def grow_vector_leaves(self, hessian: str):
        self.params.update(multi_strategy="multi_output_tree", multi_output_hessian=hessian)

    def train(self, dataset, rounds, eval_set=None):
        if eval_set is None:
            return self.jb.train(dataset, num_rounds=rounds, **self.params)
        return self.jb.train(dataset, num_rounds=rounds, eval_set=[eval_set], eval_metric=self.eval_metric,
                             **self.params)

    def predict(self, model, X):
        return model.predict(X)


def user_squared_error(raw_prediction, y):
    """A custom loss as a user writes it (no built-in record behind it)."""
    return 0.5 * (raw_prediction - y) ** 2


def user_softmax_cross_entropy(raw_prediction, y):
    """The multiclass custom loss: optax's, on the label as an integer class."""
    import optax
    return optax.losses.softmax_cross_entropy_with_integer_labels(raw_prediction, y.astype("int32"))


class JaxboostCustomLossRunner(JaxboostRunner):
    """jaxboost with a custom callable loss instead of the built-in: optax's sigmoid cross-entropy
    (classification) or a user-written squared error (regression), to show the cost per round."""

    def __init__(self, task, depth, max_bin, threads, device="cpu"):
        super().__init__(task, depth, max_bin, threads, device)
        import optax
        if task in CLASSIFICATION_TASKS:
            self.params.update(loss=optax.losses.sigmoid_binary_cross_entropy, link="sigmoid")
        elif task in MULTICLASS_TASKS:
            self.params.update(loss=user_softmax_cross_entropy, num_outputs=NUM_CLASSES, link="softmax")
        else:
            self.params.update(loss=user_squared_error)


class XGBoostRunner:
    def __init__(self, task, depth, max_bin, threads, device="cpu"):
        import xgboost as xgb
        self.xgb, self.max_bin = xgb, max_bin
        self.params = dict(objective="binary:logistic" if task in CLASSIFICATION_TASKS else "reg:squarederror",
                           tree_method="hist", max_depth=depth, eta=LEARNING_RATE, reg_lambda=reg_lambda(task),
                           min_child_weight=MIN_HESSIAN, max_bin=max_bin, nthread=threads, verbosity=0,
                           device="cuda" if device == "gpu" else "cpu")
        if task in MULTICLASS_TASKS:
            self.params.update(objective="multi:softprob", num_class=NUM_CLASSES)
        if task in ABSOLUTE_ERROR_TASKS:
            self.params.update(objective="reg:absoluteerror")
        self.eval_metric = EVAL_METRIC[task][1]

    def build(self, X, y):
        return self.xgb.QuantileDMatrix(X, y, max_bin=self.max_bin, nthread=self.params["nthread"])

    def build_eval(self, X, y, dataset):
        return self.xgb.QuantileDMatrix(X, y, ref=dataset, nthread=self.params["nthread"])

    def sample_columns(self, fraction):
        self.params.update(colsample_bytree=fraction)

    def sample_rows(self, fraction):
        self.params.update(subsample=fraction)

    def constrain(self, directions):
        self.params.update(monotone_constraints="(" + ",".join(map(str, directions)) + ")")

    def grow_vector_leaves(self, hessian: str):
        # XGBoost's multi-output trees take each output's own Hessian (the diagonal) whatever is asked.
        self.params.update(multi_strategy="multi_output_tree")

    def train(self, dataset, rounds, eval_set=None):
        if eval_set is None:
            booster = self.xgb.train(self.params, dataset, num_boost_round=rounds)
        else:
            booster = self.xgb.train(dict(self.params, eval_metric=self.eval_metric), dataset, num_boost_round=rounds,
                                     evals=[(eval_set, "eval")], verbose_eval=False)
        if self.params["device"] == "cuda":
            # Without a visible GPU XGBoost falls back to the CPU with only a log line.
            used = json.loads(booster.save_config())["learner"]["generic_param"]["device"]
            if not used.startswith("cuda"):
                raise RuntimeError(f"asked for a gpu run, but XGBoost trained on {used!r}")
        return booster

    def predict(self, model, X):
        return model.inplace_predict(X)


class LightGBMRunner:
    def __init__(self, task, depth, max_bin, threads, device="cpu"):
        if device != "cpu":
            raise RuntimeError("the LightGBM runner is CPU-only")
        import lightgbm as lgb
        self.lgb = lgb
        # LightGBM's max_bin excludes its missing-value bin: 255 here ~ 256 codes elsewhere.
        self.params = dict(objective="binary" if task in CLASSIFICATION_TASKS else "regression",
                           learning_rate=LEARNING_RATE, max_depth=depth, num_leaves=2 ** depth,
                           max_bin=max_bin - 1, lambda_l2=reg_lambda(task), min_sum_hessian_in_leaf=MIN_HESSIAN,
                           min_data_in_leaf=1, num_threads=threads, verbose=-1, seed=SEED)
        if task in MULTICLASS_TASKS:
            self.params.update(objective="multiclass", num_class=NUM_CLASSES)
        if task in ABSOLUTE_ERROR_TASKS:
            self.params.update(objective="l1")
        self.eval_metric = EVAL_METRIC[task][2]

    def build(self, X, y):
        return self.lgb.Dataset(X, y, params=self.params, free_raw_data=False).construct()

    def build_eval(self, X, y, dataset):
        return self.lgb.Dataset(X, y, reference=dataset, params=self.params, free_raw_data=False).construct()

    def sample_columns(self, fraction):
        # LightGBM's per-tree sample, with the same seed every run.
        self.params.update(feature_fraction=fraction, feature_fraction_seed=SEED)

    def sample_rows(self, fraction):
        # LightGBM's bagging, a fresh sample every round (bagging_freq=1) as jaxboost's and XGBoost's.
        self.params.update(bagging_fraction=fraction, bagging_freq=1, bagging_seed=SEED)

    def constrain(self, directions):
        self.params.update(monotone_constraints=directions)

    def train(self, dataset, rounds, eval_set=None):
        if eval_set is None:
            return self.lgb.train(self.params, dataset, num_boost_round=rounds)
        return self.lgb.train(dict(self.params, metric=self.eval_metric), dataset, num_boost_round=rounds,
                              valid_sets=[eval_set])

    def predict(self, model, X):
        return model.predict(X, num_threads=self.params["num_threads"])


class SklearnRunner:
    """HistGradientBoosting bins inside ``fit``, so its "dataset" is just the arrays."""

    def __init__(self, task, depth, max_bin, threads, device="cpu"):
        if device != "cpu":
            raise RuntimeError("scikit-learn has no GPU path")
        from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
        self.task = task
        classifier = task in CLASSIFICATION_TASKS + MULTICLASS_TASKS
        self.estimator = HistGradientBoostingClassifier if classifier else HistGradientBoostingRegressor
        # sklearn has no minimum-Hessian parameter (min_samples_leaf=1 is the loosest leaf limit).
        self.params = dict(learning_rate=LEARNING_RATE, max_depth=depth, max_leaf_nodes=2 ** depth,
                           max_bins=max_bin - 1, l2_regularization=reg_lambda(task), min_samples_leaf=1,
                           early_stopping=False, random_state=SEED)
        if task in ABSOLUTE_ERROR_TASKS:
            self.params.update(loss="absolute_error")

    def build(self, X, y):
        return X, y

    def constrain(self, directions):
        self.params.update(monotonic_cst=directions)

    def train(self, dataset, rounds):
        X, y = dataset
        return self.estimator(max_iter=rounds, **self.params).fit(X, y)

    def predict(self, model, X):
        if self.task in MULTICLASS_TASKS:
            return model.predict_proba(X)
        return model.predict_proba(X)[:, 1] if self.task in CLASSIFICATION_TASKS else model.predict(X)


RUNNERS = {"jaxboost": JaxboostRunner, "jaxboost-custom": JaxboostCustomLossRunner, "xgboost": XGBoostRunner, "lightgbm": LightGBMRunner,
           "sklearn": SklearnRunner}


# ----------------------------------------------------------------------------- measurement

@functools.cache
def available_cores() -> int:
    """The cores this process may use, counted as jaxboost counts them (``jaxboost/cores.py``,
    loaded on its own so that the other libraries' processes do not import JAX); every library
    gets this many threads."""
    spec = importlib.util.spec_from_file_location("jaxboost_cores", os.path.join(REPO_ROOT, "jaxboost", "cores.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.available_cpu_cores()


def timed(function, *args):
    start = time.perf_counter()
    value = function(*args)
    return value, time.perf_counter() - start


# Warm calls of a prediction timed, their median reported: a single call can catch Python's first
# full garbage collection after training (96 ms in a process holding JAX's and scikit-learn's
# 220k objects, as long as the 1M-row prediction itself), which made the figure bimodal.
PREDICT_CALLS = 3


def timed_median(function, *args, calls: int = PREDICT_CALLS):
    """``function(*args)``'s last value and the median time of ``calls`` calls."""
    times = []
    for _ in range(calls):
        value, seconds = timed(function, *args)
        times.append(seconds)
    return value, statistics.median(times)


# Calls of a one-row prediction timed for its latency (median), after as many warm-up calls.
LATENCY_CALLS = 200


def one_row_latency_ms(runner, model, X_test) -> float:
    """The median time of predicting one row (a different row each call, while the test set
    lasts), as when a model serves requests one at a time."""
    import numpy as np
    rows = [X_test[i % len(X_test):][:1] for i in range(LATENCY_CALLS)]  # small data: rows repeat
    for row in rows:
        runner.predict(model, row)
    times = []
    for row in rows:
        _, seconds = timed(runner.predict, model, row)
        times.append(seconds)
    return 1000 * float(np.median(times))


def measure(args) -> dict:
    threads = available_cores()
    X_train, X_test, y_train, y_test = make_task(args.task, args.rows, "float64" if args.float64 else "float32")
    data_peak_mb = peak_rss_mb(since_reset=False)
    gpu_memory = gpu_memory_sampler() if args.device == "gpu" else None
    try:
        runner = RUNNERS[args.library](args.task, args.depth, args.max_bin, threads, args.device)
    except ImportError as error:
        return {"status": "not installed", "detail": str(error)}
    if args.colsample_bytree != 1.0:
        if not hasattr(runner, "sample_columns"):
            return {"status": "no column sample", "detail": f"the {args.library} runner samples no columns by tree"}
        runner.sample_columns(args.colsample_bytree)
    if args.subsample != 1.0:
        if not hasattr(runner, "sample_rows"):
            return {"status": "no row sample", "detail": f"the {args.library} runner samples no rows by round"}
        runner.sample_rows(args.subsample)
    if args.monotone:
        if not hasattr(runner, "constrain"):
            return {"status": "no monotone constraints", "detail": f"the {args.library} runner takes none"}
        runner.constrain(monotone_directions(TASK_FEATURES[args.task]))
    if args.deterministic_histogram and hasattr(runner, "sum_repeatably"):
        runner.sum_repeatably()  # the other libraries' histograms are repeatable as they are
    if args.vector_leaves:
        if not hasattr(runner, "grow_vector_leaves"):
            return {"status": "no vector leaves", "detail": f"the {args.library} runner grows no vector leaves"}
        runner.grow_vector_leaves(args.vector_leaves)
    since_reset = reset_peak_rss()
    rss_start_mb = current_rss_mb()
    anonymous_memory = anonymous_memory_sampler()

    dataset, binning_s = timed(runner.build, X_train, y_train)
    train = runner.train
    if args.eval_set:
        if not hasattr(runner, "build_eval"):
            return {"status": "no eval sets", "detail": f"the {args.library} runner has no per-round eval set"}
        eval_set = runner.build_eval(X_test, y_test, dataset)
        train = lambda data, rounds: runner.train(data, rounds, eval_set)  # noqa: E731
    _, first_round_s = timed(train, dataset, 1)
    _, warm_round_s = timed(train, dataset, 1)
    model, boosting_s = timed(train, dataset, args.rounds)
    result = {
        "status": "ok",
        "binning_s": None if args.library == "sklearn" else binning_s,
        "first_round_s": first_round_s,
        "warm_round_s": warm_round_s,
        "compile_s": first_round_s - warm_round_s,
        "boosting_s": boosting_s,
        "ms_per_tree": 1000 * (boosting_s - warm_round_s) / (args.rounds - 1),
    }
    if not args.no_predict:
        runner.predict(model, X_test)  # warm-up (jaxboost compiles its predictor here)
        prediction, predict_s = timed_median(runner.predict, model, X_test)
        result.update(predict_s=predict_s, metric=score(args.task, y_test, prediction))
    file_kb = _read_status_kb("RssFile")
    result.update(peak_rss_mb=peak_rss_mb(since_reset), peak_rss_since_data=since_reset,
                  rss_start_mb=rss_start_mb, data_peak_rss_mb=data_peak_mb, threads=threads,
                  peak_anonymous_mb=anonymous_memory.stop(), file_rss_mb=None if file_kb is None else file_kb / 1024)
    if not args.no_predict:
        import numpy as np
        X_all = np.concatenate([X_train, X_test])
        runner.predict(model, X_all)  # warm-up for this shape
        _, predict_all_s = timed_median(runner.predict, model, X_all)
        result.update(predict_all_s=predict_all_s, predict_all_rows=len(X_all),
                      predict_row_ms=one_row_latency_ms(runner, model, X_test))
    if gpu_memory is not None:
        result.update(gpu_peak_mb=gpu_memory.stop(), gpu_name=gpu_name())
    return result


def gpu_name() -> str | None:
    try:
        import pynvml
        return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None


def machine_info() -> dict:
    """Versions and JAX devices as jaxboost sets them up (imports jaxboost first)."""
    from importlib import metadata
    versions = {}
    for package in ["jax", "jaxlib", "xgboost", "lightgbm", "scikit-learn", "numpy"]:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    try:
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        import jaxboost  # noqa: F401  (configures one CPU device per core before JAX starts)
        import jax
        devices = [str(device) for device in jax.devices()]
    except ImportError as error:
        devices = [f"jaxboost not importable: {error}"]
    return {"status": "ok", "versions": versions, "jax_devices": devices}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--info", action="store_true", help="print versions and JAX devices, then exit")
    parser.add_argument("--library", choices=sorted(RUNNERS))
    parser.add_argument("--task", choices=sorted(TASK_FEATURES))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--max-bin", type=int, default=256)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--no-predict", action="store_true", help="skip predict and scoring (scaling runs)")
    parser.add_argument("--colsample-bytree", type=float, default=1.0,
                        help="the fraction of features sampled for each tree (LightGBM: feature_fraction)")
    parser.add_argument("--subsample", type=float, default=1.0,
                        help="the fraction of rows sampled for each round (LightGBM: bagging_fraction)")
    parser.add_argument("--eval-set", action="store_true",
                        help="train with the test split as an eval set, its loss computed every round")
    parser.add_argument("--monotone", action="store_true",
                        help="monotone constraints +1, -1, 0 in turn over the features")
    parser.add_argument("--float64", action="store_true",
                        help="features handed to the library as float64 (the same values as float32)")
    parser.add_argument("--deterministic-histogram", action="store_true",
                        help="jaxboost: deterministic_histogram=True (repeatable GPU fits)")
    parser.add_argument("--vector-leaves", choices=["full", "diagonal"], default=None,
                        help="multiclass: one tree of vector leaves a round (multi_strategy='multi_output_tree'), "
                             "jaxboost's from the full Hessian or its diagonal")
    args = parser.parse_args(argv)
    if not args.info and (args.library is None or args.task is None):
        parser.error("--library and --task are required")
    if not args.info and args.rounds < 2:
        parser.error("--rounds must be at least 2 (ms/tree is a difference of two trainings)")
    return args


def main(argv=None):
    args = parse_args(argv)
    result = machine_info() if args.info else measure(args)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
