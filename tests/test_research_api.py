"""Research API: regularizers, loss parameters, Hessian modes, learning-rate schedules,
monotone and interaction constraints, continuation from a model, callbacks and ``train_many``.

Constraint tests compare with XGBoost on integer-valued features with few distinct values, so
that both libraries bin identically and grow the same trees (predictions within 2e-5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import xgboost as xgb

import jaxboost as jb
from conftest import assert_same_training, needs_repeatable_sums
from jaxboost.node_list import reached_nodes
from jaxboost.regularizer import leaf_value, node_score, objective_at, split_loss_change

F32 = jnp.float32


# --- regularizers -------------------------------------------------------------------------

def _smooth_l1(w, params):
    return params["scale"] * (jnp.sqrt(w * w + params["epsilon"]) - jnp.sqrt(params["epsilon"]))


def _prior(w, params):
    return 0.5 * params["strength"] * (w - params["center"]) ** 2


REGULARIZERS = {
    "l2": jb.regularizers.l2(2.0),
    "l1": jb.regularizers.l1(0.5),
    "elastic_net": jb.regularizers.elastic_net(0.5, 1.0),
    "smooth_l1": jb.regularizers.custom(_smooth_l1, {"scale": 1.5, "epsilon": 0.01}, reg_lambda=0.5),
    "prior": jb.regularizers.custom(_prior, {"strength": 2.0, "center": 0.3}),
    "prior_with_l1": jb.regularizers.custom(_prior, {"strength": 2.0, "center": 0.3}, reg_alpha=0.2),
}


@pytest.mark.parametrize("name", sorted(REGULARIZERS))
def test_leaf_value_minimises_objective_and_gain_is_objective_drop(name):
    reg = REGULARIZERS[name]
    rng = np.random.default_rng(0)
    G = jnp.asarray(rng.normal(0, 3, 200), jnp.float32)
    H = jnp.asarray(rng.uniform(0.5, 5, 200), jnp.float32)
    w = leaf_value(G, H, reg)
    # The minimiser: no point of a fine grid around it does better.
    offsets = jnp.linspace(-0.05, 0.05, 101)
    around = jax.vmap(lambda d: objective_at(w + d, G, H, reg))(offsets)
    assert np.all(np.asarray(around).min(axis=0) >= np.asarray(objective_at(w, G, H, reg)) - 1e-5)
    # Where the objective is smooth at w, its derivative vanishes.
    derivative = jax.vmap(jax.grad(lambda v, g, h: objective_at(v, g, h, reg)))(w, G, H)
    smooth = np.abs(np.asarray(w)) > 1e-4 if float(reg.reg_alpha) > 0 else np.ones(200, bool)
    np.testing.assert_allclose(np.asarray(derivative)[smooth], 0.0, atol=2e-4)
    # node score = -2 x objective at w*; loss_chg = 2 x (objective drop from parent to children).
    np.testing.assert_allclose(node_score(G, H, reg), -2 * objective_at(w, G, H, reg), rtol=1e-5, atol=1e-5)
    GL, HL, GR, HR = G[:100], H[:100], G[100:], H[100:]
    gain = split_loss_change(GL, HL, GR, HR, reg)
    drop = 2 * (objective_at(leaf_value(GL + GR, HL + HR, reg), GL + GR, HL + HR, reg)
                - objective_at(leaf_value(GL, HL, reg), GL, HL, reg) - objective_at(leaf_value(GR, HR, reg), GR, HR, reg))
    np.testing.assert_allclose(gain, drop, rtol=1e-4, atol=1e-4)


# Penalties whose Newton steps need the safeguards, with their derivatives in NumPy for a
# float64 reference (the library takes them by autodiff).
_HARD_PENALTIES = {
    "smooth_l1": (lambda w, p: 1.5 * (jnp.sqrt(w * w + 0.01) - 0.1), lambda w: 1.5 * w / np.sqrt(w * w + 0.01), 0.0, 0.0),
    "smooth_l1_lambda_l1": (lambda w, p: 1.5 * (jnp.sqrt(w * w + 0.01) - 0.1),
                            lambda w: 1.5 * w / np.sqrt(w * w + 0.01), 1.0, 0.5),
    "sharp_smooth_l1": (lambda w, p: 1.5 * (jnp.sqrt(w * w + 1e-6) - 1e-3), lambda w: 1.5 * w / np.sqrt(w * w + 1e-6),
                        1.0, 0.0),
    "quartic": (lambda w, p: 0.1 * w ** 4, lambda w: 0.4 * w ** 3, 0.0, 0.0),
    "prior_l1": (lambda w, p: 0.5 * (w - 0.3) ** 2, lambda w: w - 0.3, 0.0, 0.5),
}


def _bisected_leaf_values(G, H, derivative, reg_lambda, reg_alpha):
    """The minimisers of G w + 1/2 (H + lambda) w^2 + alpha |w| + penalty(w) in float64: 200
    bisections of the rising derivative on [-300, 300]."""
    G, H = G.astype(np.float64), H.astype(np.float64)
    lower, upper = np.full_like(G, -300.0), np.full_like(G, 300.0)
    for _ in range(200):
        middle = 0.5 * (lower + upper)
        slope = G + (H + reg_lambda) * middle + derivative(middle) + reg_alpha * np.sign(middle)
        lower, upper = np.where(slope < 0, middle, lower), np.where(slope > 0, middle, upper)
        lower, upper = np.where(slope == 0, middle, lower), np.where(slope == 0, middle, upper)
    w = 0.5 * (lower + upper)
    return np.where(np.abs(G + derivative(np.zeros_like(G))) <= reg_alpha, 0.0, w)


def _large_sums(seed: int, lowest_hessian: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """100k candidates' sums, as large as a node's grow with its rows: G ~ N(0, 30), H in
    [lowest_hessian, 50]."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 30, 100_000).astype(np.float32), rng.uniform(lowest_hessian, 50, 100_000).astype(np.float32)


