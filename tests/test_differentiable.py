"""Tests for jaxboost.differentiable: hard prediction from leaf parameters against Model.predict_raw,
leaf gradients against NumPy leaf sums and finite differences, the round trip back to a Model,
soft -> hard convergence, soft input gradients against finite differences, and fine-tuning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import differentiable as jd
from jaxboost.binning import apply_bins

N_ROWS = 1500


def _binary_data(seed=0, n=N_ROWS):
    """5 features; feature 2 is 30% missing and its missingness carries signal, so the trees
    split "every present value left, missing right" on a padded +inf edge."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)).astype(np.float32)
    X[:, 3] *= 100.0  # a feature on another scale, for per-feature temperatures
    missing = rng.random(n) < 0.3
    X[missing, 2] = np.nan
    y = ((X[:, 0] + 2.0 * missing + X[:, 3] / 100.0 + 0.3 * rng.normal(size=n)) > 0.8).astype(np.float64)
    return X, y


@pytest.fixture(scope="module")
def binary():
    X, y = _binary_data()
    model = jb.train(X, y, loss="logistic", num_rounds=12, max_depth=4, max_bin=64)
    return model, X, y


@pytest.fixture(scope="module")
def multiclass():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(600, 4)).astype(np.float32)
    y = np.digitize(X[:, 0] + 0.5 * X[:, 1], [-0.5, 0.5]).astype(np.float64)
    model = jb.train(X, y, loss="softmax", num_rounds=6, max_depth=3, max_bin=64)
    return model, X, y


def _row_distance_to_thresholds(params, X, spread):
    """Per row: the smallest |x - threshold| / spread over every finite split (inf if none)."""
    structure = params.structure
    thresholds = np.asarray(params.thresholds)
    splits = ~structure.is_leaf & np.isfinite(thresholds)
    features = structure.feature[splits]
    values = np.nan_to_num(X[:, features], nan=np.inf)
    return np.min(np.abs(values - thresholds[splits]) / spread[features], axis=1)


def test_hard_prediction_equals_model_exactly(binary, multiclass):
    for model, X, _ in (binary, multiclass):
        params = jd.leaf_parameters(model)
        expected = model.predict_raw(X)
        np.testing.assert_array_equal(np.asarray(jd.predict_raw(params, X)), expected)
        np.testing.assert_array_equal(np.asarray(jd.predict_raw_binned(params, apply_bins(X, model.bin_edges))),
                                      expected)
    model, X, _ = binary
    assert np.isinf(np.asarray(jd.leaf_parameters(model).thresholds)).any(), "data should give padded-edge splits"
    sliced = jd.leaf_parameters(model, iteration_range=(3, 11))
    np.testing.assert_array_equal(np.asarray(jd.predict_raw(sliced, X)),
                                  model.predict_raw(X, iteration_range=(3, 11)))


def test_leaf_gradient_is_leaf_membership_and_matches_finite_differences(binary):
    model, X, y = binary
    params = jd.leaf_parameters(model)
    leaves = model.predict_leaf(X)  # (n, rounds)
    rounds = np.broadcast_to(np.arange(model.num_rounds), leaves.shape)

    def total(values):
        return jnp.sum(jd.predict_raw(dataclasses.replace(params, leaf_values=values), X))

    counts = np.zeros(params.structure.shape, np.float64)
    np.add.at(counts, (rounds, 0, leaves), 1.0)
    np.testing.assert_array_equal(np.asarray(jax.grad(total)(params.leaf_values)), counts)

    def mean_log_loss(values):
        raw = jd.predict_raw(dataclasses.replace(params, leaf_values=values), X)
        return jnp.mean(jax.nn.softplus(raw) - y * raw)

    gradient = np.asarray(jax.grad(mean_log_loss)(params.leaf_values))
    # NumPy reference: d(mean log loss)/d(leaf) = sum over the leaf's rows of (p - y) / n.
    residual = (1.0 / (1.0 + np.exp(-model.predict_raw(X).astype(np.float64))) - y) / len(y)
    expected = np.zeros(params.structure.shape, np.float64)
    np.add.at(expected, (rounds, 0, leaves), residual[:, None])
    np.testing.assert_allclose(gradient, expected, atol=1e-6)

    eps = 1e-2
    values = np.asarray(params.leaf_values)
    leaf_slots = np.argwhere(params.structure.is_leaf)
    for r, k, j in leaf_slots[np.random.default_rng(0).choice(len(leaf_slots), 6, replace=False)]:
        plus, minus = values.copy(), values.copy()
        plus[r, k, j] += eps
        minus[r, k, j] -= eps
        finite_difference = (float(mean_log_loss(jnp.asarray(plus))) - float(mean_log_loss(jnp.asarray(minus)))) / (2 * eps)
        assert finite_difference == pytest.approx(gradient[r, k, j], abs=2e-5, rel=2e-2)


