"""End-to-end behaviour of jb.train / Model: custom and optax losses, zero-Hessian losses,
reproducibility, compilation reuse, early stopping, weights and margins, and bad input."""

from __future__ import annotations

import collections
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.metrics import roc_auc_score

import jaxboost as jb
from jaxboost import boosting
from jaxboost.derivatives import gradients_and_hessians

from conftest import (Lowering, assert_same_training, needs_repeatable_sums, repeatable_sums,
                      round_shape_and_arguments, shard_training_rows)

# Most tests share one shape (1000 rows -> one padded bucket, 5 features, depth 4) so the
# compiled round is reused across them.
N_ROWS, N_FEATURES, DEPTH = 1000, 5, 4
COMMON = dict(num_rounds=20, max_depth=DEPTH, learning_rate=0.3)
# The row-sharded paths run over one JAX device per CPU core, which only the CPU backend has.
cpu_devices_only = pytest.mark.skipif(jax.default_backend() != "cpu",
                                      reason="rows are sharded over CPU host devices; this backend has its own")


def _regression_data(seed=0, n=N_ROWS):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    y = 2.0 * X[:, 0] + np.sin(3 * X[:, 1]) + 0.5 * X[:, 2] * X[:, 3] + rng.normal(scale=0.3, size=n)
    return X, y


def _binary_data(seed=0, n=N_ROWS):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    logits = 1.5 * X[:, 0] - X[:, 1] + 0.8 * X[:, 2] * X[:, 3]
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return X, y


def focal_loss(raw_prediction, y, gamma=2.0):
    """Binary focal loss on a logit (Lin et al. 2017), written as a user would."""
    p = jax.nn.sigmoid(raw_prediction)
    p_true = y * p + (1 - y) * (1 - p)
    log_p_true = -optax.losses.sigmoid_binary_cross_entropy(raw_prediction, y)
    return -((1 - p_true) ** gamma) * log_p_true


def test_regression_learns_and_predict_shapes():
    X, y = _regression_data()
    model = jb.train(X, y, **COMMON)
    prediction = model.predict(X)
    assert prediction.shape == (N_ROWS,)
    assert np.sqrt(np.mean((prediction - y) ** 2)) < 0.5 * np.std(y)
    np.testing.assert_array_equal(model.predict_raw(X), prediction)
    assert model.num_rounds == 20 and model.num_outputs == 1


@pytest.mark.parametrize("loss, link", [
    (focal_loss, "sigmoid"),
    (optax.losses.sigmoid_binary_cross_entropy, "sigmoid"),
])
def test_custom_and_optax_classification_losses_train(loss, link):
    X, y = _binary_data()
    X_test, y_test = _binary_data(seed=1)
    builtin = jb.train(X, y, loss="logistic", **COMMON)
    custom = jb.train(X, y, loss=loss, link=link, **COMMON)
    builtin_auc = roc_auc_score(y_test, builtin.predict(X_test))
    custom_auc = roc_auc_score(y_test, custom.predict(X_test))
    assert custom_auc > 0.8, custom_auc
    assert abs(custom_auc - builtin_auc) < 0.03, (custom_auc, builtin_auc)
    prediction = custom.predict(X_test)
    assert ((prediction > 0) & (prediction < 1)).all()


def test_optax_sigmoid_cross_entropy_matches_builtin_logistic():
    X, y = _binary_data()
    raw_prediction = jnp.linspace(-4.0, 4.0, N_ROWS)
    optax_g, optax_h = gradients_and_hessians(optax.losses.sigmoid_binary_cross_entropy, raw_prediction, y)
    builtin_g, builtin_h = gradients_and_hessians(jb.losses.logistic, raw_prediction, y)
    np.testing.assert_allclose(optax_g, builtin_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(optax_h, builtin_h, rtol=1e-5, atol=1e-6)
    # One round: the same tree. (Over many rounds float32 rounding differences can flip
    # near-tied splits in small nodes, so later rounds are compared by quality above.)
    one_round = dict(num_rounds=1, max_depth=DEPTH, learning_rate=0.3)
    builtin = jb.train(X, y, loss="logistic", **one_round)
    optax_model = jb.train(X, y, loss=optax.losses.sigmoid_binary_cross_entropy, link="sigmoid", **one_round)
    same = np.isclose(optax_model.predict_raw(X), builtin.predict_raw(X), rtol=1e-4, atol=1e-5)
    assert same.mean() > 0.97, same.mean()


def test_optax_huber_trains_with_zero_hessian_tails():
    X, y = _regression_data()
    y_outliers = y.copy()
    y_outliers[::50] += 30.0
    model = jb.train(X, y_outliers, loss=optax.losses.huber_loss, **COMMON)
    assert model.params["leaf_refit"], "huber's zero-Hessian tails should switch on the exact leaf refit"
    squared = jb.train(X, y_outliers, **COMMON)
    clean_rows = np.arange(N_ROWS) % 50 != 0
    huber_error = np.median(np.abs(model.predict(X) - y)[clean_rows])
    squared_error = np.median(np.abs(squared.predict(X) - y)[clean_rows])
    assert huber_error < squared_error, (huber_error, squared_error)


def _huber(delta):
    def loss(raw_prediction, y):
        residual = jnp.abs(raw_prediction - y)
        return jnp.where(residual <= delta, 0.5 * residual ** 2, delta * (residual - 0.5 * delta))
    return loss


def test_a_custom_loss_counts_its_zero_hessians_at_its_starting_raw_predictions():
    """A custom loss's need for a leaf refit is read off its Hessians where training starts:
    at the starting value, or at the given base margins. Labels around 50 and a Huber loss of
    delta 10: every row's Hessian is zero at a raw prediction of 0, none at the starting value
    (about 50), so no refit; with delta 0.5 most rows are in the tails there."""
    X, y = _regression_data(seed=2)
    y = (50.0 + y / np.std(y)).astype(np.float32)
    settings = dict(num_rounds=3, max_depth=3)
    assert not jb.train(X, y, loss=_huber(10.0), **settings).params["leaf_refit"]
    assert jb.train(X, y, loss=_huber(0.5), **settings).params["leaf_refit"]
    assert jb.train(X, y, loss=lambda raw, y: jnp.abs(raw - y), **settings).params["leaf_refit"]
    # Under a base margin no starting value is found: the raw predictions start at the margins.
    assert jb.train(X, y, loss=_huber(10.0), base_margin=np.zeros(len(y), np.float32), **settings).params["leaf_refit"]
    assert not jb.train(X, y, loss=_huber(10.0), base_margin=np.full(len(y), 50.0, np.float32),
                        **settings).params["leaf_refit"]


@cpu_devices_only
def test_a_custom_loss_finds_its_zero_hessians_with_the_rounds_derivatives(monkeypatch):
    """A custom loss's first fit reads whether some row's Hessian is exactly zero (then its
    leaves are refit) off the round's own derivatives' program, compiling no program of its
    own: one such row among 70k, on the second device and in a later chunk of rows, is found,
    whether the row sample of the first round holds it or not; without it, no refit."""
    from jaxboost import training
    from jaxboost.devices import row_mesh

    def no_count_program(*args, **kwargs):
        raise AssertionError("a fit of rounds should not compile the zero-Hessian count program")

    n_rows = 70_000
    assert row_mesh(n_rows).size == 2
    shard_training_rows(monkeypatch, rows_per_device=None)
    rng = np.random.default_rng(6)
    X = rng.normal(size=(n_rows, 3)).astype(np.float32)
    y = (0.1 * rng.normal(size=n_rows)).astype(np.float32)
    outlier = y.copy()
    outlier[69_000] = 50.0  # in Huber's tail (delta 1) at any start near 0, its Hessian 0
    monkeypatch.setattr(boosting, "DERIVATIVE_CHUNK_ROWS", 4096)
    monkeypatch.setattr(training, "compiled_zero_hessian_count", no_count_program)
    settings = dict(loss=_huber(1.0), num_rounds=1, max_depth=2)
    assert not jb.train(X, y, **settings).params["leaf_refit"]
    assert jb.train(X, outlier, **settings).params["leaf_refit"]
    for seed in range(4):
        model = jb.train(X, outlier, subsample=0.3, seed=seed, **settings)
        assert model.params["leaf_refit"], seed


@cpu_devices_only
def test_zero_hessian_rows_are_counted_on_the_devices_in_chunks(monkeypatch):
    """The check that turns the leaf refit on for a custom loss counts the weighted rows whose
    Hessian is exactly zero (Huber's tails), over rows sharded on the devices and computed a
    chunk at a time; rows of weight 0 do not count."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxboost import boosting
    from jaxboost.devices import ROW_AXIS, row_mesh
    from jaxboost.objective import resolve_loss

    rng = np.random.default_rng(4)
    n_rows = 100_000
    y = (3 * rng.normal(size=n_rows)).astype(np.float32)
    weight = (rng.random(n_rows) < 0.7).astype(np.float32)
    expected = int(np.sum((np.abs(y) > 1.0) & (weight > 0)))  # optax's huber: delta 1, raw 0
    mesh = row_mesh(n_rows)
    assert mesh.size == 2
    place = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec(ROW_AXIS, *([None] * (a.ndim - 1)))))
    objective = resolve_loss(optax.losses.huber_loss, y, None, None).objective
    monkeypatch.setattr(boosting, "DERIVATIVE_CHUNK_ROWS", 4096)
    boosting.compiled_zero_hessian_count.cache_clear()
    count = boosting.compiled_zero_hessian_count(objective, mesh)
    boosting.compiled_zero_hessian_count.cache_clear()
    assert int(count(place(np.zeros((n_rows, 1), np.float32)), place(y), place(weight), {})) == expected
    assert int(count(place(np.zeros((n_rows, 1), np.float32)), place(np.zeros_like(y)), place(weight), {})) == 0


@pytest.fixture(scope="module")
def heteroscedastic_data():
    rng = np.random.default_rng(3)
    n_train, n_test = 20_000, 10_000
    X = rng.uniform(-2, 2, size=(n_train + n_test, N_FEATURES)).astype(np.float32)
    scale = 0.5 + np.abs(X[:, 1])
    y = np.sin(2 * X[:, 0]) + X[:, 2] + scale * rng.standard_normal(n_train + n_test)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


@pytest.mark.parametrize("tau", [0.9])
def test_quantile_coverage_on_held_out_data(heteroscedastic_data, tau):
    X, y, X_test, y_test = heteroscedastic_data
    model = jb.train(X, y, loss=functools.partial(jb.losses.quantile, tau=tau), num_rounds=100, max_depth=4,
                     learning_rate=0.1)
    coverage = np.mean(y_test <= model.predict(X_test))
    assert abs(coverage - tau) <= 0.02, coverage


def test_absolute_error_leaves_half_below(heteroscedastic_data):
    X, y, X_test, y_test = heteroscedastic_data
    model = jb.train(X, y, loss="absolute_error", num_rounds=100, max_depth=4, learning_rate=0.1)
    below = np.mean(y_test < model.predict(X_test))
    assert abs(below - 0.5) <= 0.02, below


def test_hinge_trains_a_classifier():
    """Hinge predicts classes, about as accurately as XGBoost's ``binary:hinge`` with the same
    rounds, depth and learning rate (0.736 there, 0.724 here on 1000 test rows, whose accuracy
    has a standard error of about 0.014), and far above the 0.536 of the majority class."""
    xgb = pytest.importorskip("xgboost")
    X, y = _binary_data()
    X_test, y_test = _binary_data(seed=1)
    hinge = jb.train(X, y, loss="hinge", **COMMON).predict(X_test)
    assert set(np.unique(hinge)) <= {0.0, 1.0}
    booster = xgb.train({"objective": "binary:hinge", "max_depth": DEPTH, "eta": COMMON["learning_rate"],
                         "tree_method": "hist", "max_bin": 256, "reg_lambda": 1.0}, xgb.DMatrix(X, y),
                        COMMON["num_rounds"])
    xgboost_accuracy = np.mean(booster.predict(xgb.DMatrix(X_test)) == y_test)
    accuracy = np.mean(hinge == y_test)
    assert accuracy > max(np.mean(y_test), 1 - np.mean(y_test)) + 0.1
    assert accuracy > xgboost_accuracy - 0.03, (accuracy, xgboost_accuracy)


def test_softmax_predicts_class_probabilities():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N_ROWS, N_FEATURES)).astype(np.float32)
    y = np.argmax(X[:, :3] + 0.3 * rng.normal(size=(N_ROWS, 3)), axis=1)
    model = jb.train(X, y, loss="softmax", **COMMON)
    probabilities = model.predict(X)
    assert probabilities.shape == (N_ROWS, 3)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert np.mean(probabilities.argmax(axis=1) == y) > 0.85
    assert model.predict_raw(X).shape == (N_ROWS, 3)


@pytest.mark.parametrize("n_rows, sharded", [(N_ROWS, False), (90_000, False), (90_000, True)])
def test_fits_with_eval_sets_trace_their_round_once(n_rows, sharded, monkeypatch):
    """Eval sets' arrays are committed to the mesh as the round's outputs are: the second
    round takes the first's eval predictions without a new trace (and compile), in ``train``
    and in ``train_many``, and a second fit reuses the program: on one device (with 90k rows,
    its kernels sum them in ranges) and with rows sharded over two."""
    if sharded:
        shard_training_rows(monkeypatch, rows_per_device=None)
    X, y = _regression_data(seed=6, n=n_rows)
    X_eval, y_eval = _regression_data(seed=7, n=500)
    traces = []
    original = boosting._grow_trees

    def counting(*args, **kwargs):
        traces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(boosting, "_grow_trees", counting)
    boosting.clear_compiled_rounds()
    settings = dict(num_rounds=3, max_depth=3, eval_set=[(X_eval, y_eval)])
    jb.train(X, y, **settings)
    jb.train(X, y, **settings)
    assert len(traces) == 1, f"a fit with an eval set traced its round {len(traces)} times"
    jb.train_many(X, y, batch={"reg_lambda": [1.0, 2.0]}, **settings)
    assert len(traces) == 2, f"train_many with an eval set traced its round {len(traces) - 1} times"
    boosting.clear_compiled_rounds()


def test_second_round_and_new_hyperparameters_do_not_recompile(monkeypatch):
    X, y = _regression_data(seed=5)
    traces = []
    derivatives = _counted_traces(monkeypatch, traced="_tree_statistics")
    original = boosting._grow_trees

    def counting(*args, **kwargs):
        traces.append(1)
        return original(*args, **kwargs)

    boosting.clear_compiled_rounds()
    boosting._grow_trees = counting
    try:
        jb.train(X, y, num_rounds=4, max_depth=3, learning_rate=0.3)
        assert len(traces) == 1, "the round was traced more than once for one shape"
        jb.train(X, y, num_rounds=3, max_depth=3, learning_rate=0.05, reg_lambda=5.0, reg_alpha=0.5,
                 min_child_weight=3.0, seed=3)
        assert len(traces) == 1, "new hyperparameter values recompiled the round"
        # Pruning is structure (left out where gamma cannot prune a split); gamma itself is traced.
        jb.train(X, y, num_rounds=2, max_depth=3, gamma=0.1)
        jb.train(X, y, num_rounds=2, max_depth=3, gamma=0.5, reg_lambda=3.0)
        assert len(traces) == 2, "a new gamma recompiled the round"
        assert derivatives["traced"] == 1, "a gamma that prunes traced the loss's derivatives again"
        # Bounding leaves (max_delta_step > 0) is structure: the split scores then take the
        # bounded form alone; the bound itself is traced.
        jb.train(X, y, num_rounds=2, max_depth=3, max_delta_step=0.7)
        jb.train(X, y, num_rounds=2, max_depth=3, max_delta_step=0.2, reg_lambda=3.0)
        assert len(traces) == 3, "a new max_delta_step recompiled the round"
        # Sampling is structure (left out of the program when off); its rates are traced, but
        # for the number of features a tree's sample keeps (the slots of its histograms).
        assert X.shape[1] == 5
        jb.train(X, y, num_rounds=2, max_depth=3, subsample=0.8, colsample_bytree=0.6, colsample_bynode=0.7)
        jb.train(X, y, num_rounds=2, max_depth=3, subsample=0.5, colsample_bytree=0.75, colsample_bynode=0.4)
        assert len(traces) == 4, "new sampling rates recompiled the round"
        jb.train(X, y, num_rounds=2, max_depth=3, subsample=0.5, colsample_bytree=0.9, colsample_bynode=0.4)
        assert len(traces) == 5, "a tree's sample of 4 features rather than 3 must trace a new round"
        jb.train(X, y, num_rounds=2, max_depth=2)
        assert len(traces) == 6, "a new depth must trace a new round"
    finally:
        boosting._grow_trees = original
        boosting.clear_compiled_rounds()


def _split_round_grows_the_model_of_one(X, y, settings: dict, monkeypatch) -> list:
    """Fits ``settings`` with the round as ``SplitRound``'s programs and as one program
    (``round_function``), asserts the two grew the same trees and eval histories, and returns
    the split rounds the fit asked for."""
    from jaxboost import training

    rounds = []

    def recorded(shape):
        rounds.append(boosting.compiled_round(shape))
        return rounds[-1]

    with monkeypatch.context() as patched:
        patched.setattr(training, "compiled_round", recorded)
        split = jb.train(X, y, **settings)

    class OneProgram:
        """The round as one program; a custom loss's refit decided as ``SplitRound`` decides it."""

        def __init__(self, shape):
            self.shape = shape
            self.program = jax.jit(boosting.round_function(shape), **boosting._round_jit_options(shape))

        def __call__(self, *arguments):
            return self.program(*arguments)

        def lower(self, *arguments):
            return self.program.lower(*arguments)

        def zero_hessian(self, *arguments):
            return boosting.compiled_round(self.shape).zero_hessian(*arguments)

        def constant_offsets(self, *arguments):
            return boosting.compiled_round(self.shape).constant_offsets(*arguments)

    with monkeypatch.context() as patched:
        patched.setattr(training, "compiled_round", OneProgram)
        whole = jb.train(X, y, **settings)
    for name, a, b in zip(split.trees._fields, split.trees, whole.trees):
        assert_same_training(np.asarray(a), np.asarray(b), err_msg=name)
    assert whole.evals_result.keys() == split.evals_result.keys()
    for eval_name, histories in whole.evals_result.items():
        assert histories.keys() == split.evals_result[eval_name].keys()
        for metric, history in histories.items():
            assert_same_training(split.evals_result[eval_name][metric], history, err_msg=metric)
    assert split.params["leaf_refit"] == whole.params["leaf_refit"]
    return rounds


@pytest.mark.parametrize("n_rows, settings", [
    (N_ROWS, dict(loss="logistic", subsample=0.7, colsample_bynode=0.6, eval_metric=["logloss", "auc", "loss"])),
    (N_ROWS, dict(loss="softmax", multi_strategy="multi_output_tree", hessian="floor", hessian_floor=0.05)),
    (90_000, dict(loss="squared_error", max_depth=6, sharded=True)),  # rows sharded over two devices
])
def test_a_round_of_several_programs_grows_the_model_of_one(n_rows, settings, monkeypatch):
    """A round without a leaf refit runs as two programs (the loss's derivatives, the trees with
    the eval sets' predictions and metrics), or three where a metric is the loss itself: it grows
    the model, and the eval histories, of the same round compiled as one program."""
    settings = dict(settings)
    if settings.pop("sharded", False):
        shard_training_rows(monkeypatch, rows_per_device=None)
    X, y = _binary_data(seed=4, n=n_rows)
    if settings["loss"] == "softmax":
        y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5]).astype(np.float32)
    common = {**dict(num_rounds=4, max_depth=4, learning_rate=0.3, eval_set=[(X[:300], y[:300])]), **settings}
    rounds = _split_round_grows_the_model_of_one(X, y, common, monkeypatch)
    assert [type(round_program) for round_program in rounds] == [boosting.SplitRound], rounds
    assert (rounds[0].metrics is not None) == ("loss" in settings.get("eval_metric", [])), rounds