def _hard_regularizer(name: str):
    penalty, _, reg_lambda, reg_alpha = _HARD_PENALTIES[name]
    return jb.regularizers.custom(penalty, reg_lambda=reg_lambda, reg_alpha=reg_alpha)


@pytest.mark.parametrize("name", sorted(_HARD_PENALTIES))
def test_custom_penalty_leaf_values_reach_the_minimiser_for_large_sums(name):
    """A custom penalty's leaf values (smooth L1, a sharp one, quartic, a prior with L1) for
    large sums are the float64 minimiser's to float32 precision. Newton steps safeguarded by the
    bracket alone had left some of them off by more than their size after their 30 steps."""
    _, derivative, reg_lambda, reg_alpha = _HARD_PENALTIES[name]
    G, H = _large_sums(5)
    reg = _hard_regularizer(name)
    w = np.asarray(jax.jit(lambda g, h: leaf_value(g, h, reg))(G, H))
    expected = _bisected_leaf_values(G, H, derivative, reg_lambda, reg_alpha)
    np.testing.assert_allclose(w, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", sorted(_HARD_PENALTIES))
@pytest.mark.parametrize("bounded", [False, True])
def test_custom_penalty_leaf_value_range_holds_the_solved_value(name, bounded):
    """``leaf_value_range`` (what the split scan's contenders read to leave out candidates that
    certainly break a monotone constraint) holds every solved leaf value: large sums, sums of a
    few rows, zero and negative Hessian mass, within max_delta_step and a node's bounds or not."""
    from jaxboost.regularizer import leaf_value_range

    G, H = _large_sums(7, lowest_hessian=0.0)
    G, H = np.concatenate([G, G[:1000] * 1e-3, [0.0, 1.0, -1.0]]), np.concatenate([H, H[:1000] * 1e-3, [0.0, 0.0, -2.0]])
    G, H = G.astype(np.float32), H.astype(np.float32)
    reg = _hard_regularizer(name)
    lower = upper = None
    if bounded:
        reg = reg.with_max_delta_step(2.0)
        rng = np.random.default_rng(8)
        lower = rng.uniform(-1.5, 0.5, G.shape).astype(np.float32)
        upper = (lower + rng.uniform(0.0, 2.0, G.shape)).astype(np.float32)
    w = np.asarray(jax.jit(lambda g, h, a, b: leaf_value(g, h, reg, a, b))(G, H, lower, upper))
    low, high = (np.asarray(x) for x in jax.jit(lambda g, h, a, b: leaf_value_range(g, h, reg, a, b))(G, H, lower, upper))
    outside = ~((low <= w) & (w <= high))
    assert not outside.any(), (G[outside][:5], H[outside][:5], w[outside][:5], low[outside][:5], high[outside][:5])
    assert np.isfinite(low[H > 0]).all() and np.isfinite(high[H > 0]).all()


@pytest.mark.parametrize("name", sorted(_HARD_PENALTIES))
def test_custom_penalty_steps_stop_early_at_the_same_values(monkeypatch, name):
    """On a CPU the Newton steps stop once a step changes nothing: the leaf values are those of
    all 30 steps (as other platforms run them), bit for bit."""
    from jaxboost import regularizer

    G, H = _large_sums(6, lowest_hessian=0.0)
    reg = _hard_regularizer(name)
    early = np.asarray(jax.jit(lambda g, h: leaf_value(g, h, reg))(G, H))
    monkeypatch.setattr(regularizer, "per_platform", lambda *args, cpu, default: default(*args))
    every = np.asarray(jax.jit(lambda g, h: leaf_value(g, h, reg))(G, H))
    np.testing.assert_array_equal(early.view(np.int32), every.view(np.int32))


def test_custom_penalty_newton_steps_settle_early():
    """The Newton steps of every candidate stop together once none changes: on 100k candidates
    of large sums a quadratic prior settles within 10 steps of the 30, with an L1 term too (its
    leaves at 0 take no steps), and a quartic within 20 (Newton's steps creep toward its root
    from afar; a bisection closes in faster)."""
    from jaxboost.regularizer import PENALTY_NEWTON_STEPS, _unbounded_leaf_value

    G, H = _large_sums(5)
    regularizers = {"prior": jb.regularizers.custom(_HARD_PENALTIES["prior_l1"][0]),
                    "prior_l1": _hard_regularizer("prior_l1"), "quartic": _hard_regularizer("quartic")}
    for name, limit in {"prior": 10, "prior_l1": 10, "quartic": 20}.items():
        reg = regularizers[name]
        steps = int(jax.jit(lambda g, h: _unbounded_leaf_value(g, h, reg)[1])(G, H))
        assert 1 <= steps <= limit < PENALTY_NEWTON_STEPS, (name, steps)


def test_prior_penalty_has_its_closed_form():
    reg = REGULARIZERS["prior"]
    G, H = jnp.asarray([-3.0, 0.0, 2.0]), jnp.asarray([1.0, 2.0, 4.0])
    expected = -(G - 2.0 * 0.3) / (H + 2.0)
    np.testing.assert_allclose(leaf_value(G, H, reg), expected, rtol=1e-5)


@pytest.fixture(scope="module")
def regression_data():
    rng = np.random.default_rng(0)
    X = rng.integers(0, 8, size=(1500, 4)).astype(np.float32)
    y = (2 * X[:, 0] - X[:, 1] + 3 * np.sin(X[:, 2]) + X[:, 0] * X[:, 3] / 4 + rng.normal(0, 2, 1500)).astype(np.float32)
    return X, y


@pytest.mark.parametrize("constraints,missing_share", [
    ({}, 0.0), (dict(monotone_constraints=(1, -1, 0, 0)), 0.0),
    (dict(monotone_constraints=(1, -1, 0, 0), max_delta_step=0.6), 0.0),
    (dict(monotone_constraints=(1, -1, 0, 0)), 0.1), (dict(colsample_bytree=0.5, colsample_bynode=0.7, seed=3), 0.0)])
def test_custom_quadratic_penalty_trains_like_reg_lambda(regression_data, constraints, missing_share):
    """A custom quadratic penalty grows reg_lambda's trees: unbounded, and under monotone
    constraints, whose children's bounds come from their values within their parent's bounds
    (a custom penalty's from its level's one solve, the built-in's from the split scan); with
    values missing (both directions scanned) and with sampled features."""
    X, y = regression_data
    if missing_share:
        X = np.where(np.random.default_rng(1).uniform(size=X.shape) < missing_share, np.nan, X).astype(np.float32)
    quadratic = jb.regularizers.custom(lambda w, strength: 0.5 * strength * w * w, 3.0)
    custom = jb.train(X, y, num_rounds=5, max_depth=4, regularizer=quadratic, max_bin=16, **constraints)
    builtin = jb.train(X, y, num_rounds=5, max_depth=4, reg_lambda=3.0, max_bin=16, **constraints)
    np.testing.assert_array_equal(custom.trees.feature, builtin.trees.feature)
    np.testing.assert_array_equal(custom.trees.threshold_bin, builtin.trees.threshold_bin)
    np.testing.assert_allclose(custom.predict(X), builtin.predict(X), rtol=1e-5, atol=1e-5)


def test_custom_penalty_trains_on_fewer_split_candidates_than_a_batch(regression_data):
    """One feature of 8 bins: 7 split candidates a node, fewer than a batch of contenders
    (``split.CONTENDERS_PER_NODE``), trained as reg_lambda's trees."""
    from jaxboost import split as split_module

    X, y = regression_data
    X = X[:, :1]
    assert X.shape[1] * (8 - 1) < split_module.CONTENDERS_PER_NODE
    quadratic = jb.regularizers.custom(lambda w, strength: 0.5 * strength * w * w, 3.0)
    custom = jb.train(X, y, num_rounds=3, max_depth=3, regularizer=quadratic, max_bin=8)
    builtin = jb.train(X, y, num_rounds=3, max_depth=3, reg_lambda=3.0, max_bin=8)
    np.testing.assert_array_equal(custom.trees.threshold_bin, builtin.trees.threshold_bin)
    np.testing.assert_allclose(custom.predict(X), builtin.predict(X), rtol=1e-5, atol=1e-5)


def test_an_unhashable_penalty_object_trains_as_its_function_does(regression_data):
    class Quadratic:  # a callable object that cannot be hashed, as a dataclass with eq=True
        __hash__ = None

        def __call__(self, w, strength):
            return 0.5 * strength * w * w

    X, y = regression_data
    settings = dict(num_rounds=5, max_depth=3, max_bin=16)
    by_object = jb.train(X, y, regularizer=jb.regularizers.custom(Quadratic(), 3.0), **settings)
    by_function = jb.train(X, y, regularizer=jb.regularizers.custom(lambda w, s: 0.5 * s * w * w, 3.0), **settings)
    np.testing.assert_array_equal(by_object.predict(X), by_function.predict(X))


def test_split_cost_keeps_a_costly_feature_out(regression_data):
    X, y = regression_data
    free = jb.train(X, y, num_rounds=3, max_depth=3, max_bin=16)
    assert np.any(free.trees.feature[~free.trees.is_leaf] == 0)
    costly = jb.train(X, y, num_rounds=3, max_depth=3, max_bin=16,
                      regularizer=jb.regularizers.l2(1.0, split_cost=np.array([1e9, 0, 0, 0])))
    used = costly.trees.feature[~costly.trees.is_leaf & (costly.trees.loss_change > 0)]
    assert used.size and not np.any(used == 0)


def test_bad_regularizers_are_rejected(regression_data):
    X, y = regression_data
    with pytest.raises(ValueError, match="convex"):
        jb.train(X, y, num_rounds=1, regularizer=jb.regularizers.custom(lambda w, p: -w * w))
    with pytest.raises(ValueError, match="not finite"):
        jb.train(X, y, num_rounds=1, regularizer=jb.regularizers.custom(lambda w, p: jnp.sqrt(w + p), 0.5))
    with pytest.raises(ValueError, match="split_cost"):
        jb.train(X, y, num_rounds=1, regularizer=jb.regularizers.l2(1.0, split_cost=np.ones(3)))
    with pytest.raises(ValueError, match="either regularizer"):
        jb.train(X, y, num_rounds=1, regularizer=jb.regularizers.l2(1.0), reg_lambda=2.0)


# --- loss parameters, Hessian modes, schedules ----------------------------------------------

def test_loss_params_are_traced_not_recompiled(regression_data):
    X, y = regression_data
    traces = []

    def pinball(raw_prediction, y, tau):
        if isinstance(tau, jax.core.Tracer):  # traced for compilation (not the host-side parameter check)
            traces.append(1)
        residual = y - raw_prediction
        return jnp.maximum(tau * residual, (tau - 1.0) * residual)

    low = jb.train(X, y, loss=pinball, loss_params={"tau": 0.2}, num_rounds=4, max_depth=3)
    traced_once = len(traces)
    high = jb.train(X, y, loss=pinball, loss_params={"tau": 0.8}, num_rounds=4, max_depth=3)
    assert len(traces) == traced_once, "a new loss parameter value recompiled the round"
    assert np.mean(y <= low.predict(X)) < 0.35 < 0.65 < np.mean(y <= high.predict(X))
    # The built-in with loss_params equals the built-in with functools.partial.
    by_params = jb.train(X, y, loss="quantile", loss_params={"tau": 0.8}, num_rounds=4, max_depth=3)
    by_partial = jb.train(X, y, loss=functools.partial(jb.losses.quantile, tau=0.8), num_rounds=4, max_depth=3)
    assert_same_training(by_params.predict(X), by_partial.predict(X))


def test_invalid_loss_params_fail_before_training(regression_data):
    X, y = regression_data
    with pytest.raises(ValueError, match="tau"):
        jb.train(X, y, loss="quantile", loss_params={"tau": 1.5}, num_rounds=1)
    with pytest.raises(TypeError, match="loss_params"):
        jb.train(X, y, loss="squared_error", loss_params={"delta": 1.0}, num_rounds=1)


def test_hessian_modes(regression_data):
    X, y = regression_data
    exact = jb.train(X, y, num_rounds=4, max_depth=3)
    constant = jb.train(X, y, num_rounds=4, max_depth=3, hessian="constant")
    # Squared error has h = 1: every mode is the same model.
    assert_same_training(exact.predict(X), constant.predict(X))

    def cauchy(raw_prediction, y):  # non-convex: negative Hessian for large residuals
        return jnp.log1p(jnp.square(y - raw_prediction))

    with pytest.raises(ValueError, match="negative Hessians"):
        jb.train(X, y, loss=cauchy, num_rounds=2, max_depth=3)
    floored = jb.train(X, y, loss=cauchy, num_rounds=20, max_depth=3, hessian="floor", hessian_floor=0.1,
                       learning_rate=0.3)
    first_order = jb.train(X, y, loss=cauchy, num_rounds=20, max_depth=3, hessian="constant", leaf_refit=True,
                           learning_rate=0.3)
    baseline = np.mean(np.abs(y - np.median(y)))
    for model in (floored, first_order):
        assert np.mean(np.abs(y - model.predict(X))) < 0.7 * baseline
    with pytest.raises(ValueError, match="hessian"):
        jb.train(X, y, num_rounds=1, hessian="diagonal")


def test_learning_rate_schedule_equals_continued_training(regression_data):
    X, y = regression_data
    schedule = optax.piecewise_constant_schedule(0.3, {4: 0.25})  # 0.3 for rounds 0-3, then 0.075
    scheduled = jb.train(X, y, num_rounds=8, max_depth=3, learning_rate=schedule, subsample=0.8, seed=3)
    first = jb.train(X, y, num_rounds=4, max_depth=3, learning_rate=0.3, subsample=0.8, seed=3)
    continued = jb.train(X, y, num_rounds=4, max_depth=3, learning_rate=0.075, subsample=0.8, seed=3,
                         init_model=first)
    assert_same_training(scheduled.predict(X), continued.predict(X), rtol=1e-6, atol=1e-6)
    constant = jb.train(X, y, num_rounds=4, max_depth=3, learning_rate=optax.constant_schedule(0.3), subsample=0.8,
                        seed=3)
    assert_same_training(constant.predict(X), first.predict(X))


# --- continuation ------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["logistic", "softmax"])
def test_four_plus_four_rounds_equal_eight(loss):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(1200, 5)).astype(np.float32)
    X[rng.random(X.shape) < 0.05] = np.nan
    score = np.nan_to_num(X[:, 0]) + np.nan_to_num(X[:, 1]) ** 2
    y = (score > 1).astype(np.float32) if loss == "logistic" else np.digitize(score, [0, 1.5]).astype(np.float32)
    X_val, y_val = X[:300], y[:300]
    settings = dict(loss=loss, max_depth=3, subsample=0.7, colsample_bytree=0.8, seed=5, eval_set=[(X_val, y_val)])
    eight = jb.train(X, y, num_rounds=8, **settings)
    four = jb.train(X, y, num_rounds=4, **settings)
    continued = jb.train(X, y, num_rounds=4, init_model=four, **settings)
    assert continued.num_rounds == 8
    np.testing.assert_array_equal(continued.trees.feature, eight.trees.feature)
    np.testing.assert_allclose(continued.predict_raw(X), eight.predict_raw(X), rtol=1e-6, atol=1e-6)
    metric = "logloss" if loss == "logistic" else "mlogloss"
    np.testing.assert_allclose(continued.evals_result["validation_0"][metric],
                               eight.evals_result["validation_0"][metric][4:], rtol=1e-5)