def test_to_model_round_trip(binary, multiclass):
    for model, X, _ in (binary, multiclass):
        params = jd.leaf_parameters(model)
        np.testing.assert_array_equal(jd.to_model(model, params).predict_raw(X), model.predict_raw(X))
        rng = np.random.default_rng(0)
        changed = dataclasses.replace(
            params, leaf_values=params.leaf_values + jnp.asarray(rng.normal(0, 0.1, params.structure.shape), jnp.float32),
            base_score=params.base_score + 0.25)
        rebuilt = jd.to_model(model, changed)
        assert isinstance(rebuilt, jb.Model) and rebuilt.trees.value.dtype == np.float32
        np.testing.assert_array_equal(rebuilt.predict_raw(X), np.asarray(jd.predict_raw(changed, X)))
        assert not np.allclose(rebuilt.predict_raw(X), model.predict_raw(X))
        # Split nodes keep their trained values.
        np.testing.assert_array_equal(rebuilt.trees.value[~model.trees.is_leaf], model.trees.value[~model.trees.is_leaf])
        np.testing.assert_array_equal(rebuilt.predict_leaf(X), model.predict_leaf(X))

    model, X, _ = binary
    sliced = jd.leaf_parameters(model, iteration_range=(0, 10))
    shifted = dataclasses.replace(sliced, leaf_values=sliced.leaf_values * 2.0)
    rebuilt = jd.to_model(model, shifted)
    np.testing.assert_array_equal(rebuilt.predict_raw(X, iteration_range=(0, 10)),
                                  np.asarray(jd.predict_raw(shifted, X)))
    np.testing.assert_array_equal(rebuilt.trees.value[10:], model.trees.value[10:])


def test_to_model_rejects_what_a_model_cannot_hold(binary, multiclass):
    model, _, _ = binary
    params = jd.leaf_parameters(model)
    with pytest.raises(ValueError, match="thresholds"):
        jd.to_model(model, dataclasses.replace(params, thresholds=params.thresholds + 0.5))
    with pytest.raises(ValueError, match="do not match"):
        jd.to_model(multiclass[0], params)
    with pytest.raises(ValueError, match="shape"):
        jd.to_model(model, dataclasses.replace(params, leaf_values=params.leaf_values[:3]))
    with pytest.raises(ValueError, match="NaN"):
        jd.to_model(model, dataclasses.replace(params, leaf_values=params.leaf_values.at[0, 0, :].set(jnp.nan)))
    with pytest.raises(ValueError, match="shape"):
        model.with_leaf_values(np.zeros(3))


def test_soft_prediction_converges_to_hard(binary, multiclass):
    for model, X, _ in (binary, multiclass):
        params = jd.leaf_parameters(model)
        spread = jd.feature_spread(model)
        hard = model.predict_raw(X)
        # Rows closer than 1e-4 spreads to some threshold need a smaller temperature still.
        far = _row_distance_to_thresholds(params, X, spread) > 1e-4
        assert far.mean() > 0.8
        errors = []
        for temperature in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
            soft = np.asarray(jd.soft_predict_raw(params, X, temperature * spread))
            assert soft.shape == hard.shape
            errors.append(np.abs(soft - hard)[far].max())
        assert all(later < earlier for earlier, later in zip(errors, errors[1:]) if earlier > 1e-6), errors
        assert errors[-1] < 1e-4, errors
        assert errors[0] > 1e-2  # the relaxation is not trivially the hard model


def test_per_feature_temperature(binary):
    model, X, _ = binary
    spread = jd.feature_spread(model)
    edges, n_edges = model.bin_edges.edges, model.bin_edges.n_edges
    np.testing.assert_allclose(spread, [edges[f, n_edges[f] - 1] - edges[f, 0] for f in range(X.shape[1])], rtol=1e-6)
    assert spread[3] > 50 * spread[0]  # feature 3 is on a 100x scale
    np.testing.assert_array_equal(np.asarray(jd.soft_predict_raw(model, X[:50], 0.2)),
                                  np.asarray(jd.soft_predict_raw(model, X[:50], np.full(X.shape[1], 0.2))))