def _counted_traces(monkeypatch, **functions: str) -> dict:
    """How many times each of ``boosting``'s functions (``kind=name``) is called from now on: a
    round's program calls them once, as it is traced."""
    traced = dict.fromkeys(functions, 0)

    def counting(kind, original):
        def traced_once(*args, **kwargs):
            traced[kind] += 1
            return original(*args, **kwargs)
        return traced_once

    for kind, name in functions.items():
        monkeypatch.setattr(boosting, name, counting(kind, getattr(boosting, name)))
    return traced


def test_a_new_loss_compiles_its_derivatives_but_not_the_trees(monkeypatch):
    """The round's trees read no loss: fits of new losses (custom ones, a built-in, the same
    custom loss defined again) on the same shapes and eval metrics trace the loss's derivatives
    anew, and reuse the one program of the trees; a metric that is the loss itself is computed
    apart from the trees, whose program then has no metrics, and a new metric does not trace the
    derivatives again."""
    X, y = _binary_data(seed=5)
    traced = _counted_traces(monkeypatch, trees="_grow_trees", derivatives="_tree_statistics")
    boosting.clear_compiled_rounds()
    settings = dict(num_rounds=2, max_depth=3, eval_set=[(X[:200], y[:200])], link="sigmoid")
    try:
        for loss, metric in [("logistic", "logloss"), (lambda raw, y: jax.nn.softplus(raw) - y * raw, "logloss"),
                             (lambda raw, y: jax.nn.softplus(raw) - y * raw, "logloss"),
                             (optax.losses.sigmoid_binary_cross_entropy, "logloss"),
                             (optax.losses.sigmoid_binary_cross_entropy, "loss")]:
            model = jb.train(X, y, loss=loss, eval_metric=metric, **settings)
            assert np.isfinite(model.evals_result["validation_0"][metric]).all()
    finally:
        boosting.clear_compiled_rounds()
    assert traced == {"trees": 2, "derivatives": 4}, traced


def _custom_absolute_error(raw_prediction, y):
    return jnp.abs(raw_prediction - y)


def _pinball(raw_prediction, y):
    residual = y - raw_prediction
    return jnp.maximum(0.8 * residual, -0.2 * residual)



def _clipped_absolute_error(raw_prediction, y):
    return jnp.minimum(jnp.abs(raw_prediction - y), 3.0)


def _half_squared_above(raw_prediction, y):
    return jnp.where(raw_prediction > y, 0.5 * (raw_prediction - y) ** 2, 0.0)


def _quantiles_at_once(raw_prediction, y):
    """Three quantiles' pinball losses, one output each."""
    taus = jnp.array([0.1, 0.5, 0.9])
    residual = y - raw_prediction
    return jnp.sum(jnp.maximum(taus * residual, (taus - 1) * residual))


def _multiclass_hinge(raw_prediction, y):
    """Crammer and Singer's: the margin of the true class over the best other one."""
    label = y.astype(jnp.int32)
    best_other = jnp.max(jnp.where(jnp.arange(raw_prediction.shape[0]) == label, -jnp.inf, raw_prediction))
    return jnp.maximum(0.0, 1.0 + best_other - raw_prediction[label])


@pytest.mark.parametrize("loss, loss_params, num_outputs, vanishes", [
    (_custom_absolute_error, None, None, True),
    (_pinball, None, None, True),
    (lambda raw, y, tau: jnp.maximum(tau * (y - raw), (tau - 1) * (y - raw)), {"tau": 0.3}, None, True),
    (lambda raw, y, band: jnp.maximum(jnp.abs(raw - y) - band["width"], 0.0), {"band": {"width": 0.5}}, None, True),
    (lambda raw, y: jnp.maximum(0.0, 1.0 - (2 * y - 1) * raw), None, None, True),  # hinge
    (_clipped_absolute_error, None, None, True),
    (_quantiles_at_once, None, 3, True),
    (_multiclass_hinge, None, 3, True),
    (lambda raw, y: 0.5 * (raw - y) ** 2, None, None, False),
    (_huber(1.0), None, None, False),  # zero in its tails alone
    (_half_squared_above, None, None, False),  # zero on one side alone
    (optax.losses.sigmoid_binary_cross_entropy, None, None, False),
    (lambda raw, y: jnp.abs(raw[0] - y) + (raw[1] - y) ** 2, None, 2, False),  # one output's Hessian zero
    (lambda raw, y: jax.nn.logsumexp(raw) - raw[y.astype(jnp.int32)], None, 3, False),  # softmax
])
def test_a_loss_whose_hessian_is_zero_everywhere_is_told_by_its_trace(loss, loss_params, num_outputs, vanishes):
    """Where autodiff's Hessian of a loss is the literal zero (piecewise-linear losses; for a
    vector of outputs, the literal broadcast to the matrix), its trace tells so without
    compiling; a Hessian zero for some inputs or entries alone is not told. Each answer agrees
    with the Hessians computed on labels and raw predictions on both sides of the kinks."""
    from jaxboost.derivatives import hessian_vanishes, values_gradients_and_hessian_matrices

    params = jax.tree_util.tree_map(jnp.float32, loss_params or {})
    label = jax.ShapeDtypeStruct((), jnp.float32)
    assert hessian_vanishes(loss, label, params, num_outputs) is vanishes
    with_params = lambda r, y: loss(r, y, **params)  # noqa: E731
    if num_outputs is None:
        raw, labels = np.meshgrid(np.linspace(-6, 6, 49, dtype=np.float32), np.array([0.0, 1.0], np.float32))
        _, hessians = gradients_and_hessians(with_params, raw.ravel(), labels.ravel())
    else:
        rng = np.random.default_rng(0)
        raw = rng.normal(scale=3.0, size=(200, num_outputs)).astype(np.float32)
        labels = rng.integers(0, num_outputs, size=200).astype(np.float32)
        _, _, hessians = values_gradients_and_hessian_matrices(with_params, raw, labels)
    assert bool(np.all(np.asarray(hessians) == 0)) is vanishes


def test_a_custom_loss_whose_trace_tells_its_refit_compiles_no_count_program(monkeypatch):
    """A piecewise-linear custom loss needs its leaves refit, as its trace tells: ``train_many``
    and a fit of no rounds compile no program to count zero Hessians, while a loss zero in part
    (Huber's tails) still counts them. So do multi-output losses."""
    from jaxboost import training

    X, y = _regression_data(seed=3, n=500)
    counted = []
    count_program = training.compiled_zero_hessian_count

    def counting(*args, **kwargs):
        counted.append(args[0])
        return count_program(*args, **kwargs)

    monkeypatch.setattr(training, "compiled_zero_hessian_count", counting)
    settings = dict(num_rounds=2, max_depth=2)
    models = jb.train_many(X, y, loss=_pinball, seeds=[0, 1], **settings)
    assert all(model.params["leaf_refit"] for model in models)
    assert jb.train(X, y, loss=_custom_absolute_error, num_rounds=0).params["leaf_refit"]
    assert counted == []
    jb.train_many(X, y, loss=_huber(0.01), seeds=[0, 1], **settings)
    assert len(counted) == 1
    two_outputs = jb.train(X, y, loss=lambda raw, y: jnp.sum(jnp.abs(raw - jnp.stack([y, -y]))),
                           num_outputs=2, num_rounds=0)
    assert two_outputs.params["leaf_refit"]
    assert len(counted) == 1
    huber_twice = jb.train(X, y, loss=lambda raw, y: jnp.sum(_huber(0.01)(raw, jnp.stack([y, -y]))),
                           num_outputs=2, num_rounds=0)
    assert huber_twice.params["leaf_refit"]
    assert len(counted) == 2


@pytest.mark.parametrize("settings", [
    dict(loss="absolute_error", subsample=0.7, eval_metric=["mae", "loss"]),
    dict(loss=_custom_absolute_error, eval_metric=["rmse"]),  # refit found from its zero Hessians
    dict(loss="absolute_error", monotone_constraints=[1, -1, 0, 0, 0]),  # refit leaves kept in bounds
    dict(loss="gaussian_nll", hessian="constant", multi_strategy="multi_output_tree", leaf_refit=True),
    dict(loss="softmax", leaf_refit=True, eval_metric=["mlogloss", "merror"]),  # 3 trees a round
])
def test_a_leaf_refit_round_of_several_programs_grows_the_model_of_one(settings, monkeypatch):
    """With a leaf refit the round runs as its derivatives', trees', refit's and (with eval
    metrics) metrics' programs: it grows the model, and the eval histories, of the same round
    compiled as one program, bit for bit on CPU."""
    X, y = _regression_data(seed=8, n=1500)
    if settings["loss"] == "softmax":
        y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5]).astype(np.float32)
    common = {**dict(num_rounds=4, max_depth=4, learning_rate=0.5, eval_set=[(X[:300], y[:300])]), **settings}
    rounds = _split_round_grows_the_model_of_one(X, y, common, monkeypatch)
    assert rounds[-1].refit is not None and rounds[-1].metrics is not None, rounds