def test_training_continues_from_a_saved_model(regression_data, tmp_path):
    X, y = regression_data
    eight = jb.train(X, y, num_rounds=8, max_depth=3, subsample=0.8, seed=2)
    jb.train(X, y, num_rounds=4, max_depth=3, subsample=0.8, seed=2).save(tmp_path / "four.json")
    continued = jb.train(X, y, num_rounds=4, max_depth=3, subsample=0.8, seed=2,
                         init_model=jb.load(tmp_path / "four.json"))
    np.testing.assert_allclose(continued.predict(X), eight.predict(X), rtol=1e-6, atol=1e-6)


def test_continuation_checks_its_model(regression_data):
    X, y = regression_data
    model = jb.train(X, y, num_rounds=2, max_depth=4)
    with pytest.raises(ValueError, match="deeper"):
        jb.train(X, y, num_rounds=2, max_depth=3, init_model=model)
    with pytest.raises(ValueError, match="outputs"):
        jb.train(X, (y > 3).astype(int) + (y > 6), loss="softmax", num_rounds=1, init_model=model)
    # A shallower model continues inside a deeper heap.
    deeper = jb.train(X, y, num_rounds=2, max_depth=5, init_model=jb.train(X, y, num_rounds=2, max_depth=2))
    assert deeper.trees.feature.shape == (4, 1, 63)