def test_soft_prediction_at_high_temperature_is_an_average_of_leaves(binary):
    """With one huge temperature every split is 50/50 (padded edges and missing values stay hard)."""
    model, X, _ = binary
    params = jd.leaf_parameters(model)
    rows = X[:5].copy()
    rows[:, 2] = 0.0  # no missing values
    soft = np.asarray(jd.soft_predict_raw(params, rows, 1e9))
    structure = params.structure
    values = np.asarray(params.leaf_values, np.float64)
    expected = float(model.base_score[0])
    for r in range(structure.shape[0]):
        # NumPy reference walk: reach probability 1/2 per split, 1 through a padded-edge split.
        reach = np.zeros(structure.shape[2])
        reach[0] = 1.0
        for node in range(structure.shape[2]):
            if reach[node] == 0 or structure.is_leaf[r, 0, node]:
                continue
            if np.isinf(params.thresholds[r, 0, node]):
                reach[2 * node + 1] += reach[node]
            else:
                reach[2 * node + 1] += reach[node] / 2
                reach[2 * node + 2] += reach[node] / 2
        expected += float(np.sum(reach * structure.is_leaf[r, 0] * values[r, 0]))
    np.testing.assert_allclose(soft, expected, rtol=1e-5, atol=1e-5)


def test_soft_gradients_match_finite_differences(binary):
    model, X, _ = binary
    params = jd.leaf_parameters(model)
    temperature = 0.3 * jd.feature_spread(model)
    rows = X[:8]
    with jax.enable_x64(True):
        rows64 = jnp.asarray(rows, jnp.float64)
        temperature64 = jnp.asarray(temperature, jnp.float64)

        def total(X_in, thresholds):
            return jnp.sum(jd.soft_predict_raw(dataclasses.replace(params, thresholds=thresholds), X_in,
                                               temperature64) ** 2)

        thresholds64 = jnp.asarray(params.thresholds, jnp.float64)
        gradient_X, gradient_thresholds = jax.grad(total, argnums=(0, 1))(rows64, thresholds64)
        gradient_X = np.asarray(gradient_X)
        assert np.isfinite(gradient_X).all() and np.isfinite(np.asarray(gradient_thresholds)).all()
        present = ~np.isnan(rows)
        np.testing.assert_array_equal(gradient_X[~present], 0.0)  # missing values route hard
        assert np.abs(gradient_X[present]).max() > 1e-3
        for i, f in np.argwhere(present)[:: 3]:
            eps = 1e-6 * float(temperature[f])
            plus, minus = np.asarray(rows64).copy(), np.asarray(rows64).copy()
            plus[i, f] += eps
            minus[i, f] -= eps
            finite_difference = (float(total(jnp.asarray(plus), thresholds64))
                                 - float(total(jnp.asarray(minus), thresholds64))) / (2 * eps)
            assert finite_difference == pytest.approx(gradient_X[i, f], rel=1e-5, abs=1e-8)
        # Thresholds: a few finite splits; padded (+inf) ones get a zero gradient, not NaN.
        gradient_thresholds = np.asarray(gradient_thresholds)
        split = ~params.structure.is_leaf & np.isfinite(np.asarray(params.thresholds))
        np.testing.assert_array_equal(gradient_thresholds[np.isinf(np.asarray(params.thresholds))], 0.0)
        for r, k, j in np.argwhere(split)[:5]:
            eps = 1e-6
            plus, minus = np.asarray(thresholds64).copy(), np.asarray(thresholds64).copy()
            plus[r, k, j] += eps
            minus[r, k, j] -= eps
            finite_difference = (float(total(rows64, jnp.asarray(plus)))
                                 - float(total(rows64, jnp.asarray(minus)))) / (2 * eps)
            assert finite_difference == pytest.approx(gradient_thresholds[r, k, j], rel=1e-5, abs=1e-8)