@pytest.mark.parametrize("settings", [
    dict(max_depth=6, min_child_weight=20.0),  # many nodes that do not split
    dict(loss="absolute_error", monotone_constraints=[1, -1, 0, 0, 0], eval_set=True),
    dict(loss="softmax", multi_strategy="multi_output_tree", colsample_bynode=0.6, missing=True),
    dict(trainer="train_many", batch={"reg_lambda": [0.5, 2.0]}),
])
def test_a_gamma_that_prunes_nothing_leaves_the_pruning_out_and_grows_the_same_model(settings, monkeypatch):
    """A split's loss change is above ``MIN_LOSS_CHANGE``, so a gamma below it (the default 0)
    prunes nothing: the round leaves the pruning out (``grower.prunes_splits``) and grows, bit
    for bit on CPU (on a GPU within ``assert_same_training``'s allowance), the model of the round
    that prunes by that gamma."""
    from jaxboost import grower, training, vmapped_training

    settings = dict(settings)
    X, y = _regression_data(seed=9, n=1500)
    if settings.get("loss") == "softmax":
        y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5]).astype(np.float32)
    if settings.pop("missing", False):
        X = X.copy()
        X[np.random.default_rng(0).uniform(size=X.shape) < 0.1] = np.nan
    if settings.pop("eval_set", False):
        settings["eval_set"] = [(X[:300], y[:300])]
    trainer = settings.pop("trainer", "train")
    batch = settings.pop("batch", None)
    common = {**dict(num_rounds=4, max_depth=4, learning_rate=0.5), **settings}
    # A GPU's float atomics flip near ties between any two fits (a default direction did).
    common["deterministic_histogram"] = not repeatable_sums()

    def fit():
        if trainer == "train":
            model = jb.train(X, y, **common)
            return [model.predict_raw(X)] + [np.asarray(field) for field in model.trees]
        return [model.predict_raw(X) for model in jb.train_many(X, y, batch=batch, **common)]

    shapes = []
    compiled = {"train": (training, "compiled_round"), "train_many": (vmapped_training, "compiled_many_rounds")}
    module, name = compiled[trainer]
    factory = getattr(module, name)
    monkeypatch.setattr(module, name, lambda shape, *rest: shapes.append(shape) or factory(shape, *rest))
    left_out = fit()
    assert shapes and not any(shape.prune_splits for shape in shapes)
    monkeypatch.setattr(module, "prunes_splits", lambda gamma: True)
    pruned = fit()
    assert shapes[-1].prune_splits
    assert grower.prunes_splits(2 * grower.MIN_LOSS_CHANGE) and not grower.prunes_splits(grower.MIN_LOSS_CHANGE)
    for a, b in zip(left_out, pruned, strict=True):
        assert_same_training(a, b)


def test_a_new_refit_loss_compiles_its_derivatives_and_refit_but_not_the_trees(monkeypatch):
    """A leaf refit reads the loss after the trees are grown, in a program of its own: losses
    that need one (the built-in absolute error; custom absolute and pinball losses, found to
    need one by their zero Hessians) each trace their derivatives and refit, and share one
    program of the refit round's trees. The custom losses' traces foretell their refit (their
    Hessians are the literal zero), so no round without a refit is traced."""
    X, y = _regression_data(seed=5)
    traced = _counted_traces(monkeypatch, trees="_grow_trees", derivatives="_tree_statistics",
                             refit="_refit_and_move")
    boosting.clear_compiled_rounds()
    settings = dict(num_rounds=2, max_depth=3, eval_set=[(X[:200], y[:200])], eval_metric="mae")
    try:
        for loss in ["absolute_error", _custom_absolute_error, _pinball, _custom_absolute_error]:
            model = jb.train(X, y, loss=loss, **settings)
            assert model.params["leaf_refit"], loss
            assert np.isfinite(model.evals_result["validation_0"]["mae"]).all()
    finally:
        boosting.clear_compiled_rounds()
    assert traced == {"trees": 1, "derivatives": 3, "refit": 3}, traced


@pytest.mark.parametrize("settings, trees_programs", [
    # The trees' twice: the round without a refit (compiled while the start was found, the
    # trace leaving the refit unknown: Huber's Hessian is 1 in its middle), then the refit
    # round's, for the rows in its tails at the start.
    (dict(loss=_huber(0.1), eval_metric="mae"), 2),
    # Once: the trace foretells the refit (the pinball's Hessian is the literal zero), for one
    # output or several.
    (dict(loss=_pinball, eval_metric="mae"), 1),
    (dict(loss=_quantiles_at_once, num_outputs=3, eval_metric="loss"), 1),
    (dict(loss="gaussian_nll", hessian="constant", multi_strategy="multi_output_tree", leaf_refit=True,
          eval_metric="loss"), 1),
])
def test_a_refit_round_is_compiled_ahead_and_once(settings, trees_programs, monkeypatch):
    """A refit round's programs are compiled before its first call, the refit beside the trees
    (in the compiling thread), for the shapes the trees' program gives it (a sharding or dtype
    off would compile it again in the call): a custom loss whose zero Hessians at the start
    call for a refit (its derivatives, compiled for the round without one, serve the refit
    round), one whose trace foretells it, and vector leaves refit on a built-in."""
    import threading

    shard_training_rows(monkeypatch, rows_per_device=None)
    X, y = _regression_data(seed=9, n=50_000)  # rows sharded over two devices
    compiles = []

    def listener(name, duration, **kwargs):
        if name.endswith("backend_compile_duration") and "round" in str(kwargs.get("fun_name")):
            compiles.append((kwargs["fun_name"], threading.current_thread() is threading.main_thread()))

    boosting.clear_compiled_rounds()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        model = jb.train(X, y, num_rounds=3, max_depth=3, eval_set=[(X[:200], y[:200])], **settings)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        boosting.clear_compiled_rounds()
    assert model.params["leaf_refit"]
    programs = collections.Counter(name for name, _ in compiles)
    assert programs == {"jit(round_statistics)": 1, "jit(round_trees)": trees_programs, "jit(round_refit)": 1,
                        "jit(round_metrics)": 1}, compiles
    assert [in_main for name, in_main in compiles if name == "jit(round_refit)"] == [False], compiles


def _exported_custom_calls(function, arguments, platform: str, allowed=()) -> set:
    """The custom calls of ``function`` exported for ``platform`` (JAX's export refuses any
    without a stability guarantee but ``allowed``)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in allowed]
    text = jax.export.export(jax.jit(function), platforms=[platform], disabled_checks=checks)(*arguments).mlir_module()
    return set(re.findall(r"custom_call @([\w.$-]+)", text))


def _unsharded(tree):
    """``tree``'s arrays as shapes with no placement (one device's program)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, tree)


@pytest.mark.parametrize("settings", [
    dict(loss="logistic", eval_set=True, colsample_bynode=0.5),
    # A leaf refit (its own program); fixed-point histograms and refit sums, as accelerators sum them.
    dict(loss="absolute_error", subsample=0.5, deterministic_histogram=True),
    dict(loss="softmax", multi_strategy="multi_output_tree", max_delta_step=0.7),
    dict(loss=lambda raw, y: jnp.log1p(jnp.exp(-raw * (2 * y - 1))), monotone_constraints=[1, 0, 0, 0, 0]),
])
def test_every_program_of_a_round_lowers_for_a_gpu(monkeypatch, settings):
    """The code a GPU runs lowers for one from this machine: each of a round's programs (the
    derivatives', the trees', a refit's, the eval metrics') and its starting value's, traced as
    a GPU's round traces it (``mesh_platform`` "gpu": the accelerators' XLA kernels, no native
    one), exports for CUDA, where JAX refuses any custom call without a stability guarantee,
    and calls none of the CPU's native kernels. (The round's shape is this machine's: its
    devices are CPUs.) Lowered for the CPU, the trees' program does call them."""
    from jaxboost import native

    X, y = _binary_data(seed=3)
    settings = dict(settings)
    if settings.get("loss") == "softmax":
        y = y + (X[:, 1] > 0)
    if settings.pop("eval_set", False):
        settings["eval_set"] = [(X[:200], y[:200])]

    shape, arguments = round_shape_and_arguments(monkeypatch, X, y, max_depth=DEPTH, **settings)
    split_round = boosting.compiled_round(shape)  # its programs jitted, not compiled
    statistics_arguments, trees_arguments, refit_arguments, metrics_arguments = split_round.program_arguments(arguments)
    # Each program as (made when traced, after the platform is set; its arguments).
    made = functools.partial
    programs = {"statistics": (made(boosting.round_statistics_function, boosting.statistics_shape(shape)),
                               statistics_arguments),
                "trees": (made(boosting.round_trees_function, boosting.trees_shape(shape)), trees_arguments)}
    if split_round.refit:
        programs["refit"] = (made(boosting.round_refit_function, boosting.refit_shape(shape)), refit_arguments)
    if split_round.metrics:
        programs["metrics"] = (made(boosting.round_metrics_function, boosting.metrics_shape(shape)),
                               metrics_arguments)
    assert ("refit" in programs) == (settings["loss"] == "absolute_error"), list(programs)

    # The starting value's program too: Newton steps for several outputs, an exact 1-D
    # minimisation for one (both on one device, its arguments unsharded).
    objective, K = shape.objective, shape.objective.num_outputs
    starting_arguments = _unsharded((jnp.zeros((arguments[3].shape[0], K)), arguments[3], arguments[4],
                                     arguments[0].loss_params))
    if K > 1:
        programs["starting value"] = (lambda: functools.partial(boosting.newton_constant, objective),
                                      starting_arguments)
    else:
        programs["starting value"] = (lambda: functools.partial(boosting._coordinate_sweeps, objective),
                                      starting_arguments + (jax.ShapeDtypeStruct((K,), jnp.float32),))

    native_targets = set(native._SYMBOLS)
    if jax.default_backend() == "cpu" and native.native_target(native.HISTOGRAM_TARGET) is not None:
        make, part_arguments = programs["trees"]
        on_cpu = _exported_custom_calls(make(), part_arguments, "cpu", allowed=native_targets)
        assert on_cpu & native_targets, f"the CPU's trees call no native kernel: {sorted(on_cpu)}"
    monkeypatch.setattr(boosting, "mesh_platform", lambda mesh: "gpu")
    for name, (make, part_arguments) in programs.items():
        assert not _exported_custom_calls(make(), part_arguments, "cuda") & native_targets, name


@pytest.mark.parametrize("loss", ["logistic", "absolute_error"])
def test_train_many_rounds_lower_for_a_gpu(monkeypatch, loss):
    """``train_many``'s round as a GPU runs it (its models vmapped, not looped over as on a CPU;
    one device; with absolute error, the models' leaf refits, several probes a step) exports for
    CUDA and calls none of the CPU's native kernels."""
    from jaxboost import line_search, native, vmapped_training

    X, y = _binary_data(seed=4)
    probes = []
    probes_per_step = line_search.probes_per_step

    def recorded_probes():
        probes.append(probes_per_step())
        return probes[-1]

    monkeypatch.setattr(line_search, "probes_per_step", recorded_probes)

    def stop_before_compiling(shape, params_axes, models_mesh, arguments):
        raise Lowering(shape, params_axes, arguments)

    monkeypatch.setattr(vmapped_training, "stored_many_rounds", stop_before_compiling)
    with pytest.raises(Lowering) as stopped:
        jb.train_many(X, y, batch={"reg_lambda": [1.0, 2.0, 3.0]}, num_rounds=1, max_depth=DEPTH, loss=loss,
                      eval_set=[(X[:200], y[:200])])
    shape, params_axes, arguments = stopped.value.args
    monkeypatch.setattr(boosting, "mesh_platform", lambda mesh: "gpu")
    assert "gpu" not in boosting.MODELS_IN_A_LOOP_PLATFORMS
    calls = _exported_custom_calls(boosting.many_rounds_function(shape, params_axes), _unsharded(arguments), "cuda")
    assert not calls & set(native._SYMBOLS), sorted(calls)
    # The refits' searches, traced for the GPU, take its probes.
    assert probes == ([line_search.ACCELERATOR_PROBES] if loss == "absolute_error" else []), probes


@pytest.mark.parametrize("trainer, settings", [("train", dict()),
                                               ("train", dict(subsample=0.5, eval_set=True, loss="logistic")),
                                               ("train", dict(loss=lambda raw, y: 0.5 * (raw - y) ** 2)),
                                               ("train_many", dict(eval_set=True, loss="logistic"))])
def test_a_first_fit_compiles_its_round_once_in_other_threads_while_it_finds_the_starting_value(monkeypatch, trainer,
                                                                                              settings):
    """The round is compiled ahead of its first call, for the raw predictions' shapes, while the
    caller's thread finds the starting value: the call then takes those programs (a mismatch,
    such as another sharding, would lower and compile the round a second time). The caller's
    thread lowers the round's programs in turn, the trees' first, and each compiles in another
    thread; the starting value comes once they are all lowered (tracing both at once, the
    threads had taken turns on the GIL). For a custom loss, the raw predictions start there
    too, where the round's derivatives tell whether it needs a leaf refit. The
    memory the compiler freed is handed back before the first round. A second fit of the same
    shapes finds the round compiled."""
    import threading

    from jaxboost import training, vmapped_training

    X, y = _regression_data(seed=6)
    settings = dict(settings)
    if settings.pop("eval_set", False):
        y = (y > np.median(y)).astype(np.float32)
        settings["eval_set"] = [(X[:300], y[:300])]
    lowered, compiled_by, starting_threads, steps, in_64_bits, order = [], [], [], [], [], []

    def listener(name, duration, **kwargs):
        if "round" not in str(kwargs.get("fun_name")):
            return
        if name.endswith("jaxpr_to_mlir_module_duration"):
            lowered.append((threading.get_ident(), kwargs.get("fun_name")))
            steps.append("round lowered")
            order.append("round lowered")
        elif name.endswith("backend_compile_duration"):  # also a persistent-cache hit
            compiled_by.append(threading.get_ident())
            steps.append("round compiled")

    def recording(finding_starting_value):
        """A way of finding the starting value (numerically, by the compiled round's programs, or
        a built-in's closed form: one call for each of train_many's models), recorded."""
        def recorded(*args, **kwargs):
            starting_threads.append(threading.get_ident())
            order.append("starting value")
            in_64_bits.append(jax.config.jax_enable_x64)
            return finding_starting_value(*args, **kwargs)
        return recorded

    module, factory_name = ((training, "compiled_round") if trainer == "train"
                            else (vmapped_training, "compiled_many_rounds"))
    factory = getattr(module, factory_name)

    @functools.lru_cache(maxsize=None)  # one round a shape, as the library's cache gives
    def recording_factory(*key):
        compiled = factory(*key)

        def call(*args):
            steps.append("round called")
            return compiled(*args)
        # A first fit compiles the round ahead (a jitted round as one program, a ``SplitRound``
        # as its programs in turn); a custom loss's refit is decided by the round's derivatives.
        for method in ("lower", "lower_in_turn", "zero_hessian", "derivative_sums", "constant_offsets"):
            if hasattr(compiled, method):
                setattr(call, method, getattr(compiled, method))
        return call

    def fit(num_rounds=3):
        if trainer == "train":
            return jb.train(X, y, num_rounds=num_rounds, max_depth=3, **settings).predict_raw(X)
        models = jb.train_many(X, y, batch={"reg_lambda": [1.0, 2.0, 3.0]}, num_rounds=num_rounds, max_depth=3,
                               **settings)
        return np.stack([model.predict_raw(X) for model in models])

    def recording_release():
        steps.append("pages handed back")
        return release_free_memory()

    release_free_memory = training.release_free_memory
    monkeypatch.setattr(module, "starting_value", recording(boosting.starting_value))
    monkeypatch.setattr(module, "closed_form_starting_value", recording(training.closed_form_starting_value))
    # A custom loss's: found by the compiled round's derivatives.
    monkeypatch.setattr(training, "_starting_value_by_round", recording(training._starting_value_by_round))
    monkeypatch.setattr(module, factory_name, recording_factory)
    monkeypatch.setattr(training, "release_free_memory", recording_release)
    boosting.clear_compiled_rounds()
    jax.monitoring.register_event_duration_secs_listener(listener)
    # JAX's 64-bit mode on for the process: jaxboost's float32 context is the caller's
    # thread's, and the compiling threads must compile in 32 bits too (else each program
    # compiles again at its first call).
    jax.config.update("jax_enable_x64", True)
    try:
        zero_rounds = fit(num_rounds=0)  # no round to run: none compiled, the starting value alone
        assert not steps and set(starting_threads) == {threading.get_ident()}, (steps, starting_threads)
        assert np.all(np.ptp(zero_rounds, axis=-1) == 0), "a model of no rounds predicts one constant"
        starting_threads.clear()
        order.clear()
        first = fit()
        first_fit_order = list(order)
        first_fit_steps = list(steps)
        again = fit()
    finally:
        jax.config.update("jax_enable_x64", False)
        jax.monitoring.unregister_event_duration_listener(listener)
        boosting.clear_compiled_rounds()
    # One program a round (train_many's), or a round's statistics, trees and eval metrics.
    programs = len(lowered)
    assert programs == (1 if trainer == "train_many" else 2), lowered
    assert {thread for thread, _ in lowered} == {threading.get_ident()}, "a program was lowered by another thread"
    assert len({program for _, program in lowered}) == programs, f"a program was lowered twice: {lowered}"
    assert trainer == "train_many" or "round_trees" in str(lowered[0][1]), f"the trees' program first: {lowered}"
    assert compiled_by and threading.get_ident() not in compiled_by, "a program was compiled by the caller's thread"
    assert set(starting_threads) == {threading.get_ident()}, starting_threads
    assert first_fit_order[:programs + 1] == ["round lowered"] * programs + ["starting value"], first_fit_order
    # Compiled before its first call, and once; the free pages the compiler left are handed back
    # before the rounds' buffers come on top of them.
    compiling = first_fit_steps[:2 * programs]
    assert compiling[0] == "round lowered" and sorted(compiling) == ["round compiled"] * programs + [
        "round lowered"] * programs, first_fit_steps
    assert first_fit_steps[2 * programs:2 * programs + 2] == ["pages handed back", "round called"], first_fit_steps
    assert steps.count("round compiled") == programs and steps.count("pages handed back") == 1, steps
    assert not any(in_64_bits), in_64_bits
    assert np.all(np.isfinite(first))
    assert_same_training(again, first)