# --- callbacks ---------------------------------------------------------------------------------

def test_callbacks_stop_log_and_see_the_model(regression_data, capsys):
    X, y = regression_data

    class StopAtRound3(jb.callbacks.Callback):
        def __init__(self):
            self.seen = []

        def after_iteration(self, state):
            self.seen.append(state.model().num_rounds)
            return state.round_index == 3

    stopper = StopAtRound3()
    model = jb.train(X, y, num_rounds=10, max_depth=3, callbacks=[stopper], eval_set=[(X[:200], y[:200])], verbose=2)
    assert model.num_rounds == 4 and stopper.seen == [1, 2, 3, 4]
    printed = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in printed] == ["[0]", "[2]"]
    by_callback = jb.train(X, y, num_rounds=60, max_depth=3, learning_rate=0.5, eval_set=[(X[:200], y[:200] + 5)],
                           callbacks=[jb.callbacks.EarlyStopping(3)])
    by_argument = jb.train(X, y, num_rounds=60, max_depth=3, learning_rate=0.5, eval_set=[(X[:200], y[:200] + 5)],
                           early_stopping_rounds=3)
    assert by_callback.best_iteration == by_argument.best_iteration < by_argument.num_rounds - 1
    assert by_argument.num_rounds == by_argument.best_iteration + 4


