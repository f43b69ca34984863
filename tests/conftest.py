"""Shared test data: the small models that the interop tests (XGBoost export, treelite, SHAP)
explain and export, trained once per session (test files with their own ``data`` fixture
override it)."""

import os

import jax
import numpy as np
import pytest

# Tests replace jaxboost's functions (monkeypatch) and then train: a round lowered by another
# test process and kept in the program store would skip their change. The store's own tests turn
# it on, in folders of their own.
os.environ["JAXBOOST_PROGRAM_STORE"] = "0"

import jaxboost as jb  # noqa: E402

N_ROWS = 600
TASKS = ["squared_error", "logistic", "softmax"]


def make_data(seed):
    """Five features with 15% NaN; the last is 1.0 or NaN only, so a split on it must send
    every non-missing value left (a split on a padded +inf edge)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N_ROWS, 5)).astype(np.float32)
    X[rng.random(X.shape) < 0.15] = np.nan
    X[:, 4] = np.where(rng.random(N_ROWS) < 0.5, np.nan, 1.0)
    signal = (np.nan_to_num(X[:, 0]) + 0.5 * np.nan_to_num(X[:, 1], nan=1.0) - np.nan_to_num(X[:, 2]) ** 2
              + 1.5 * np.isnan(X[:, 4]))
    return X, signal, rng


def labels(task, signal, rng):
    if task == "squared_error":
        return signal + 0.3 * rng.normal(size=signal.shape)
    if task == "logistic":
        return (signal + 0.5 * rng.normal(size=signal.shape) > 0.5).astype(np.float64)
    return np.digitize(signal + 0.3 * rng.normal(size=signal.shape), [-0.5, 1.0]).astype(np.float64)


@pytest.fixture(scope="session")
def data():
    X, signal, rng = make_data(0)
    X_test, _, _ = make_data(1)
    return X, signal, rng, X_test


@pytest.fixture(scope="session")
def models(data):
    X, signal, _, _ = data
    rng = np.random.default_rng(7)
    return {task: jb.train(X, labels(task, signal, rng), loss=task, num_rounds=6, max_depth=4, max_bin=32,
                           learning_rate=0.3)
            for task in TASKS}


def assert_same_training(actual, desired, err_msg="", rtol=0.0, atol=0.0):
    """Two trainings that must grow the same model: bit for bit on CPU (or within ``rtol`` and
    ``atol`` where the two programs are known to differ in a last bit there). A GPU's histograms
    are sums of float atomic adds in a varying order, so there two fits of the same data differ in
    the last bits (XLA_FLAGS=--xla_gpu_deterministic_ops=true makes them repeatable)."""
    if repeatable_sums():
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=err_msg)
    else:
        # A split's loss change is a difference of gains, so the sums' last bits show up larger.
        np.testing.assert_allclose(actual, desired, rtol=max(rtol, 1e-4), atol=max(atol, 1e-5), err_msg=err_msg)


def repeatable_sums() -> bool:
    """Whether two runs on this backend add a histogram's rows in the same order: always on CPU;
    on a GPU only with XLA's deterministic ops."""
    return (jax.default_backend() == "cpu"
            or "--xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", ""))


def cpu_argument(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract argument placed on the CPU: a program lowered from it is the CPU's, also where
    JAX's default backend is a GPU (for tests that read the CPU compiler's output)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))


# The native kernels compiled for several instruction sets (the split scans, the channel
# histogram's feature pass, the damped solve) run the widest this CPU has (""), or a narrower one
# that JAXBOOST_KERNEL_SIMD asks for, read at each call: one machine checks every variant it can
# run, without compiling the program again.
KERNEL_SIMD = ("", "avx2", "none")


def each_kernel_simd(monkeypatch):
    """Sets JAXBOOST_KERNEL_SIMD to each of ``KERNEL_SIMD`` in turn, yielding it."""
    for simd in KERNEL_SIMD:
        monkeypatch.setenv("JAXBOOST_KERNEL_SIMD", simd)
        yield simd


def shard_training_rows(monkeypatch, rows_per_device: int | None = 100):
    """Makes ``jb.train`` shard even small data's rows over the CPU devices (``rows_per_device``
    rows a device at least; None keeps ``MIN_ROWS_PER_DEVICE``), as it does from
    ``MIN_ROWS_SHARDED`` rows."""
    monkeypatch.setattr(jb.devices, "MIN_ROWS_SHARDED", 0)
    if rows_per_device is not None:
        monkeypatch.setattr(jb.devices, "MIN_ROWS_PER_DEVICE", rows_per_device)


# For tests of two trainings that must grow the same trees: near ties in a GPU's sums may not.
needs_repeatable_sums = pytest.mark.skipif(
    not repeatable_sums(), reason="a GPU's float atomic adds sum the rows in a varying order, so near ties may "
    "split differently between runs; XLA_FLAGS=--xla_gpu_deterministic_ops=true makes them repeatable")


class Lowering(Exception):
    """Stops a fit before its round is compiled, carrying what the stopped call was given."""


def round_shape_and_arguments(monkeypatch, X, y, **settings):
    """The round's shape and arguments that ``jb.train(X, y, num_rounds=1, **settings)`` would
    compile and run its first round with (the fit stops there)."""
    from jaxboost import training

    def stop_before_compiling(shape, arguments):
        raise Lowering(shape, arguments)

    monkeypatch.setattr(training, "stored_round", stop_before_compiling)
    with pytest.raises(Lowering) as stopped:
        jb.train(X, y, num_rounds=1, **settings)
    return stopped.value.args