@needs_repeatable_sums
def test_same_seed_identical_and_other_seed_different():
    X, y = _regression_data()
    sampled = dict(COMMON, subsample=0.7, colsample_bytree=0.8, colsample_bylevel=0.8, colsample_bynode=0.8)
    first = jb.train(X, y, seed=7, **sampled).predict(X)
    second = jb.train(X, y, seed=7, **sampled).predict(X)
    other = jb.train(X, y, seed=8, **sampled).predict(X)
    np.testing.assert_array_equal(first, second)
    assert not np.allclose(first, other)


def test_zero_weight_rows_are_the_same_as_absent_rows():
    X, y = _regression_data()
    kept = 980  # 980 and 1000 rows fall in the same padded bucket
    weights = np.r_[np.ones(kept), np.zeros(N_ROWS - kept)]
    weighted = jb.train(X, y, sample_weight=weights, **COMMON)
    subset = jb.train(X[:kept], y[:kept], **COMMON)
    np.testing.assert_allclose(weighted.predict(X), subset.predict(X), rtol=1e-5, atol=1e-5)


def test_integer_weights_equal_duplicated_rows():
    rng = np.random.default_rng(2)
    X = rng.integers(0, 40, size=(500, N_FEATURES)).astype(np.float32)  # few distinct values: same edges
    y = X[:, 0] - 0.5 * X[:, 1] + rng.normal(size=500)
    weights = rng.integers(1, 3, size=500).astype(np.float32)
    weighted = jb.train(X, y, sample_weight=weights, **COMMON)
    repeats = weights.astype(int)
    duplicated = jb.train(np.repeat(X, repeats, axis=0), np.repeat(y, repeats), **COMMON)
    np.testing.assert_allclose(weighted.predict(X), duplicated.predict(X), rtol=1e-4, atol=1e-4)


def test_dataset_reuse_equals_raw_arrays():
    X, y = _regression_data()
    dataset = jb.Dataset(X, y)
    assert_same_training(jb.train(dataset, **COMMON).predict(X), jb.train(X, y, **COMMON).predict(X))


def test_early_stopping_uses_best_iteration():
    X, y = _regression_data()
    X_val, y_val = _regression_data(seed=1)
    model = jb.train(X, y, num_rounds=200, max_depth=DEPTH, learning_rate=0.8, eval_set=[(X_val, y_val)],
                     early_stopping_rounds=5)
    history = model.evals_result["validation_0"]["rmse"]
    assert model.best_iteration == int(np.argmin(history))
    assert len(history) == model.best_iteration + 6 < 200
    best_rmse = np.sqrt(np.mean((model.predict(X_val) - y_val) ** 2))
    np.testing.assert_allclose(best_rmse, history[model.best_iteration], rtol=1e-4)
    all_rounds = model.predict(X_val, iteration_range=(0, model.num_rounds))
    assert not np.allclose(all_rounds, model.predict(X_val))


def test_base_margin_offsets_the_raw_prediction():
    X, y = _binary_data()
    margin = np.full(N_ROWS, 0.7, np.float32)
    model = jb.train(X, y, loss="logistic", base_margin=margin, **COMMON)
    np.testing.assert_array_equal(model.base_score, [0.0])
    shifted = model.predict_raw(X, base_margin=margin + 1.0)
    np.testing.assert_allclose(shifted - model.predict_raw(X, base_margin=margin), 1.0, rtol=1e-5)


def test_starting_value_is_the_loss_minimiser_not_a_constant():
    X, y = _binary_data()
    model = jb.train(X, y, loss="logistic", num_rounds=0, max_depth=DEPTH)
    mean = np.mean(y)
    np.testing.assert_allclose(model.base_score[0], np.log(mean / (1 - mean)), rtol=1e-4)
    np.testing.assert_allclose(model.predict(X), mean, rtol=1e-4)


def test_scale_pos_weight_moves_predictions_up():
    X, y = _binary_data()
    plain = jb.train(X, y, loss="logistic", **COMMON).predict(X).mean()
    upweighted = jb.train(X, y, loss="logistic", scale_pos_weight=3.0, **COMMON).predict(X).mean()
    assert upweighted > plain + 0.05


def test_max_delta_step_bounds_every_leaf():
    X, y = _regression_data()
    model = jb.train(X, 100 * y, max_delta_step=0.5, num_rounds=3, max_depth=DEPTH, learning_rate=1.0)
    leaves = model.trees.value[model.trees.is_leaf]
    assert np.abs(leaves).max() <= 0.5 + 1e-6


# ---------------------------------------------------------------- bad input -> clear errors
@pytest.mark.parametrize("bad, message", [(np.nan, "NaN or infinite label"), (np.inf, "NaN or infinite label")])
def test_non_finite_labels_are_rejected(bad, message):
    X, y = _regression_data()
    y = y.copy()
    y[3] = bad
    with pytest.raises(ValueError, match=message):
        jb.train(X, y, **COMMON)


def test_labels_beyond_float32_range_are_rejected_by_name():
    X, y = _regression_data()
    y = y.astype(np.float64)
    y[5] = 1e39  # finite in float64, infinite in the float32 that training computes in
    with pytest.raises(ValueError, match="beyond float32's range .first at row 5"):
        jb.train(X, y, **COMMON)


def test_dataset_holds_labels_once_and_default_weights_take_no_memory():
    """A Dataset's labels are its own float32 copy (changing the caller's array afterwards does
    not change them); weights left out are ones without a value per row."""
    X, y = _regression_data()
    for given in (y.astype(np.float32), y.astype(np.float64), np.round(y).astype(np.int64)):
        dataset = jb.Dataset(X, given)
        assert dataset.y.dtype == np.float32 and not np.shares_memory(dataset.y, given)
        np.testing.assert_array_equal(dataset.y, given.astype(np.float32))
    caller_labels = y.astype(np.float32)
    dataset = jb.Dataset(X, caller_labels)
    caller_labels[:] = np.nan
    assert np.isfinite(dataset.y).all()
    assert dataset.sample_weight.shape == (len(X),) and dataset.sample_weight.strides == (0,)
    np.testing.assert_array_equal(dataset.sample_weight, 1.0)
    assert not dataset.sample_weight.flags.writeable


def test_rounds_donate_raw_predictions_and_read_row_indices_only_when_sampling(monkeypatch):
    """Each round writes its raw predictions over the last ones, in the same buffer (the
    argument is donated and the update kernel aliases it, so a round holds one copy); the row indices are passed, and built, only for row sampling. The
    model is the same as without donation."""
    from jaxboost import boosting, training

    X, y = _regression_data()
    for subsample in (1.0, 0.5):
        seen, written_over = [], []

        def recording(shape, donate=True):
            compiled = boosting.compiled_round.__wrapped__(shape) if donate else jax.jit(boosting.round_function(shape))

            def call(*args):
                seen.append(args)
                raw = args[boosting.RAW_PREDICTION_ARGUMENT]
                before = [shard.data.unsafe_buffer_pointer() for shard in raw.addressable_shards]
                result = compiled(*args)
                after = [shard.data.unsafe_buffer_pointer() for shard in result[0].addressable_shards]
                written_over.append(before == after)
                return result
            # A first fit compiles the round ahead of its first call: a jitted round as one
            # program, a ``SplitRound`` as its programs in turn.
            if donate:
                call.lower_in_turn = compiled.lower_in_turn
            else:
                call.lower = compiled.lower
            return call

        monkeypatch.setattr(training, "compiled_round", recording)
        model = jb.train(X, y, subsample=subsample, num_rounds=3, max_depth=DEPTH)
        assert len(seen) == 3
        raw_predictions = [args[boosting.RAW_PREDICTION_ARGUMENT] for args in seen]
        assert all(raw.is_deleted() for raw in raw_predictions)
        # The first round's input may be the caller's host memory, which is not written over.
        assert all(written_over[1:]), written_over
        row_indices = [args[5] for args in seen]
        assert all((index is None) == (subsample == 1.0) for index in row_indices)
        monkeypatch.setattr(training, "compiled_round", lambda shape: recording(shape, donate=False))
        kept = jb.train(X, y, subsample=subsample, num_rounds=3, max_depth=DEPTH)
        assert_same_training(model.predict_raw(X), kept.predict_raw(X))


@pytest.mark.parametrize("n_rows, settings", [
    (N_ROWS, dict(loss="softmax", max_depth=7)),  # three trees a round share the buffer
    (N_ROWS, dict(loss="softmax", max_depth=7, multi_strategy="multi_output_tree")),
    (90_000, dict(loss="squared_error", max_depth=8, sharded=True)),  # rows (and the buffer) sharded over two devices
    (90_000, dict(loss="squared_error", max_depth=6)),  # one device, its rows summed in ranges
    (N_ROWS, dict(loss="softmax", max_depth=4)),  # the shallow loop's buffer
    (90_000, dict(loss="squared_error", max_depth=6, multi_strategy="multi_output_tree", sharded=True)),
])
@needs_repeatable_sums  # on an H100 two zeroed fits of softmax at depth 7 differed in a split
def test_trees_never_read_what_their_histogram_buffer_held(n_rows, settings, monkeypatch):
    """Trees grow their widest level loop (the deep levels', or a tree of depth 6 or less its
    shallow one) in a histogram buffer that the rounds pass on, donated and written in place (so
    it is not in a round's scratch memory, and a shallow tree's slots need no zeroing).
    Whatever it holds when a tree starts (the last tree's histograms; here first random sums,
    which would score real splits if read) is never read: the model is the one grown from a
    zeroed buffer, bit for bit."""
    from jaxboost import boosting, training

    settings = dict(settings)
    if settings.pop("sharded", False):
        shard_training_rows(monkeypatch, rows_per_device=None)
    X, y = _regression_data(seed=8, n=n_rows)
    if settings["loss"] == "softmax":
        y = np.digitize(y, [-1.0, 1.0]).astype(np.float32)
    common = dict(num_rounds=3, learning_rate=0.3, **settings)
    zeroed = jb.train(X, y, **common)

    def garbage_filled(shape, n_features, models=None):
        buffer = boosting.histogram_buffer(shape, n_features, models)
        garbage = np.abs(np.random.default_rng(9).normal(scale=50.0, size=buffer.shape)).astype(np.float32)
        return jax.device_put(garbage, buffer.sharding)

    in_place = []

    def recording(shape):
        compiled = boosting.compiled_round(shape)

        def call(*args):
            buffer = args[boosting.HISTOGRAM_BUFFER_ARGUMENT]
            before = [shard.data.unsafe_buffer_pointer() for shard in buffer.addressable_shards]
            result = compiled(*args)
            in_place.append(buffer.is_deleted() and before == [
                shard.data.unsafe_buffer_pointer() for shard in result[-1].addressable_shards])
            return result
        call.lower_in_turn = compiled.lower_in_turn
        return call

    monkeypatch.setattr(training, "histogram_buffer", garbage_filled)
    monkeypatch.setattr(training, "compiled_round", recording)
    poisoned = jb.train(X, y, **common)
    assert_same_training(poisoned.predict_raw(X), zeroed.predict_raw(X))
    # The first round's buffer may be the host array it was made from, which is not written over.
    assert len(in_place) == 3 and all(in_place[1:]), in_place


@pytest.mark.parametrize("loss, label", [("logistic", 2.0), ("poisson", -1.0), ("softmax", 1.5), ("gamma", 0.0)])
def test_labels_outside_a_loss_range_are_rejected(loss, label):
    X, y = _binary_data()
    y = y.copy()
    y[0] = label
    with pytest.raises(ValueError, match=loss):
        jb.train(X, y, loss=loss, **COMMON)


@pytest.mark.parametrize("trainer", ["train", "train_many"])
@pytest.mark.parametrize("loss, metric", [("gaussian_nll", "mae"), ("softmax", "auc"),
                                          ("squared_error", lambda y, y_pred, weight: y_pred[:, 1])])
def test_an_eval_metric_that_cannot_score_the_loss_is_rejected_by_name_before_compiling(trainer, loss, metric):
    """A metric of one output given a loss of several (or one that fails on the predictions'
    shape) names itself and the loss, before any round compiles: XLA's reshape error from
    inside the compiled round had named neither."""
    X, y = _binary_data(seed=2, n=300)
    if loss == "softmax":
        y = np.digitize(X[:, 0], [-0.5, 0.5]).astype(np.float32)
    compiled = []

    def listener(name, duration, **kwargs):
        if name.endswith("backend_compile_duration") and "round" in str(kwargs.get("fun_name")):
            compiled.append(kwargs["fun_name"])

    settings = dict(loss=loss, num_rounds=2, max_depth=2, eval_set=[(X, y)], eval_metric=metric)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        name = metric if isinstance(metric, str) else "<lambda>"
        with pytest.raises(ValueError, match=f"eval metric '{name}' cannot score loss '{loss}'"):
            if trainer == "train":
                jb.train(X, y, **settings)
            else:
                jb.train_many(X, y, batch={"reg_lambda": [1.0, 2.0]}, **settings)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiled, compiled


