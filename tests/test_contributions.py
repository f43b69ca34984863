"""TreeSHAP contributions: against brute-force Shapley values, XGBoost's pred_contribs and shap."""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest
import shap
import xgboost as xgb
from conftest import N_ROWS, TASKS, labels, make_data  # noqa: F401

from jaxboost.interop import to_shap, to_xgboost_booster


def first_rounds(model, count):
    return dataclasses.replace(model, trees=type(model.trees)(*(np.asarray(a)[:count] for a in model.trees)))


def conditional_expectation(tree, edges, x, known):
    """E[tree(x) | the features in ``known``]: follow x at splits on known features, average the
    children by cover elsewhere (recursion over the heap, raw thresholds x < edge)."""

    def expect(node):
        if tree["is_leaf"][node]:
            return float(tree["value"][node])
        feature = int(tree["feature"][node])
        left, right = 2 * node + 1, 2 * node + 2
        if feature in known:
            value = x[feature]
            if np.isnan(value):
                goes_left = bool(tree["default_left"][node])
            else:
                goes_left = bool(value < edges[feature, tree["threshold_bin"][node]])
            return expect(left if goes_left else right)
        cover = tree["sum_hessians"]
        return (cover[left] * expect(left) + cover[right] * expect(right)) / float(cover[node])

    return expect(0)


def brute_force_shapley(model, X, output=0):
    """Exact Shapley values of the raw prediction over all feature subsets, float64."""
    n_features = model.n_features
    edges = np.asarray(model.bin_edges.edges, np.float64)
    phi = np.zeros((X.shape[0], n_features + 1))
    for round_index in range(model.num_rounds):
        tree = {name: np.asarray(field)[round_index, output] for name, field in model.trees._asdict().items()}
        for row, x in enumerate(X):
            values = {subset: conditional_expectation(tree, edges, x, set(subset))
                      for size in range(n_features + 1) for subset in itertools.combinations(range(n_features), size)}
            for feature in range(n_features):
                others = [f for f in range(n_features) if f != feature]
                for size in range(n_features):
                    weight = math.factorial(size) * math.factorial(n_features - size - 1) / math.factorial(n_features)
                    for subset in itertools.combinations(others, size):
                        with_feature = tuple(sorted(subset + (feature,)))
                        phi[row, feature] += weight * (values[with_feature] - values[subset])
            phi[row, -1] += values[()]
    phi[:, -1] += float(model.base_score[output])
    return phi


def test_equals_brute_force_shapley_values(models, data):
    X, _, _, X_test = data
    model = models["squared_error"]
    trees = model.trees
    # Some path repeats a feature, so merging repeated features is exercised.
    assert any(len(set(path)) < len(path) for path in _split_feature_paths(trees))
    rows = np.concatenate([X[:15], X_test[:15]])
    expected = brute_force_shapley(model, rows)
    np.testing.assert_allclose(model.predict_contributions(rows), expected, rtol=0, atol=1e-5)


def test_multiclass_equals_brute_force_for_each_class(models, data):
    X, _, _, _ = data
    model = first_rounds(models["softmax"], 2)
    rows = X[:10]
    contributions = model.predict_contributions(rows)
    for output in range(model.num_outputs):
        np.testing.assert_allclose(contributions[:, output], brute_force_shapley(model, rows, output),
                                   rtol=0, atol=1e-5)


def _split_feature_paths(trees):
    """Feature sequences of every root-to-leaf path of every tree."""
    paths = []
    is_leaf, feature = np.asarray(trees.is_leaf), np.asarray(trees.feature)
    for round_index, output in itertools.product(range(is_leaf.shape[0]), range(is_leaf.shape[1])):
        stack = [(0, ())]
        while stack:
            node, path = stack.pop()
            if is_leaf[round_index, output, node]:
                paths.append(path)
            else:
                step = path + (int(feature[round_index, output, node]),)
                stack += [(2 * node + 1, step), (2 * node + 2, step)]
    return paths


@pytest.mark.parametrize("task", TASKS)
def test_equals_xgboost_pred_contribs_and_adds_up(task, models, data):
    X, _, _, X_test = data
    model = models[task]
    booster = to_xgboost_booster(model)
    for rows in (X, X_test):
        contributions = model.predict_contributions(rows)
        shape = (rows.shape[0], model.n_features + 1) if task != "softmax" else (rows.shape[0], 3, model.n_features + 1)
        assert contributions.shape == shape
        np.testing.assert_allclose(contributions, booster.predict(xgb.DMatrix(rows), pred_contribs=True),
                                   rtol=0, atol=1e-4)
        np.testing.assert_allclose(contributions.sum(axis=-1), model.predict_raw(rows), rtol=0, atol=1e-4)