def test_progress_bar_counts_rounds(regression_data, capsys):
    X, y = regression_data
    bar = jb.callbacks.ProgressBar()
    jb.train(X, y, num_rounds=5, max_depth=3, callbacks=[bar], eval_set=[(X[:200], y[:200])])
    assert bar._bar.n == 5 and bar._bar.total == 5
    assert "rmse" in capsys.readouterr().err


# --- constraints against XGBoost ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["monotone", "interaction"])
def test_constraints_match_xgboost(regression_data, kind):
    X, y = regression_data
    if kind == "monotone":
        ours = dict(monotone_constraints=(1, -1, 0, 0))
        theirs = dict(monotone_constraints="(1,-1,0,0)")
    else:
        ours = dict(interaction_constraints=[[0, 1], [2, 3]])
        theirs = dict(interaction_constraints="[[0, 1], [2, 3]]")
    model = jb.train(X, y, num_rounds=5, max_depth=4, learning_rate=0.3, max_bin=16, **ours)
    booster = xgb.train(dict(tree_method="hist", max_depth=4, eta=0.3, max_bin=16, base_score=float(model.base_score[0]),
                             **theirs), xgb.DMatrix(X, y), 5)
    np.testing.assert_allclose(model.predict(X), booster.predict(xgb.DMatrix(X)), rtol=2e-5, atol=2e-5)
    if kind == "monotone":
        unconstrained = jb.train(X, y, num_rounds=5, max_depth=4, learning_rate=0.3, max_bin=16)
        for feature, sign in ((0, 1), (1, -1)):
            grid = np.repeat(X[:40][None], 8, axis=0)
            grid[:, :, feature] = np.arange(8)[:, None]
            steps = np.diff(model.predict(grid.reshape(-1, 4)).reshape(8, 40), axis=0) * sign
            assert np.all(steps >= -1e-6), f"not monotone in feature {feature}"
        grid = np.repeat(X[:40][None], 8, axis=0)
        grid[:, :, 0] = np.arange(8)[:, None]
        steps = np.diff(unconstrained.predict(grid.reshape(-1, 4)).reshape(8, 40), axis=0)
        assert np.any(steps < -1e-3), "the data do not test the constraint: unconstrained is monotone too"
    else:
        _assert_paths_within_groups(model.trees, [{0, 1}, {2, 3}])