def test_soft_prediction_rejects_bad_temperature_and_shapes(binary):
    model, X, _ = binary
    for bad in (0.0, -1.0, np.inf, np.ones(3), -np.ones(5)):
        with pytest.raises(ValueError, match="temperature"):
            jd.soft_predict_raw(model, X[:4], bad)
    with pytest.raises(ValueError, match="features"):
        jd.soft_predict_raw(model, X[:4, :3], 0.1)
    with pytest.raises(ValueError, match="shape"):
        jd.predict_raw(jd.leaf_parameters(model), jnp.asarray(X[:4, :3]))
    with pytest.raises(TypeError, match="Model or EnsembleParameters"):
        jd.soft_predict_raw("model", X[:4], 0.1)


def test_new_parameters_of_the_same_model_reuse_the_compiled_program(binary):
    model, X, _ = binary
    jd.predict_raw(jd.leaf_parameters(model), X)
    compiled = jd._predict_raw._cache_size()
    jd.predict_raw(jd.leaf_parameters(model), X)
    assert jd._predict_raw._cache_size() == compiled


def test_fine_tuning_lowers_a_non_decomposable_objective(binary, tmp_path):
    model, X, y = binary
    X_train, y_train, X_val, y_val = X[:1000], y[:1000], X[1000:], y[1000:]

    def auc_surrogate(raw_prediction, y):
        return jd.pairwise_auc_loss(raw_prediction, y, temperature=0.5)

    def surrogate_of(m, features, labels):
        return float(auc_surrogate(jnp.asarray(m.predict_raw(features)), jnp.asarray(labels)))

    import optax

    optimizer = optax.adam(1e-2)
    # The same objective, optimizer and shapes: both calls run one compiled program.
    tuned = jd.fine_tune_leaves(model, X_train, y_train, auc_surrogate, optimizer=optimizer, steps=60,
                                X_val=X_val, y_val=y_val, restore_best=False)
    record = tuned.evals_result["fine_tune"]
    history = record["objective"]
    assert len(history) == 61
    before, after = surrogate_of(model, X_train, y_train), surrogate_of(tuned, X_train, y_train)
    assert history[0] == pytest.approx(before, rel=1e-5)
    assert history[-1] == pytest.approx(after, rel=1e-5)
    assert after < 0.8 * before, (before, after)
    np.testing.assert_array_equal(tuned.predict_leaf(X), model.predict_leaf(X))
    assert record["validation_objective"][-1] == pytest.approx(surrogate_of(tuned, X_val, y_val), rel=1e-5)

    # Held-out tracking: by default the values of the best validation step come back.
    tuned_val = jd.fine_tune_leaves(model, X_train, y_train, auc_surrogate, optimizer=optimizer, steps=60,
                                    X_val=X_val, y_val=y_val)
    record = tuned_val.evals_result["fine_tune"]
    validation = record["validation_objective"]
    assert surrogate_of(tuned_val, X_val, y_val) == pytest.approx(min(validation), rel=1e-5)
    assert min(validation) <= validation[0]
    # A fine-tuned model is an ordinary Model: it saves and loads back exactly.
    for name in ("tuned.json", "tuned.npz"):
        tuned_val.save(tmp_path / name)
        np.testing.assert_array_equal(jb.load(tmp_path / name).predict_raw(X), tuned_val.predict_raw(X))


def test_fine_tuning_with_sampled_pairs_and_checks(binary):
    model, X, y = binary

    def sampled_auc_surrogate(raw_prediction, y, key):
        return jd.pairwise_auc_loss(raw_prediction, y, num_pairs=2000, key=key)

    import optax

    tuned = jd.fine_tune_leaves(model, X, y, sampled_auc_surrogate, optimizer=optax.sgd(1.0), steps=40)
    full = jd.pairwise_auc_loss(jnp.asarray(model.predict_raw(X)), jnp.asarray(y))
    full_tuned = jd.pairwise_auc_loss(jnp.asarray(tuned.predict_raw(X)), jnp.asarray(y))
    assert float(full_tuned) < 0.9 * float(full)
    with pytest.raises(ValueError, match="steps"):
        jd.fine_tune_leaves(model, X, y, sampled_auc_surrogate, steps=0)
    with pytest.raises(ValueError, match="scalar"):
        jd.fine_tune_leaves(model, X, y, lambda raw, y: raw - y, steps=2)
    with pytest.raises(ValueError, match="X_val and y_val"):
        jd.fine_tune_leaves(model, X, y, sampled_auc_surrogate, steps=2, X_val=X)
    with pytest.raises(ValueError, match="rows"):
        jd.fine_tune_leaves(model, X, y[:10], sampled_auc_surrogate, steps=2)