def test_length_mismatch_and_feature_count_and_non_numeric():
    X, y = _regression_data()
    with pytest.raises(ValueError, match="labels but X has"):
        jb.train(X, y[:-1], **COMMON)
    model = jb.train(X, y, num_rounds=1, max_depth=DEPTH)
    with pytest.raises(ValueError, match="has 4 features but the model was trained on 5"):
        model.predict(X[:, :4])
    with pytest.raises(TypeError, match="numeric"):
        jb.train(np.array([["a", "b"], ["c", "d"]]), [0.0, 1.0])
    with pytest.raises(ValueError, match="sample_weight"):
        jb.train(X, y, sample_weight=np.zeros(N_ROWS), **COMMON)
    with pytest.raises(ValueError, match="learning_rate"):
        jb.train(X, y, learning_rate=-0.1)
    with pytest.raises(ValueError, match="infinite"):
        jb.train(np.where(X > 2, np.inf, X), y)
    # Found past NaN (which is allowed), with its place: -inf where a column is otherwise NaN.
    with_nan = np.where(X > 0, np.nan, X)
    with_nan[:, 3] = np.nan
    with_nan[7, 3] = -np.inf
    with pytest.raises(ValueError, match=r"infinite values \(first at row 7, feature 3\)"):
        jb.train(with_nan, y)


def test_dataframe_columns_must_match_the_training_columns():
    pd = pytest.importorskip("pandas")
    X, y = _regression_data()
    names = [f"f{i}" for i in range(X.shape[1])]
    frame = pd.DataFrame(X, columns=names)
    model = jb.train(frame, y, num_rounds=1, max_depth=DEPTH)
    reordered = frame[names[::-1]]
    with pytest.raises(ValueError, match="different order"):
        model.predict(reordered)
    with pytest.raises(ValueError, match=r"missing \['f0'\], unexpected \['g0'\]"):
        model.predict(frame.rename(columns={"f0": "g0"}))
    with pytest.raises(ValueError, match="different order"):
        jb.train(frame, y, num_rounds=1, max_depth=DEPTH, eval_set=[(reordered, y)])
    np.testing.assert_array_equal(model.predict(reordered[names]), model.predict(X))  # plain arrays carry no names


def test_custom_loss_with_non_finite_gradients_names_loss_and_round():
    X, y = _regression_data()

    def barrier_loss(raw_prediction, y):
        # A user's bug: the loss is NaN once a raw prediction passes 4, which later rounds reach.
        return jnp.where(raw_prediction > 4.0, jnp.nan, 0.5 * (raw_prediction - y) ** 2)

    with pytest.raises(FloatingPointError, match=r"barrier_loss.*round [1-9]"):
        jb.train(X, 5.0 * y, loss=barrier_loss, **COMMON)


def test_custom_loss_with_negative_hessian_is_rejected():
    X, y = _regression_data()

    def concave(raw_prediction, y):
        return -((raw_prediction - y) ** 2)

    with pytest.raises(ValueError, match=r"concave.*negative Hessians.*round 0"):
        jb.train(X, y, loss=concave, **COMMON)


def test_round_health_is_read_from_the_marked_gradients_and_hessians():
    """A counted row whose loss value, gradient or Hessian is not finite marks its gradient NaN,
    one with a negative Hessian marks its split Hessian -inf, and the round's health is read off
    the sums; rows that do not count (weight 0) mark nothing, and finite rows keep their exact
    weighted gradients."""
    from jaxboost.boosting import _marked_gradients, _round_health, _split_hessians

    from jax.sharding import Mesh, PartitionSpec

    def marked(values, g, h, weight):
        counted = weight > 0
        gradients = _marked_gradients(counted, values, g[:, None], h[:, None], weight)
        return _round_health(gradients, _split_hessians(counted, h[:, None], weight)), gradients[:, 0]

    # The sums run over the rows' mesh axis, as inside a round.
    rows = PartitionSpec("rows")
    on_mesh = jax.jit(jax.shard_map(marked, mesh=Mesh(np.array(jax.devices()[:1]), ("rows",)), in_specs=rows,
                                    out_specs=(PartitionSpec(), rows), check_vma=False))

    def health(values, g, h, weight):
        flags, gradients = on_mesh(*(jnp.asarray(a, jnp.float32) for a in (values, g, h, weight)))
        return bool(flags.non_finite), bool(flags.negative_hessian), np.asarray(gradients)

    fine = dict(values=[1.0, 2.0, 3.0], g=[0.5, -1.5, 2.0], h=[1.0, 0.0, 2.0], weight=[1.0, 2.0, 0.5])
    non_finite, negative, gradients = health(**fine)
    assert (non_finite, negative) == (False, False)
    np.testing.assert_array_equal(gradients, np.float32([0.5, -3.0, 1.0]))
    for field, index, bad in [("values", 1, np.nan), ("values", 0, np.inf), ("g", 2, np.nan), ("h", 0, np.inf)]:
        case = {name: list(value) for name, value in fine.items()}
        case[field][index] = bad
        assert health(**case)[:2] == (True, False), f"{field}[{index}] = {bad}"
        case["weight"][index] = 0.0  # the same row, not counted
        assert health(**case)[:2] == (False, False), f"{field}[{index}] = {bad} with weight 0"
    assert health(**{**fine, "h": [1.0, -0.5, 2.0]})[:2] == (False, True)
    assert health(**{**fine, "h": [1.0, -0.5, 2.0], "weight": [1.0, 0.0, 0.5]})[:2] == (False, False)
    assert health(**{**fine, "g": [3e38, 3e38, 0.0], "weight": [1.0, 1.0, 1.0]})[:2] == (True, False)  # overflow


@pytest.mark.parametrize("hessian", ["diagonal", "full"])
def test_vector_leaves_reject_a_custom_loss_whose_hessian_is_not_finite(hessian):
    """A vector loss whose value and gradient are finite but whose Hessian diagonal is NaN for
    some rows (here those whose first raw output passes 1, which later rounds reach) fails the
    round with the loss's name, whichever Hessian entries the trees read."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N_ROWS, N_FEATURES)).astype(np.float32)
    y = np.argmax(X[:, :2] + 0.3 * rng.normal(size=(N_ROWS, 2)), axis=1)

    @jax.custom_jvp
    def one(x):
        return jnp.ones_like(x)

    @one.defjvp
    def _one_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return one(x), jnp.where(x > 1.0, jnp.nan, 0.0) * t

    @jax.custom_jvp
    def identity(x):
        return x

    @identity.defjvp
    def _identity_jvp(primals, tangents):
        # The derivative is one(x) = 1, whose own derivative is NaN past 1: finite gradients,
        # a NaN second derivative.
        (x,), (t,) = primals, tangents
        return identity(x), one(x) * t

    def kinked_softmax(raw_prediction, y):
        raw_prediction = raw_prediction.at[0].set(identity(raw_prediction[0]))
        return jax.nn.logsumexp(raw_prediction) - raw_prediction[y.astype(jnp.int32)]

    with pytest.raises(FloatingPointError, match=r"kinked_softmax.*round [0-9]"):
        jb.train(X, y, loss=kinked_softmax, num_outputs=2, link="softmax", multi_strategy="multi_output_tree",
                 multi_output_hessian=hessian, **{**COMMON, "learning_rate": 1.0, "num_rounds": 20})


def test_custom_vector_loss_with_num_outputs():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N_ROWS, N_FEATURES)).astype(np.float32)
    y = np.argmax(X[:, :3] + 0.3 * rng.normal(size=(N_ROWS, 3)), axis=1)

    def my_softmax(raw_prediction, y):
        return jax.nn.logsumexp(raw_prediction) - raw_prediction[y.astype(jnp.int32)]

    custom = jb.train(X, y, loss=my_softmax, num_outputs=3, link="softmax", **COMMON)
    builtin = jb.train(X, y, loss="softmax", **COMMON)
    assert custom.predict(X).shape == (N_ROWS, 3)
    agree = np.mean(custom.predict(X).argmax(axis=1) == builtin.predict(X).argmax(axis=1))
    assert agree > 0.97, agree
    np.testing.assert_allclose(custom.base_score - custom.base_score.mean(),
                               builtin.base_score - builtin.base_score.mean(), atol=1e-3)


@cpu_devices_only
def test_rows_sharded_over_devices_match_one_device(monkeypatch):
    # Import-time setup gives one CPU device per core; small data normally stays on one device,
    # so lower the threshold to exercise the sharded round (psum'd histograms, split scan
    # divided by features, sharded refit and prediction).
    # Histograms are summed scattered by feature, each device keeping the block it scans: five
    # features are padded to blocks of three, six divide evenly.
    assert len(jax.devices()) >= min(2, jb.cores.available_cpu_cores())
    X, y = _regression_data()
    X[::13, 2] = np.nan
    X_even = np.column_stack([X, np.random.default_rng(5).normal(size=len(y)).astype(np.float32)])
    # Row sampling is checked apart: it draws the same rows on any number of devices, but over
    # many rounds a near-tie split flipped by the other summation order makes the models drift.
    settings = dict(COMMON, colsample_bynode=0.8, reg_alpha=0.3)
    for loss, features, extra in [("squared_error", X, {}), ("absolute_error", X, {}), ("squared_error", X_even, {}),
                                  ("squared_error", X, dict(subsample=0.8, num_rounds=3))]:
        single = jb.train(features, y, loss=loss, **settings | extra)
        shard_training_rows(monkeypatch)
        sharded = jb.train(features, y, loss=loss, **settings | extra)
        sharded_prediction = sharded.predict(features)
        monkeypatch.undo()
        case = f"{loss} {extra} {features.shape[1]} features"
        # The rows sampled: every round's root holds the same weight. The first tree is the same.
        np.testing.assert_array_equal(sharded.trees.sum_hessians[:, :, 0], single.trees.sum_hessians[:, :, 0])
        np.testing.assert_array_equal(sharded.trees.feature[0], single.trees.feature[0], err_msg=case)
        # Later, a near-tie split may flip under the other summation order (the XLA kernels, as
        # on a GPU, flipped one of 310 here): nearly every split and prediction agrees.
        same_features = np.mean(sharded.trees.feature == single.trees.feature)
        assert same_features > 0.98, (case, same_features)
        close = np.isclose(sharded_prediction, single.predict(features), rtol=1e-3, atol=1e-3)
        assert close.mean() > 0.98, (case, close.mean())


@cpu_devices_only
def test_eval_metrics_of_rows_sharded_over_devices_match_the_model(monkeypatch):
    """With the training and eval rows sharded over two devices (each predicting its share of
    an eval set whose 301 rows do not divide evenly), every round's eval metrics are those of
    the model's own predictions after that round, in ``train`` and in ``train_many``."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two CPU devices")
    shard_training_rows(monkeypatch)
    X, y = _binary_data()
    X_eval, y_eval = _binary_data(seed=3, n=301)
    settings = dict(loss="logistic", num_rounds=6, max_depth=DEPTH, learning_rate=0.3,
                    eval_set=[(X_eval, y_eval)], eval_metric=["logloss", "auc"])

    def check(model, case):
        history = model.evals_result["validation_0"]
        for round_index in range(model.num_rounds):
            p = np.clip(model.predict(X_eval, iteration_range=(0, round_index + 1)).astype(np.float64), 1e-7, 1 - 1e-7)
            logloss = -np.mean(y_eval * np.log(p) + (1 - y_eval) * np.log(1 - p))
            np.testing.assert_allclose(history["logloss"][round_index], logloss, rtol=1e-4, err_msg=case)
            positives, negatives = p[y_eval == 1], p[y_eval == 0]
            auc = (np.mean(positives[:, None] > negatives[None, :])
                   + 0.5 * np.mean(positives[:, None] == negatives[None, :]))
            np.testing.assert_allclose(history["auc"][round_index], auc, rtol=1e-4, err_msg=case)

    model = jb.train(X, y, **settings)
    assert model.evals_result["validation_0"]["logloss"][-1] < model.evals_result["validation_0"]["logloss"][0]
    check(model, "train")
    for index, member in enumerate(jb.train_many(X, y, batch={"reg_lambda": [0.5, 4.0]}, **settings)):
        check(member, f"train_many member {index}")


def test_a_tree_sample_alone_leaves_the_level_draws_out_and_grows_the_same_trees(monkeypatch):
    """With colsample_bytree alone below 1, the round leaves the per-level and per-node draws
    out (fractions of 1 keep every feature of the tree's sample): the trees equal those of a
    round that makes the draws; with colsample_bylevel below 1 the draws are made."""
    from jaxboost import training
    X, y = _regression_data()
    settings = dict(COMMON, colsample_bytree=0.6, seed=4)
    shapes = []
    original = training.RoundShape

    def recording(*args, **kwargs):
        shapes.append(original(*args, **kwargs))
        return shapes[-1]

    monkeypatch.setattr(training, "RoundShape", recording)
    without_draws = jb.train(X, y, **settings)
    assert not shapes[-1].sample_level_columns and shapes[-1].sample_columns
    monkeypatch.setattr(training, "RoundShape", lambda *a, **k: original(*a, **dict(k, sample_level_columns=True)))
    with_draws = jb.train(X, y, **settings)
    # A GPU's varying summation order may break a near tie between two features another way.
    if repeatable_sums():
        for field in without_draws.trees._fields:
            np.testing.assert_array_equal(getattr(without_draws.trees, field), getattr(with_draws.trees, field))
    assert_same_training(without_draws.predict_raw(X), with_draws.predict_raw(X))
    monkeypatch.setattr(training, "RoundShape", recording)
    jb.train(X, y, **dict(settings, colsample_bylevel=0.5))
    assert shapes[-1].sample_level_columns


def test_wide_data_trains_on_one_device_with_kernel_threads(monkeypatch):
    """Data whose node histograms are over ``WIDE_NODE_BYTES`` trains on one CPU device whose
    histogram kernel takes the features in threads (one per core), not sharded by rows; the
    model matches the sharded one."""
    from jaxboost.devices import is_wide, kernel_threads, row_mesh

    X, y = _regression_data()
    n_rows, n_features = X.shape
    settings = dict(COMMON, max_bin=64)
    shard_training_rows(monkeypatch)
    sharded = jb.train(X, y, **settings)
    sharded_mesh = row_mesh(n_rows, n_features, 64)
    assert kernel_threads(sharded_mesh, n_features, 64) == 1
    monkeypatch.setattr(jb.devices, "WIDE_NODE_BYTES", n_features * 64 * 8 - 1)
    assert is_wide(n_features, 64) and not is_wide(n_features - 1, 64)
    mesh = row_mesh(n_rows, n_features, 64)
    assert mesh.devices.size == 1 and row_mesh(n_rows).devices.size == sharded_mesh.devices.size
    assert kernel_threads(mesh, n_features, 64) == len(jax.local_devices())
    wide = jb.train(X, y, **settings)
    same_features = np.mean(wide.trees.feature == sharded.trees.feature)
    assert same_features > 0.98, same_features
    np.testing.assert_allclose(wide.predict(X), sharded.predict(X), rtol=1e-3, atol=1e-3)