def test_iteration_range_and_base_margin(models, data):
    X, _, _, _ = data
    model = models["softmax"]
    margin = np.random.default_rng(5).normal(size=(N_ROWS, 3)).astype(np.float32)
    contributions = model.predict_contributions(X, iteration_range=(2, 5), base_margin=margin)
    raw = model.predict_raw(X, iteration_range=(2, 5), base_margin=margin)
    np.testing.assert_allclose(contributions.sum(axis=-1), raw, rtol=0, atol=1e-4)
    without = model.predict_contributions(X, iteration_range=(2, 5))
    np.testing.assert_allclose(contributions[..., :-1], without[..., :-1], rtol=0, atol=0)


def test_default_rounds_follow_best_iteration(models, data):
    X, _, _, _ = data
    model = dataclasses.replace(models["logistic"], best_iteration=2)
    first_three = first_rounds(models["logistic"], 3)
    np.testing.assert_allclose(model.predict_contributions(X), first_three.predict_contributions(X), rtol=0, atol=0)


def test_zero_cover_is_an_error(models, data):
    X, _, _, _ = data
    model = models["squared_error"]
    zero_cover = dataclasses.replace(
        model, trees=model.trees._replace(sum_hessians=np.zeros_like(model.trees.sum_hessians)))
    with pytest.raises(ValueError, match="cover"):
        zero_cover.predict_contributions(X[:5])


@pytest.mark.parametrize("task", TASKS)
def test_shap_tree_explainer_takes_the_model(task, models, data):
    _, _, _, X_test = data
    model = models[task]
    rows = X_test[:200]
    contributions = model.predict_contributions(rows)
    explainer = shap.TreeExplainer(to_shap(model))
    values = np.asarray(explainer.shap_values(rows))
    expected_value = np.asarray(explainer.expected_value).reshape(-1)
    if task == "softmax":
        values = np.moveaxis(values, -1, 1)  # shap: (n, features, classes) -> (n, classes, features)
    np.testing.assert_allclose(values, contributions[..., :-1], rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.broadcast_to(expected_value, contributions[:, ..., -1].shape),
                               contributions[..., -1], rtol=0, atol=1e-4)
    total = values.sum(axis=-1) + expected_value
    np.testing.assert_allclose(total.reshape(model.predict_raw(rows).shape), model.predict_raw(rows), rtol=0, atol=1e-4)
    booster_values = np.asarray(shap.TreeExplainer(to_xgboost_booster(model)).shap_values(rows))
    if task == "softmax":
        booster_values = np.moveaxis(booster_values, -1, 1)
    np.testing.assert_allclose(booster_values, contributions[..., :-1], rtol=0, atol=1e-4)


def _dot_precisions(jaxpr) -> list:
    """The ``precision`` of every matrix product in a jaxpr, nested ones (jit, scan, map) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found.extend(_dot_precisions(inner))
    return found


def test_matrix_products_ask_for_full_float32_precision(models, data):
    """A GPU's float32 matrix products default to TF32 (10-bit mantissas): SHAP values summed to
    2e-4 off the raw predictions they explain, on an H200. The products of the contributions and
    of the soft (differentiable) prediction ask for full precision on every backend."""
    from jaxboost import contributions, differentiable

    model, X = models["softmax"], data[0][:8]
    tables = contributions.path_tables(model.trees)
    positions = tables.feature.shape[-1]
    X_binned = model._binned(X)
    shap = jax.make_jaxpr(lambda rows: contributions.contributions_binned(
        tables, rows, contributions.shapley_weights(positions), missing_bin=model.bin_edges.missing_bin,
        n_features=model.n_features, chunk_rows=8))(X_binned)
    soft = jax.make_jaxpr(lambda rows: differentiable.soft_predict_raw(model, rows, 0.1))(X)
    for name, jaxpr in [("contributions", shap), ("soft prediction", soft)]:
        precisions = _dot_precisions(jaxpr.jaxpr)
        assert precisions, f"{name}: no matrix product traced"
        highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
        assert all(p == highest for p in precisions), f"{name}: {precisions}"