def _assert_paths_within_groups(trees, groups):
    for r in range(trees.feature.shape[0]):
        feature, is_leaf = trees.feature[r, 0], trees.is_leaf[r, 0]
        for leaf in np.flatnonzero(is_leaf):
            path, node = set(), leaf
            while node > 0:
                node = (node - 1) // 2
                path.add(int(feature[node]))
            assert any(path <= group for group in groups), f"round {r} leaf {leaf} mixes groups: {path}"


@pytest.mark.parametrize("sampling", [{"colsample_bynode": 0.5}, {"colsample_bylevel": 0.6}])
def test_interaction_constraints_hold_under_column_sampling(regression_data, sampling):
    X, y = regression_data
    model = jb.train(X, y, num_rounds=6, max_depth=4, learning_rate=0.3, max_bin=16,
                     interaction_constraints=[[0, 1], [2, 3]], **sampling)
    _assert_paths_within_groups(model.trees, [{0, 1}, {2, 3}])


def test_monotone_constraint_holds_after_leaf_refit(regression_data):
    # Quantile leaves are refit by exact minimisation; the refit values stay within the bounds.
    X, y = regression_data
    model = jb.train(X, y, loss="quantile", loss_params={"tau": 0.8}, num_rounds=8, max_depth=4,
                     learning_rate=0.5, monotone_constraints={1: -1}, max_bin=16)
    grid = np.repeat(X[:60][None], 8, axis=0)
    grid[:, :, 1] = np.arange(8)[:, None]
    steps = np.diff(model.predict(grid.reshape(-1, 4)).reshape(8, 60), axis=0)
    assert np.all(steps <= 1e-6)
    assert abs(np.mean(y <= model.predict(X)) - 0.8) < 0.05


def test_constraint_input_errors(regression_data):
    X, y = regression_data
    with pytest.raises(ValueError, match="entries"):
        jb.train(X, y, num_rounds=1, monotone_constraints=(1, 0))
    with pytest.raises(ValueError, match="-1, 0 or"):
        jb.train(X, y, num_rounds=1, monotone_constraints=(2, 0, 0, 0))
    with pytest.raises(ValueError, match="features are 0..3"):
        jb.train(X, y, num_rounds=1, interaction_constraints=[[0, 7]])


# --- train_many ---------------------------------------------------------------------------------