def test_sum_scattered_over_devices():
    """``all_sum_scattered`` sums over devices and leaves each device its block of the scattered axis."""
    from jax.sharding import Mesh, PartitionSpec

    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs two devices (jaxboost sets up one per core; this machine has one core)")
    mesh = Mesh(np.array(devices), ("rows",))
    local = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)  # device, slot, value
    scattered = jax.shard_map(lambda x: jb.devices.all_sum_scattered(x[0], "rows", 1)[None],
                              mesh=mesh, in_specs=PartitionSpec("rows"), out_specs=PartitionSpec("rows"))
    out = np.asarray(jax.jit(scattered)(local))
    for device in range(2):  # device i keeps values [2i, 2i + 2)
        np.testing.assert_array_equal(out[device], local[:, :, 2 * device:2 * device + 2].sum(axis=0))


@pytest.mark.parametrize("kernel, at_once", [("xla", False), ("xla", True), ("native", False)],
                         ids=["xla-cpu-steps", "accelerator-at-once", "native"])
@pytest.mark.parametrize("n_devices, slots", [(1, 32), (2, 32), (2, 2), (2, 1), (2, 128)])
def test_children_histograms_over_parents_matches_sibling_subtraction(monkeypatch, n_devices, slots, kernel, at_once):
    """A looped level's children histograms: for the chunks of parents (8, or 32 in the deep
    levels' wide buffers) holding the first ``live`` slots and a parent that splits, children
    ``2 p, 2 p + 1`` of a splitting parent are the smaller child summed over devices and the
    parent minus it (left or right as ``left_is_smaller`` says), those of a parent that does not
    split are zeros in XLA's steps and keep their contents in the native kernel's; slots past
    those chunks, and those of chunks without a split, keep their contents; a count of 0
    (children that are leaves) changes nothing, nor does a single slot (depth-1 trees, whose
    children are leaves). A wide buffer's smaller children cover only its first half, where
    parents lie; the smaller children of parents that do not split may hold anything (the route
    kernel leaves them unwritten). Off the CPU (``at_once``) every parent's children are written
    in one step, whatever ``live`` says. The native kernel runs on one device in one call, and
    with rows sharded a call a step, reading the summed children feature-major."""
    from jax.sharding import Mesh, PartitionSpec

    from jaxboost import grower
    from jaxboost.grower import children_histograms_over_parents, parent_chunk_nodes

    # Either way on any backend (a GPU would take the one step by itself).
    monkeypatch.setattr(grower, "in_steps_on_cpu",
                        lambda in_steps, all_at_once: all_at_once() if at_once else in_steps())

    devices = jax.devices()[:n_devices]
    if len(devices) < n_devices:
        pytest.skip("needs two devices (jaxboost sets up one per core; this machine has one core)")
    if kernel == "native" and jb.native.native_target(jb.native.SIBLING_HISTOGRAMS_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler)")
    mesh = Mesh(np.array(devices), ("rows",))
    rng = np.random.default_rng(0)
    features, bins = 4, 3
    block = features // n_devices
    smaller_slots = slots // 2 if slots > 32 else slots
    chunk = parent_chunk_nodes((slots, block, bins, 2), n_devices)
    parent_splits = rng.uniform(size=slots) < 0.6
    parent_splits[chunk:2 * chunk] = False  # a whole chunk of parents without a split: skipped
    local_smaller = rng.normal(size=(n_devices, smaller_slots, features, bins, 2)).astype(np.float32)
    unwritten = ~parent_splits[:smaller_slots]
    local_smaller[:, unwritten] = np.nan  # whatever a kernel left in the cells of non-splitting parents
    parents = rng.normal(size=(n_devices, slots, block, bins, 2)).astype(np.float32)  # each device's block
    left_is_smaller = rng.uniform(size=slots) < 0.5
    for live in [live for live in [0, 1, 2, 8, 9, 16, 32, 64] if live <= max(slots // 2, 1)]:
        axis = "rows" if n_devices > 1 else None
        level = jax.shard_map(
            lambda p, s, left, splits: children_histograms_over_parents(p[0], s[0], left, splits, jnp.int32(live),
                                                                        axis, kernel=kernel)[None],
            mesh=mesh, in_specs=(PartitionSpec("rows"), PartitionSpec("rows"), PartitionSpec(), PartitionSpec()),
            out_specs=PartitionSpec("rows"))
        out = np.asarray(jax.jit(level)(parents, local_smaller, left_is_smaller, parent_splits))
        read_chunks = 0 if slots < 2 else -(-live // chunk)
        for device in range(n_devices):
            smaller = local_smaller[:, :, device * block:(device + 1) * block].sum(axis=0)
            smaller = np.concatenate([smaller, np.zeros((slots - smaller_slots,) + smaller.shape[1:], np.float32)])
            larger = parents[device] - smaller
            choose = left_is_smaller[:, None, None, None]
            splits = parent_splits[:, None, None, None]
            children = np.stack([np.where(splits, np.where(choose, smaller, larger), 0.0),
                                 np.where(splits, np.where(choose, larger, smaller), 0.0)], axis=1)
            children = children.reshape((2 * slots,) + children.shape[2:])
            expected = parents[device].copy()
            if kernel == "native":
                for parent in reversed(range(min(live, slots // 2))):
                    if parent_splits[parent]:
                        expected[2 * parent:2 * parent + 2] = children[2 * parent:2 * parent + 2]
            elif at_once and slots > 1:
                expected = children[:slots]
            for start in range(0, 0 if at_once or kernel == "native" else read_chunks * chunk, chunk):
                if parent_splits[start:start + chunk].any():
                    expected[2 * start:2 * (start + chunk)] = children[2 * start:2 * (start + chunk)]
            np.testing.assert_allclose(out[device], expected, rtol=1e-6, atol=1e-6, err_msg=f"live={live}")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel runs on CPU")
@pytest.mark.parametrize("slots, smaller_slots", [(1, 1), (2, 2), (32, 16), (32, 32), (128, 64)])
def test_native_children_histograms_write_the_splitting_parents_children(slots, smaller_slots):
    """The native form on one device: parents ``p`` below ``live`` (and below half the slots, and
    the smaller children given) that split get their smaller child and the parent minus it in
    slots ``2 p, 2 p + 1`` (left or right as ``left_is_smaller`` says), over the buffer in place,
    the later parents first (each is read before a child lands over it); every other slot keeps
    what it held, those of parents that do not split too; also under vmap, one call a member."""
    from jaxboost.grower import children_histograms_over_parents
    from jaxboost.native import SIBLING_HISTOGRAMS_TARGET, native_target

    if native_target(SIBLING_HISTOGRAMS_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler)")
    rng = np.random.default_rng(3)
    cells = (5, 3, 2)  # features, bins, channels: 30 cells a slot, not a whole number of blocks
    parents = rng.normal(size=(2, slots) + cells).astype(np.float32)
    smaller = rng.normal(size=(2, smaller_slots) + cells).astype(np.float32)
    parent_splits = rng.uniform(size=(2, slots)) < 0.7
    parent_splits[:, 0] = True  # parent 0, one of whose children lands over it
    smaller[~parent_splits[:, :smaller_slots]] = np.nan  # never built: never read
    left_is_smaller = rng.uniform(size=(2, slots)) < 0.5

    def children(p, s, left, splits, live):
        return children_histograms_over_parents(p, s, left, splits, live, None, kernel="native")

    for live in [0, 1, 2, 3, 9, 16, 64]:
        expected = parents.copy()
        for member in range(2):
            for parent in reversed(range(min(live, slots // 2, smaller_slots))):
                if parent_splits[member, parent]:
                    small = smaller[member, parent]
                    larger = parents[member, parent] - small
                    left, right = (small, larger) if left_is_smaller[member, parent] else (larger, small)
                    expected[member, 2 * parent], expected[member, 2 * parent + 1] = left, right
        one = [np.asarray(jax.jit(children)(*(jnp.asarray(a[member]) for a in
                                              (parents, smaller, left_is_smaller, parent_splits)), jnp.int32(live)))
               for member in range(2)]
        batched = np.asarray(jax.jit(jax.vmap(children, in_axes=(0, 0, 0, 0, None)))(
            parents, smaller, left_is_smaller, parent_splits, jnp.int32(live)))
        for member in range(2):
            np.testing.assert_array_equal(one[member], expected[member], err_msg=f"live={live}")
            np.testing.assert_array_equal(batched[member], expected[member], err_msg=f"vmap, live={live}")


@pytest.mark.parametrize("kernel", ["xla", "auto"])
def test_chunks_in_use_lists_the_chunks_with_live_slots_in_use(kernel):
    """``chunks_in_use``: the starts of the chunks holding one of the first ``count`` slots
    (and one slot in use), in order, and how many, the rest 0 (XLA's form and, on CPU, the
    native kernel's; also under vmap); ``update_leading_chunks`` replaces those chunks only."""
    from jaxboost.devices import chunks_in_use, update_leading_chunks

    rng = np.random.default_rng(1)
    in_use = rng.uniform(size=64) < 0.15
    in_use[8:16] = False
    for count in [0, 1, 8, 9, 40, 64]:
        for flags in [None, in_use]:
            starts, used = jax.jit(lambda c, f: chunks_in_use(c, 8, 64, f, kernel=kernel))(
                jnp.int32(count), None if flags is None else jnp.asarray(flags))
            expected = [start for start in range(0, -(-count // 8) * 8, 8)
                        if flags is None or flags[start:start + 8].any()]
            assert int(used) == len(expected)
            np.testing.assert_array_equal(np.asarray(starts), expected + [0] * (8 - len(expected)))
            whole = np.zeros((64, 2), np.float32)
            updated = jax.jit(lambda c, f: update_leading_chunks(
                jnp.asarray(whole), lambda start: jnp.ones((8, 2)) * (start + 1.0), c, 8, f))(
                jnp.int32(count), None if flags is None else jnp.asarray(flags))
            reference = whole.copy()
            for start in expected:
                reference[start:start + 8] = start + 1.0
            np.testing.assert_array_equal(np.asarray(updated), reference)
    # Models' flags, batched: each model's chunks.
    flags = np.stack([in_use, in_use[::-1], np.zeros(64, bool)])
    starts, used = jax.jit(jax.vmap(lambda f: chunks_in_use(jnp.int32(64), 8, 64, f, kernel=kernel)))(
        jnp.asarray(flags))
    for model, model_flags in enumerate(flags):
        expected = [start for start in range(0, 64, 8) if model_flags[start:start + 8].any()]
        assert int(used[model]) == len(expected)
        np.testing.assert_array_equal(np.asarray(starts[model]), expected + [0] * (8 - len(expected)))


@pytest.mark.parametrize("n_devices", [1, 2])
def test_rows_are_padded_by_device_and_placed_in_place(n_devices, monkeypatch):
    """Each device gets an equal share of the rows followed by its padding: per-row arrays
    (``pad_rows_by_device``, aligned) and the codes copied feature-major per device
    (``copied_codes_on_mesh``); each CPU device uses its aligned host block without a copy of
    its own."""
    from jax.sharding import Mesh

    devices = jax.devices()[:n_devices]
    if len(devices) < n_devices:
        pytest.skip("needs two devices (jaxboost sets up one per core; this machine has one core)")
    mesh = Mesh(np.array(devices), ("rows",))
    codes = np.random.default_rng(0).integers(0, 255, size=(37, 3)).astype(np.uint8)
    expected = np.full((n_devices, 64 // n_devices, 3), 7, np.uint8)
    if n_devices == 1:
        expected[0, :37] = codes
    else:  # 37 rows over two devices: 19 and 18, each block padded to 32
        expected[0, :19], expected[1, :18] = codes[:19], codes[19:]
    expected = expected.reshape(64, 3)
    np.testing.assert_array_equal(jb.devices.pad_rows_by_device(codes, 64, n_devices, 7), expected)

    labels = jb.devices.pad_rows_by_device(codes[:, 0].astype(np.float32), 64, n_devices, -1.0)
    assert labels.ctypes.data % jb.host_memory.HOST_ALIGNMENT == 0
    placed_labels = jax.device_put(labels, jb.devices.row_sharding(mesh, 1))
    for index, shard in enumerate(placed_labels.addressable_shards):
        if shard.device.platform == "cpu":  # blocks of 32 float32 stay aligned
            assert shard.data.unsafe_buffer_pointer() == labels.ctypes.data + index * 128, "a device copied its rows"

    blocks = []
    aligned_empty = jb.devices.aligned_empty
    monkeypatch.setattr(jb.devices, "aligned_empty", lambda *args: blocks.append(aligned_empty(*args)) or blocks[-1])
    placed = jb.devices.copied_codes_on_mesh(codes, 64, mesh)
    np.testing.assert_array_equal(np.asarray(placed), jb.devices.pad_rows_by_device(codes, 64, n_devices, 0).T)
    assert placed.sharding.spec[1] == "rows"
    for shard, block in zip(placed.addressable_shards, blocks):
        assert shard.data.shape == block.shape == (3, 64 // n_devices)
        if shard.device.platform == "cpu":
            assert shard.data.unsafe_buffer_pointer() == block.ctypes.data, "the device copied its block"


@cpu_devices_only
def test_rows_below_the_sharding_threshold_train_on_one_device_in_ranges_of_rows(monkeypatch):
    """Below ``MIN_ROWS_SHARDED`` rows a fit stays on one device, and its kernels sum the rows in
    ranges, one a core; vector leaves, whose channels are summed in one pass, are sharded from
    ``MIN_ROWS_PER_DEVICE`` rows a device instead, in one range. The sums depend on the number
    of ranges alone, not on the threads that ran them: a second fit grows the model bit for
    bit, and so does ``train_many`` (its models split over the cores, each running its ranges on
    whatever thread is free), as it does for sharded rows."""
    from jaxboost import devices

    cores = min(len(jax.local_devices()), jb.available_cpu_cores())
    if cores < 2:
        pytest.skip("needs two CPU devices and two cores")
    rng = np.random.default_rng(13)
    n_rows = 2 * devices.MIN_ROWS_PER_DEVICE + 1000
    assert n_rows < devices.MIN_ROWS_SHARDED
    X = rng.normal(size=(n_rows, 5)).astype(np.float32)
    y = (X[:, 0] - X[:, 2] + rng.normal(size=n_rows) > 0).astype(np.float32)
    settings = dict(loss="logistic", max_depth=4)
    with monkeypatch.context() as stop:
        shape, _ = round_shape_and_arguments(stop, X, y, **settings)
    settings["num_rounds"] = 5
    assert shape.mesh.devices.size == 1 and shape.kernel_row_ranges == cores
    with monkeypatch.context() as stop:
        shape, _ = round_shape_and_arguments(stop, X, np.digitize(X[:, 1], [0.0]).astype(np.float32),
                                             loss="softmax", num_outputs=2, multi_strategy="multi_output_tree")
    assert shape.mesh.devices.size == 2 and shape.kernel_row_ranges == 1
    first = jb.train(X, y, learning_rate=0.3, **settings).predict_raw(X)
    assert_same_training(jb.train(X, y, learning_rate=0.3, **settings).predict_raw(X), first)
    many = jb.train_many(X, y, batch={"learning_rate": [0.3, 0.1]}, **settings)
    assert_same_training(many[0].predict_raw(X), first)


@cpu_devices_only
@pytest.mark.skipif(jb.native.native_target(jb.histogram.HISTOGRAM_TARGET) is None,
                    reason="the shared code table is read by the native kernels only")
def test_cpu_devices_share_the_datasets_code_table_and_grow_the_same_trees(monkeypatch):
    """On CPU the devices read the Dataset's feature-major code table in place, each from the
    first row of its share, instead of holding copies of their rows: every device's buffer is
    the Dataset's, the rows of each device start where its share does, and the trees (with row
    sampling, on rows that do not divide evenly) are bit for bit those grown from per-device
    copies."""
    from jaxboost import training
    from jaxboost.devices import code_table_width, device_shares, row_mesh

    rng = np.random.default_rng(11)
    n_rows = 2 * jb.devices.MIN_ROWS_PER_DEVICE + 1001  # two devices where there are two
    X = rng.normal(size=(n_rows, 5)).astype(np.float32)
    X[rng.uniform(size=X.shape) < 0.02] = np.nan
    y = (X[:, 0] - X[:, 2] + rng.normal(size=n_rows) > 0).astype(np.float32)
    dataset = jb.Dataset(X, y, max_bin=64)
    assert dataset.X_binned_T.shape == (5, code_table_width(n_rows)) and not dataset.X_binned_T.flags.writeable
    assert np.shares_memory(dataset.X_binned, dataset.X_binned_T)
    np.testing.assert_array_equal(dataset.X_binned, jb.binning.apply_bins(X, dataset.bin_edges))

    resolved = jb.objective.resolve_loss("logistic", y, None, None)
    mesh = row_mesh(n_rows)
    rows = training._DeviceRows(dataset, resolved, mesh, margin=None, base_score=None)
    assert rows.shared_codes
    for shard in rows.X_binned_T_device.addressable_shards:
        assert shard.data.unsafe_buffer_pointer() == dataset.X_binned_T.ctypes.data, "a device copied the codes"
    starts = np.concatenate([[0], np.cumsum(device_shares(n_rows, mesh.size))[:-1]])
    np.testing.assert_array_equal(np.asarray(rows.row_offsets_device), starts)

    settings = dict(loss="logistic", num_rounds=4, max_depth=4, subsample=0.8, seed=3)
    shard_training_rows(monkeypatch, rows_per_device=None)
    shared = jb.train(dataset, **settings)
    monkeypatch.setattr(training, "native_target", lambda name: None)  # the layout choice only
    copied_rows = training._DeviceRows(dataset, resolved, mesh, margin=None, base_score=None)
    assert not copied_rows.shared_codes and copied_rows.X_binned_T_device.shape[1] == rows.y.shape[0]
    copied = jb.train(dataset, **settings)
    for name, a, b in zip(shared.trees._fields, shared.trees, copied.trees):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)

    # A table that lost its alignment (an unpickled Dataset, say) is aligned once, not copied per device.
    unaligned_storage = np.empty(dataset.X_binned_T.size + 1, np.uint8)[1:].reshape(dataset.X_binned_T.shape)
    unaligned_storage[...] = dataset.X_binned_T
    codes, _ = jb.devices.shared_codes_on_mesh(unaligned_storage, n_rows, rows.y.shape[0], mesh)
    pointers = {shard.data.unsafe_buffer_pointer() for shard in codes.addressable_shards}
    assert len(pointers) == 1 and unaligned_storage.ctypes.data not in pointers
    np.testing.assert_array_equal(np.asarray(codes), dataset.X_binned_T)


def test_missing_value_flag_follows_the_data_and_leaves_trees_unchanged():
    """A Dataset records whether any value is missing; without any, training scans one missing
    direction only, and the trees are exactly those of the full scan."""
    rng = np.random.default_rng(7)
    X = rng.normal(size=(3000, 6)).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.float32)
    dense = jb.Dataset(X, y)
    assert not dense.has_missing_values
    X_nan = X.copy()
    X_nan[5, 2] = np.nan
    assert jb.Dataset(X_nan, y).has_missing_values
    fast = jb.train(dense, loss="logistic", num_rounds=5, max_depth=5)
    dense.has_missing_values = True  # force the full two-direction scan on the same data
    full = jb.train(dense, loss="logistic", num_rounds=5, max_depth=5)
    for name, a, b in zip(fast.trees._fields, fast.trees, full.trees):
        assert_same_training(np.asarray(a), np.asarray(b), err_msg=name)


def test_second_process_loads_the_compiled_round_from_the_disk_cache(tmp_path):
    """A new process training the same shapes takes the round from ``JAXBOOST_CACHE_DIR``
    instead of compiling it again."""
    import subprocess
    import sys

    code = ("import numpy as np, jaxboost as jb\n"
            "X = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)\n"
            "jb.train(X, X[:, 0] + X[:, 1], num_rounds=2, max_depth=3)\n")
    # A stale entry past the size limit: the first process's import deletes it.
    stale = tmp_path / "jit_stale-0123-cache"
    with open(stale, "wb") as stream:
        stream.truncate(60 * 2 ** 20)  # sparse: 60 MB of apparent size
    os.utime(stale, (1e9, 1e9))
    env = dict(os.environ, JAXBOOST_CACHE_DIR=str(tmp_path), JAX_LOG_COMPILES="1", JAXBOOST_CACHE_MAX_MB="50")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stderr for run in runs)
    for program in ("round_statistics", "round_trees"):
        hit = f"Persistent compilation cache hit for 'jit_{program}'"
        assert f"Compiling jit({program})" in first and hit not in first, program
        assert hit in second, program
    assert not stale.exists()


def test_the_compilation_cache_is_trimmed_to_its_size_limit_least_recently_used_first(tmp_path, monkeypatch):
    """``trim_compilation_cache`` deletes JAX's entries (and their access records) in order of
    last use until the rest fit the limit, and leaves other files alone;
    ``JAXBOOST_CACHE_MAX_MB`` sets the limit, and a bad value is an error that names it."""
    from jaxboost.devices import DEFAULT_CACHE_MAX_MB, cache_max_bytes, trim_compilation_cache

    for age, name in enumerate(["newest", "middle", "oldest"]):
        entry = tmp_path / f"jit_{name}-cache"
        entry.write_bytes(b"x" * 1000)
        os.utime(entry, (2e9 - 1000 * age, 2e9 - 1000 * age))
    (tmp_path / "jit_oldest-atime").write_bytes(b"1")
    (tmp_path / "notes.txt").write_bytes(b"y" * 5000)
    assert trim_compilation_cache(str(tmp_path), 2500) == 1000
    assert sorted(path.name for path in tmp_path.iterdir()) == ["jit_middle-cache", "jit_newest-cache", "notes.txt"]
    assert trim_compilation_cache(str(tmp_path), 2000) == 0
    assert trim_compilation_cache(str(tmp_path), 0) == 2000
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]

    monkeypatch.delenv("JAXBOOST_CACHE_MAX_MB", raising=False)
    assert cache_max_bytes() == DEFAULT_CACHE_MAX_MB * 2 ** 20
    monkeypatch.setenv("JAXBOOST_CACHE_MAX_MB", "0.5")
    assert cache_max_bytes() == 2 ** 19
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("JAXBOOST_CACHE_MAX_MB", bad)
        with pytest.raises(ValueError, match="JAXBOOST_CACHE_MAX_MB"):
            cache_max_bytes()


def test_an_import_trims_the_compilation_cache_at_most_once_an_hour_unless_the_limit_falls(tmp_path):
    """``trim_compilation_cache_when_due`` trims a folder never trimmed, then not again within
    ``TRIM_INTERVAL_SECONDS`` of its last trim at the same or a larger limit; a smaller limit,
    an hour passed, or an unreadable record trims at once."""
    from jaxboost.devices import TRIM_INTERVAL_SECONDS, TRIM_RECORD, trim_compilation_cache_when_due

    def add_entry(name):
        entry = tmp_path / f"jit_{name}-cache"
        entry.write_bytes(b"x" * 1000)
        os.utime(entry, (1e9, 1e9))  # used longest ago: the first to go

    start = 2e9
    add_entry("first")
    assert trim_compilation_cache_when_due(str(tmp_path), 500, now=start) == 1000
    add_entry("second")
    assert trim_compilation_cache_when_due(str(tmp_path), 500, now=start + TRIM_INTERVAL_SECONDS - 1) is None
    assert trim_compilation_cache_when_due(str(tmp_path), 5000, now=start + 10) is None
    assert (tmp_path / "jit_second-cache").exists()
    assert trim_compilation_cache_when_due(str(tmp_path), 499, now=start + 20) == 1000  # a smaller limit
    add_entry("third")
    assert trim_compilation_cache_when_due(str(tmp_path), 499, now=start + 30) is None
    assert trim_compilation_cache_when_due(str(tmp_path), 499, now=start + 20 + TRIM_INTERVAL_SECONDS) == 1000
    add_entry("fourth")
    (tmp_path / TRIM_RECORD).write_text("unreadable")
    assert trim_compilation_cache_when_due(str(tmp_path), 499, now=start + 40 + TRIM_INTERVAL_SECONDS) == 1000
    assert sorted(path.name for path in tmp_path.iterdir()) == [TRIM_RECORD]


@pytest.mark.parametrize("seed", [0, 1, 42, -7, 2 ** 31, 2 ** 32 + 5])
def test_seed_key_data_is_jax_prng_key(seed):
    """Training makes its seed's raw key on the host; it is JAX's key data for the same seed, so
    a seed names the key that ``jax.random.PRNGKey(seed)`` does (the samples derive from it)."""
    from jaxboost.boosting import seed_key_data

    np.testing.assert_array_equal(seed_key_data(seed), np.asarray(jax.random.key_data(jax.random.PRNGKey(seed))))


def test_row_sampling_draws_by_row_index():
    """Row sampling's uniform numbers come from each row's index in the data, not its place in
    the padded layout: permuting the indices permutes the draws; they are uniform (deciles
    within 1% of a tenth) and the next round's key draws anew."""
    from jaxboost.boosting import _round_keys
    from jaxboost.sampling import uniform_of_counters

    seed_key = jnp.asarray(jb.boosting.seed_key_data(3))
    key, next_key = (_round_keys(seed_key, jnp.int32(round_index))[0] for round_index in (0, 1))
    index = np.arange(200_000, dtype=np.int32)
    draws = np.asarray(uniform_of_counters(key, jnp.asarray(index)))
    order = np.random.default_rng(0).permutation(index.size)
    np.testing.assert_array_equal(np.asarray(uniform_of_counters(key, jnp.asarray(index[order]))), draws[order])
    assert draws.min() >= 0.0 and draws.max() < 1.0
    deciles = np.histogram(draws, bins=10, range=(0, 1))[0] / index.size
    np.testing.assert_allclose(deciles, 0.1, atol=0.01)
    other = np.asarray(uniform_of_counters(next_key, jnp.asarray(index)))
    assert abs(np.corrcoef(draws, other)[0, 1]) < 0.01
    assert np.mean((draws < 0.5) == (other < 0.5)) == pytest.approx(0.5, abs=0.01)


def test_round_and_tree_keys_are_distinct_and_their_feature_scores_uniform():
    """Every round's three keys (rows, columns, trees) over 2,000 rounds and two seeds differ,
    and so do a tree key's per-output keys; a tree's feature scores are uniform (deciles within
    1% of a tenth over 200 trees) and two keys' scores are uncorrelated."""
    from jaxboost.boosting import _round_keys
    from jaxboost.sampling import derived_keys, uniform_scores

    keys = np.concatenate([np.stack(jax.vmap(lambda r: jnp.stack(_round_keys(seed_key, r)))(jnp.arange(2000)))
                           .reshape(-1, 2) for seed_key in map(jnp.asarray, map(jb.boosting.seed_key_data, (0, 1)))])
    assert len({tuple(key) for key in keys.tolist()}) == len(keys) == 12_000
    per_output = np.stack([np.asarray(derived_keys(jnp.asarray(keys[2]), output, 1)[0]) for output in range(10)])
    assert len({tuple(key) for key in per_output.tolist()} | {tuple(keys[2])}) == 11
    scores = np.asarray(jax.vmap(lambda key: uniform_scores(key, (69, 28)))(jnp.asarray(keys[:200])))
    assert scores.min() >= 0.0 and scores.max() < 1.0
    np.testing.assert_allclose(np.histogram(scores, bins=10, range=(0, 1))[0] / scores.size, 0.1, atol=0.01)
    assert abs(np.corrcoef(scores[0].ravel(), scores[1].ravel())[0, 1]) < 0.06


@pytest.mark.parametrize("sample", ["colsample_bylevel", "colsample_bynode"])
def test_level_and_node_column_samples_draw_anew_for_every_level_node_and_tree(sample):
    """A quarter of 8 equally useful features keeps 2. By level: every level's splits use at
    most those 2, and a tree's levels draw apart (more than 2 over a tree). By node: a level's
    nodes draw apart (more than 2 over a level). Either way trees draw apart (the roots vary)."""
    from jaxboost.node_list import reached_nodes

    rng = np.random.default_rng(3)
    X = rng.normal(size=(1000, 8)).astype(np.float32)
    y = X.sum(axis=1) + rng.normal(scale=0.1, size=1000)
    model = jb.train(X, y, num_rounds=30, max_depth=4, learning_rate=0.3, max_bin=32, **{sample: 0.25})
    is_leaf = model.trees.is_leaf[:, 0]
    splits = ~is_leaf & reached_nodes(is_leaf)
    features = model.trees.feature[:, 0]
    per_level = [[set(features[tree, 2 ** depth - 1:2 ** (depth + 1) - 1][splits[tree, 2 ** depth - 1:
                                                                                 2 ** (depth + 1) - 1]])
                  for depth in range(4)] for tree in range(len(features))]
    assert splits.sum() > 0.9 * 15 * 30, "nearly every node should split: every feature helps"
    widest_level = max(len(used) for tree in per_level for used in tree)
    if sample == "colsample_bylevel":
        assert widest_level <= 2, per_level
        assert np.mean([len(set().union(*tree)) > 2 for tree in per_level]) > 0.5, per_level
    else:
        assert widest_level > 2, per_level
    assert len(set(features[:, 0])) >= 5, features[:, 0]


@pytest.mark.parametrize("n_rows, chunk_rows", [(1000, 128), (1024, 128), (100, 128), (129, 128)])
def test_in_row_chunks_equals_the_whole_computation(n_rows, chunk_rows):
    """Chunks cover every row once or, at the overlapping last chunk, twice to the same values;
    several results of several shapes and types, those of one call on all rows (up to an ulp:
    XLA vectorises a chunk's loop and the whole one differently). On CPU the results start
    uninitialized (``native.uninitialized``), so a row no chunk wrote would hold garbage."""
    from jaxboost import native
    from jaxboost.boosting import in_row_chunks

    rng = np.random.default_rng(n_rows)
    raw = jnp.asarray(rng.normal(size=(n_rows, 3)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, size=n_rows).astype(np.int32))

    def statistics(raw, y):
        probabilities = jax.nn.softmax(raw)
        g = probabilities - jax.nn.one_hot(y, 3)
        return (g, probabilities * (1 - probabilities), jnp.einsum("nk,nl->nkl", g, g), jnp.sum(g, axis=1),
                y * 7 + 1, raw[:, 0] > 0)

    chunked_call = jax.jit(lambda raw, y: in_row_chunks(statistics, (raw, y), chunk_rows))
    chunked = chunked_call(raw, y)
    whole = jax.jit(statistics)(raw, y)
    for part, expected in zip(chunked, whole):
        assert part.shape == expected.shape and part.dtype == expected.dtype
        np.testing.assert_allclose(np.asarray(part), np.asarray(expected), rtol=1e-6, atol=1e-7)
    if n_rows > chunk_rows and jax.default_backend() == "cpu" and native.native_target(native.UNINITIALIZED_TARGET):
        assert chunked_call.lower(raw, y).as_text().count(native.UNINITIALIZED_TARGET) == len(whole)


def test_in_row_chunks_inside_a_shard_map_that_checks_varying_types():
    """Outside a round's ``lowering_for`` both platform branches of the uninitialized output are
    traced, and inside a ``shard_map`` that checks varying types theirs must match."""
    from jax.sharding import Mesh, PartitionSpec
    from jaxboost.boosting import in_row_chunks

    mesh = Mesh(np.array(jax.devices()), ("rows",))
    n_rows = 300 * len(jax.devices())

    def local(raw, y):
        return in_row_chunks(lambda r, t: (r * 2.0, t + 1), (raw, y), 128)

    rows = PartitionSpec("rows")
    call = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rows, rows), out_specs=(rows, rows)))
    raw, y = jnp.arange(n_rows, dtype=jnp.float32), jnp.arange(n_rows, dtype=jnp.int32)
    doubled, incremented = call(raw, y)
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.arange(n_rows, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(incremented), np.arange(n_rows) + 1)


@pytest.mark.parametrize("loss, vector", [("logistic", False), ("softmax", False), ("softmax", True)])
def test_rounds_computing_derivatives_in_chunks_grow_the_same_trees(loss, vector, monkeypatch):
    """Training with the derivatives computed a few rows at a time (the chunks of large data)
    grows the trees of one pass over all rows: the same splits, and leaf values equal up to
    float32 rounding (a chunk's exponentials may differ from the whole pass's in the last bit)."""
    from jaxboost import boosting

    X, y = _binary_data()
    if loss == "softmax":
        y = np.digitize(X[:, 0] + X[:, 1], [-0.5, 0.5]).astype(np.float32)
    # Vector leaves solve with softmax's summed Hessian, singular but for lambda: a larger
    # lambda keeps that solve from magnifying last-bit differences into flipped near-ties.
    settings = dict(loss=loss, num_rounds=4, max_depth=DEPTH, reg_lambda=10.0 if vector else 1.0,
                    multi_strategy="multi_output_tree" if vector else "one_output_per_tree")
    models = []
    for chunk_rows in (10 ** 9, 96):
        monkeypatch.setattr(boosting, "DERIVATIVE_CHUNK_ROWS", chunk_rows)
        boosting.clear_compiled_rounds()
        models.append(jb.train(X, y, **settings))
    boosting.clear_compiled_rounds()
    whole, chunked = models
    _assert_same_splits(chunked, whole, X)


def test_train_many_computing_derivatives_in_chunks_grows_the_same_trees(monkeypatch):
    """``train_many`` batches the chunked derivative pass over its models."""
    from jaxboost import boosting

    X, y = _binary_data()
    models = []
    for chunk_rows in (10 ** 9, 96):
        monkeypatch.setattr(boosting, "DERIVATIVE_CHUNK_ROWS", chunk_rows)
        boosting.compiled_many_rounds.cache_clear()
        models.append(jb.train_many(X, y, loss="logistic", batch={"reg_lambda": [0.5, 2.0]}, num_rounds=3,
                                    max_depth=DEPTH))
    boosting.compiled_many_rounds.cache_clear()
    for whole, chunked in zip(*models):
        _assert_same_splits(chunked, whole, X)


def _assert_same_splits(chunked, whole, X):
    for field in ("feature", "threshold_bin", "is_leaf", "default_left"):
        np.testing.assert_array_equal(getattr(chunked.trees, field), getattr(whole.trees, field), err_msg=field)
    np.testing.assert_allclose(chunked.trees.value, whole.trees.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunked.predict_raw(X), whole.predict_raw(X), rtol=1e-5, atol=1e-6)


def test_identity_link_is_returned_without_compiling(monkeypatch):
    from jaxboost import link

    X, y = _regression_data()
    model = jb.train(X, y, num_rounds=2, max_depth=DEPTH)

    def no_compiling(function, in_steps, platform):
        raise AssertionError(f"the link {function.__name__} was compiled")
    monkeypatch.setattr(link, "_compiled_link", no_compiling)
    np.testing.assert_array_equal(model.predict(X), model.predict_raw(X))
    with pytest.raises(AssertionError, match="sigmoid was compiled"):
        link.apply_link(link.sigmoid, model.predict_raw(X))


def test_the_link_runs_on_the_host_cpu_when_the_default_backend_is_another(monkeypatch):
    """Raw predictions of host rows are host arrays whatever JAX's default backend: with another
    default (a GPU's), the link runs on the CPU device, made the default one around its chunks,
    and the predictions are the same."""
    from jaxboost import link as links

    X, y = _regression_data()
    model = jb.train(X, (y > 0).astype(np.float32), loss="logistic", num_rounds=3, max_depth=DEPTH)
    expected = model.predict(X)
    compiled_link = links._compiled_link
    default_devices = []

    def recording(*key):
        compiled = compiled_link(*key)

        def call(chunk):
            default_devices.append(jax.config.jax_default_device)
            return compiled(chunk)
        return call

    monkeypatch.setattr(links, "_compiled_link", recording)
    np.testing.assert_array_equal(model.predict(X), expected)
    # On a CPU machine the host CPU is the default platform, which needs no default device.
    on_this_machine = [None] if jax.default_backend() == "cpu" else [jax.devices("cpu")[0]]
    assert default_devices == on_this_machine, default_devices
    default_devices.clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_array_equal(model.predict(np.concatenate([X] * 3)), np.concatenate([expected] * 3))
    assert default_devices == [jax.devices("cpu")[0]] * 2, default_devices  # 3000 rows: two chunks
    # A default device is another entry of the compiled link's cache: leave none to other tests.
    compiled_link.cache_clear()


def test_predict_applies_the_link_in_fixed_chunks_compiled_once(monkeypatch):
    """The link is applied to chunks of fixed sizes (the last zero-padded), so new batch sizes
    do not compile it again; the result is the link of the raw predictions, row for row, for one
    output and for a row-wise link over several (softmax, of 3 and of 20 outputs). On CPU a
    chunk's rows go through the link in steps, up to one step's rows go in a chunk of one step,
    and up to LINK_INLINE_ROWS rows in a chunk of that many without steps: each size compiles
    once, and a row's prediction is the same bit for bit whatever batch it comes in. The layout
    for accelerators (whole, larger chunks, where JAX runs without its CPU backend) gives the
    same values."""
    from jaxboost import link as links

    rng = np.random.default_rng(5)
    n_rows = links.ACCELERATOR_LINK_CHUNK_ROWS + 123  # a full chunk and a partial one in either layout
    X = rng.normal(size=(n_rows, 4)).astype(np.float32)
    labels = np.digitize(X[:, 0] + 0.3 * rng.normal(size=n_rows), [-0.5, 0.5]).astype(np.float32)
    accelerator_layout = (links.ACCELERATOR_LINK_CHUNK_ROWS, False)
    # Links run on the host's CPU, which holds the raw predictions, whatever the default backend.
    assert links.link_platform() == "cpu"
    assert links.link_layout(1) == links.link_layout(links.LINK_INLINE_ROWS) == (links.LINK_INLINE_ROWS, False)
    assert links.link_layout(links.LINK_INLINE_ROWS + 1) == links.link_layout(links.LINK_STEP_ROWS) == \
        (links.LINK_STEP_ROWS, True)
    assert links.link_layout(links.LINK_STEP_ROWS + 1) == (links.LINK_CHUNK_ROWS, True)
    twenty_classes = np.digitize(X[:, 1] + 0.3 * rng.normal(size=n_rows), np.linspace(-2, 2, 19)).astype(np.float32)
    for loss, y in [("logistic", (labels > 0).astype(np.float32)), ("softmax", labels), ("softmax", twenty_classes)]:
        model = jb.train(X[:3000], y[:3000], loss=loss, num_rounds=3, max_depth=3)
        compiled = links._compiled_link(model.link, True, "cpu")
        unstepped = links._compiled_link(model.link, False, "cpu")
        # Programs for this model, in steps and without: one step's and LINK_CHUNK_ROWS, then
        # LINK_INLINE_ROWS and the accelerators' chunk without steps (a link's jit also keeps
        # the programs that other models, or other tests, compiled for it).
        start_sizes = compiled._cache_size(), unstepped._cache_size()
        for layout, sizes, unstepped_sizes in [(None, 2, 1), (accelerator_layout, 2, 2)]:
            if layout is not None:
                monkeypatch.setattr(links, "link_layout", lambda n_rows, layout=layout: layout)
            whole = model.predict(X)
            for rows in (1, 7, 100, 3000, n_rows):
                raw = model.predict_raw(X[:rows])
                predicted = model.predict(X[:rows])
                np.testing.assert_allclose(predicted, np.asarray(model.link(jnp.asarray(raw))),
                                           rtol=1e-6, atol=1e-7, err_msg=f"{loss}, {rows} rows, layout {layout}")
                np.testing.assert_array_equal(predicted, whole[:rows], err_msg=f"{loss}, {rows} rows, layout {layout}")
                # A writable array, one chunk or several: not a read-only view of a result buffer.
                assert predicted.flags.writeable, f"{loss}, {rows} rows"
            counts = compiled._cache_size(), unstepped._cache_size()
            new_sizes = counts[0] - start_sizes[0], counts[1] - start_sizes[1]
            # One program a chunk size at most (none where another test compiled it already),
            # and none for other batch sizes.
            assert new_sizes[0] <= sizes and new_sizes[1] <= unstepped_sizes, f"{loss}: {new_sizes} sizes compiled"
            for rows in (2, 15, 17, 255, 2500):
                np.testing.assert_array_equal(model.predict(X[:rows]), whole[:rows], err_msg=f"{loss}, {rows} rows")
            assert (compiled._cache_size(), unstepped._cache_size()) == counts, f"{loss}: compiled again"
            monkeypatch.undo()


def test_packed_round_trees_unpack_to_the_same_fields_bit_for_bit():
    """A round returns its trees packed into one array (the host reads one array a round, not
    seven); unpacking them, with leading round and model axes, gives back every field exactly:
    negative ints, -0.0, inf and NaN float bit patterns, bools."""
    from jaxboost.tree import Tree, pack_fields, unpack_fields

    rng = np.random.default_rng(3)
    shape = (3, 15)  # K outputs x nodes
    floats = lambda: rng.normal(size=shape).astype(np.float32)
    rounds = []
    for _ in range(4):
        models = []
        for _ in range(2):
            value = floats()
            value[0, :3] = [-0.0, np.inf, np.nan]
            models.append(Tree(rng.integers(-5, 30, shape).astype(np.int32), rng.integers(0, 255, shape).astype(np.int32),
                               rng.random(shape) < 0.5, rng.random(shape) < 0.5, value, floats(), floats()))
        rounds.append(models)
    template = jax.eval_shape(lambda: jax.tree_util.tree_map(jnp.asarray, rounds[0][0]))
    packed = np.stack([np.stack([np.asarray(jax.jit(pack_fields)(tree)) for tree in models]) for models in rounds])
    assert packed.shape == (4, 2, 7 * 45) and packed.dtype == np.uint32
    unpacked = unpack_fields(packed, template)
    for name, field in zip(Tree._fields, unpacked):
        expected = np.stack([np.stack([getattr(tree, name) for tree in models]) for models in rounds])
        assert field.dtype == expected.dtype and field.shape == expected.shape, name
        np.testing.assert_array_equal(field.view(np.uint8), expected.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("settings", [
    dict(loss="quantile"),  # a leaf refit
    dict(loss="softmax", multi_strategy="multi_output_tree"),  # vector leaves, 5 classes: the native solve
    dict(loss="logistic", subsample=0.7, colsample_bytree=0.8),  # sampled rows and features
])
def test_training_with_jax_64_bit_mode_on_grows_the_same_model(settings):
    """Research code often turns JAX's 64-bit mode on; training then still computes in float32
    (with it on, default dtypes had made some of a round's arrays float64, and training with
    vector leaves or a leaf refit failed) and grows the model it grows without it."""
    X, y = _regression_data()
    if settings["loss"] == "softmax":
        y = np.digitize(y, [-2.0, -0.7, 0.7, 2.0]).astype(np.float32)
    elif settings["loss"] == "logistic":
        y = (y > 0).astype(np.float32)
    common = dict(num_rounds=4, max_depth=DEPTH, **settings)
    expected = jb.train(X, y, **common)
    expected_many = jb.train_many(X, y, batch={"reg_lambda": np.array([1.0, 2.0])}, **common)
    with jax.enable_x64(True):
        model = jb.train(X, y, **common)
        many = jb.train_many(X, y, batch={"reg_lambda": np.array([1.0, 2.0])}, **common)
        predicted = model.predict(X)
    assert_same_training(predicted, expected.predict(X))
    for member, expected_member in zip(many, expected_many):
        assert_same_training(member.predict_raw(X), expected_member.predict_raw(X))
    for name, field in zip(model.trees._fields, model.trees):
        assert np.asarray(field).dtype == np.asarray(getattr(expected.trees, name)).dtype, name


@pytest.mark.skipif(jb.native.native_target(jb.native.DAMPED_SOLVE_TARGET) is None or jax.default_backend() != "cpu",
                    reason="native kernels not built here, or JAX's default backend is not the CPU")
def test_a_cpu_round_traces_only_the_cpu_kernels(monkeypatch):
    """A round is lowered for its mesh's platform alone, so on CPU the accelerators' XLA kernels
    (the histogram scatters, the element-wise full-Hessian solve) are not even traced: tracing
    them for a branch that lowering drops took 0.7 s of a first fit at 10 outputs."""
    from jaxboost import histogram, regularizer

    def not_traced(*args, **kwargs):
        raise AssertionError("an accelerator kernel was traced for a CPU round")

    for module, name in [(histogram, "_pair_scatter_histogram"), (histogram, "_complex_scatter_histogram"),
                         (regularizer, "_damped_solve_xla")]:
        monkeypatch.setattr(module, name, not_traced)
    # The rounds are traced afresh, with the kernels above replaced: a row count of its own did
    # not ensure it (777 rows pad to 832, as every count from 769 does, and the trees' program
    # does not depend on the loss).
    from jaxboost import boosting

    X, y = _regression_data(seed=12, n=777)
    y5 = np.digitize(y, [-2.0, -0.7, 0.7, 2.0]).astype(np.float32)
    boosting.clear_compiled_rounds()
    try:
        jb.train(X, y5, loss="softmax", num_rounds=2, max_depth=3, multi_strategy="multi_output_tree")
        jb.train(X, y, num_rounds=2, max_depth=3)
    finally:
        boosting.clear_compiled_rounds()