def test_train_many_equals_models_trained_alone_in_one_trace(regression_data):
    X, y = regression_data
    data = jb.Dataset(X, y)
    traces = []

    def squared(raw_prediction, y):
        traces.append(1)
        return 0.5 * (y - raw_prediction) ** 2

    lambdas, rates, seeds = np.array([0.5, 1.0, 4.0]), np.array([0.3, 0.1, 0.2]), np.array([0, 1, 2])
    models = jb.train_many(data, loss=squared, batch={"reg_lambda": lambdas, "learning_rate": rates}, seeds=seeds,
                           num_rounds=6, max_depth=3, subsample=0.8, eval_set=[(X[:200], y[:200])])
    traced = len(traces)
    jb.train_many(data, loss=squared, batch={"reg_lambda": lambdas + 1, "learning_rate": rates / 2}, seeds=seeds + 7,
                  num_rounds=6, max_depth=3, subsample=0.8, eval_set=[(X[:200], y[:200])])
    assert len(traces) == traced, "new values for the batched models traced the round again"
    for k in range(3):
        alone = jb.train(data, loss=squared, reg_lambda=float(lambdas[k]), learning_rate=float(rates[k]),
                         seed=int(seeds[k]), num_rounds=6, max_depth=3, subsample=0.8, eval_set=[(X[:200], y[:200])])
        np.testing.assert_array_equal(models[k].trees.feature, alone.trees.feature)
        np.testing.assert_allclose(models[k].predict(X), alone.predict(X), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(models[k].evals_result["validation_0"]["loss"],
                                   alone.evals_result["validation_0"]["loss"], rtol=1e-5)


@needs_repeatable_sums  # on an H100 one split of the batched fit chose another feature
def test_train_many_deep_trees_equal_models_trained_alone(regression_data):
    """Depth 8: each model grows its deep levels in its own part of the batched histogram buffer."""
    X, y = regression_data
    lambdas = [1.0, 3.0]
    models = jb.train_many(X, y, batch={"reg_lambda": lambdas}, num_rounds=3, max_depth=8, learning_rate=0.3)
    for model, reg_lambda in zip(models, lambdas):
        alone = jb.train(X, y, reg_lambda=reg_lambda, num_rounds=3, max_depth=8, learning_rate=0.3)
        np.testing.assert_array_equal(model.trees.feature, alone.trees.feature)
        assert_same_training(model.predict_raw(X), alone.predict_raw(X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("settings", [
    dict(loss="squared_error", colsample_bytree=0.6, subsample=0.8),
    dict(loss="softmax", multi_strategy="multi_output_tree"),
])
@needs_repeatable_sums  # on an H100 a multi-output split did, the eval loss 1% apart
def test_train_many_vmapped_over_models_grows_the_models_of_the_loop_over_them(monkeypatch, regression_data,
                                                                               settings):
    """Accelerators vmap train_many's round over the models, the CPU loops over them: both grow
    the same models (each way run here on this backend), with an eval set's histories."""
    from jaxboost import boosting
    X, y = regression_data
    if settings["loss"] == "softmax":
        y = np.digitize(y, np.quantile(y, [0.3, 0.7])).astype(np.float32)
    common = dict(batch={"reg_lambda": [0.5, 3.0], "learning_rate": [0.3, 0.1]}, seeds=[1, 2], num_rounds=3,
                  max_depth=4, eval_set=[(X[:200], y[:200])], **settings)
    boosting.compiled_many_rounds.cache_clear()
    try:
        monkeypatch.setattr(boosting, "MODELS_IN_A_LOOP_PLATFORMS", (jax.default_backend(),))
        looped = jb.train_many(X, y, **common)
        boosting.compiled_many_rounds.cache_clear()
        monkeypatch.setattr(boosting, "MODELS_IN_A_LOOP_PLATFORMS", ())
        vmapped = jb.train_many(X, y, **common)
    finally:
        boosting.compiled_many_rounds.cache_clear()
    for loop_model, vmap_model in zip(looped, vmapped):
        np.testing.assert_array_equal(loop_model.trees.feature, vmap_model.trees.feature)
        np.testing.assert_array_equal(loop_model.trees.threshold_bin, vmap_model.trees.threshold_bin)
        np.testing.assert_allclose(loop_model.predict_raw(X), vmap_model.predict_raw(X), rtol=1e-6, atol=1e-6)
        for name, history in loop_model.evals_result["validation_0"].items():
            np.testing.assert_allclose(history, vmap_model.evals_result["validation_0"][name], rtol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 2 or jb.available_cpu_cores() < 2,
                    reason="splits the models over the cores of a CPU of several, one device each")
def test_train_many_on_few_rows_splits_the_models_over_the_cores(monkeypatch, regression_data):
    """Rows that train on one device leave the other cores to train_many: the models are split
    over them, one device each looping over its share (three models on two: the last share is
    filled up with a copy, dropped), and grow the models of one loop over them all, with eval
    histories, row samples and the shared data read on every device."""
    from jaxboost import boosting, devices, vmapped_training

    X, y = regression_data
    splits = []
    original = vmapped_training.many_models_meshes

    def recorded(*args, **kwargs):
        meshes = original(*args, **kwargs)
        splits.append(meshes[1])
        return meshes

    common = dict(batch={"reg_lambda": [0.5, 3.0, 1.0], "learning_rate": [0.3, 0.1, 0.2]}, seeds=[1, 2, 3],
                  num_rounds=4, max_depth=4, subsample=0.8, eval_set=[(X[:200], y[:200])])
    boosting.compiled_many_rounds.cache_clear()
    try:
        monkeypatch.setattr(vmapped_training, "many_models_meshes", recorded)
        split = jb.train_many(X, y, **common)
        monkeypatch.setattr(vmapped_training, "many_models_meshes",
                            lambda n_rows, n_features, max_bin, models, rows_in_ranges: (
                                devices.row_mesh(n_rows, n_features, max_bin), None))
        looped = jb.train_many(X, y, **common)
    finally:
        boosting.compiled_many_rounds.cache_clear()
    assert splits[-1] is not None and splits[-1].devices.size == 2, splits
    assert len(split) == len(looped) == 3
    for split_model, loop_model in zip(split, looped):
        for field in loop_model.trees._fields:
            np.testing.assert_array_equal(getattr(split_model.trees, field), getattr(loop_model.trees, field),
                                          err_msg=field)
        np.testing.assert_array_equal(split_model.base_score, loop_model.base_score)
        for name, history in loop_model.evals_result["validation_0"].items():
            np.testing.assert_array_equal(history, split_model.evals_result["validation_0"][name])
    assert not np.array_equal(split[0].trees.value, split[1].trees.value)


@pytest.mark.parametrize("loss", ["logistic", "absolute_error", "softmax"])
def test_train_many_starting_values_are_those_of_train_bit_for_bit(loss):
    """Both find the starting value on one device (its passes need no sum over the devices), the
    same way: each model's base score is train's exactly, on data large enough to shard the rows.
    (Accelerators vmap train_many, whose reductions then sum in another order: last bits there.)"""
    rng = np.random.default_rng(8)
    X = rng.normal(size=(30_000, 4)).astype(np.float32)
    y = X[:, 0] + rng.normal(size=30_000).astype(np.float32)
    if loss == "logistic":
        y = (y > 0.3).astype(np.float32)
    elif loss == "softmax":
        y = np.digitize(y, [-1.0, 1.0]).astype(np.float32)
    alone = jb.train(X, y, loss=loss, num_rounds=1, max_depth=2)
    many = jb.train_many(X, y, loss=loss, batch={"reg_lambda": [1.0, 2.0]}, num_rounds=1, max_depth=2)
    for model in many:
        assert_same_training(np.asarray(model.base_score), np.asarray(alone.base_score))


def test_train_many_with_column_samples_of_several_sizes_equals_models_trained_alone(regression_data):
    """Models whose trees sample different numbers of features share one program: its compact
    histograms hold the largest sample's feature slots, a smaller sample's spare slots never
    split, and each model grows the trees it grows alone (which hold just its own slots)."""
    X, y = regression_data
    X = np.column_stack([X, np.random.default_rng(3).normal(size=(len(X), 6)).astype(np.float32)])
    fractions = [0.3, 0.75, 0.5]
    settings = dict(num_rounds=4, max_depth=4, learning_rate=0.3)
    models = jb.train_many(X, y, batch={"colsample_bytree": fractions}, seeds=[2, 5, 7], **settings)
    for model, fraction, seed in zip(models, fractions, [2, 5, 7]):
        alone = jb.train(X, y, colsample_bytree=fraction, seed=seed, **settings)
        np.testing.assert_array_equal(model.trees.feature, alone.trees.feature)
        assert_same_training(model.predict_raw(X), alone.predict_raw(X), rtol=1e-6, atol=1e-6)
        # Each tree splits on the features of one sample of that size (its split nodes: a node
        # below a leaf is never reached, and keeps feature 0).
        keep = int(np.floor(np.float32(fraction) * np.float32(X.shape[1])))
        for features, is_leaf in zip(model.trees.feature[:, 0], model.trees.is_leaf[:, 0]):
            assert 1 <= len(set(features[~is_leaf & reached_nodes(is_leaf)])) <= keep


def test_train_many_folds_and_loss_parameters(regression_data):
    X, y = regression_data
    folds = np.arange(len(y)) % 3
    weights = np.stack([(folds != k).astype(np.float32) for k in range(3)])
    models = jb.train_many(X, y, sample_weights=weights, num_rounds=4, max_depth=3)
    for k in range(3):
        # Zero weights are exactly "left out"; the edges are shared, built from the unweighted data.
        alone = jb.train(jb.Dataset(X, y, sample_weight=weights[k], bin_edges=models[k].bin_edges),
                         num_rounds=4, max_depth=3)
        np.testing.assert_allclose(models[k].predict(X), alone.predict(X), rtol=1e-5, atol=1e-5)
    taus = np.array([0.1, 0.5, 0.9])
    quantiles = jb.train_many(X, y, loss="quantile", batch={"tau": taus}, num_rounds=10, max_depth=3,
                              learning_rate=0.3)
    coverage = [np.mean(y <= model.predict(X)) for model in quantiles]
    assert coverage[0] < coverage[1] < coverage[2]
    np.testing.assert_allclose(coverage, taus, atol=0.08)
    with pytest.raises(ValueError, match="same number of models"):
        jb.train_many(X, y, batch={"reg_lambda": [1.0, 2.0]}, seeds=[0, 1, 2], num_rounds=1)
    with pytest.raises(ValueError, match="tau"):
        jb.train_many(X, y, loss="quantile", batch={"tau": [0.5, 1.5]}, num_rounds=1)
