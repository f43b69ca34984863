"""Feature importance against XGBoost's ``get_score`` on data where both libraries grow the same
trees, and against a recursive walk of the tree arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import xgboost as xgb

import jaxboost as jb
from jaxboost.importance import IMPORTANCE_KINDS, importance_array

LEARNING_RATE, DEPTH = 0.3, 3


def _pre_binned(seed=0, n=3000, n_features=6, levels=8, missing_fraction=0.05):
    """Integer-valued features with few levels: both libraries give every value its own bin."""
    rng = np.random.default_rng(seed)
    X = rng.integers(0, levels, size=(n, n_features)).astype(np.float32)
    X[rng.random(X.shape) < missing_fraction] = np.nan
    filled = np.nan_to_num(X, nan=levels / 2)
    signal = np.sin(filled[:, 0]) + 0.3 * filled[:, 1] - 0.2 * filled[:, 2] * (filled[:, 3] > 4)
    signal += np.where(np.isnan(X[:, 4]), 1.5, 0.0)
    return X, signal, rng


@pytest.fixture(scope="module", params=[("squared_error", "reg:squarederror"), ("logistic", "binary:logistic")],
                ids=["squared_error", "logistic"])
def pair(request):
    """(loss, X, y, margin, objective): the same data and zero starting margin for both libraries."""
    loss, objective = request.param
    X, signal, rng = _pre_binned()
    if loss == "squared_error":
        y = signal + rng.normal(scale=0.5, size=len(signal))
    else:
        y = (rng.random(len(signal)) < 1 / (1 + np.exp(-(signal - signal.mean())))).astype(np.float32)
    return loss, X, y, np.zeros(len(y), np.float32), objective


def _both(pair, num_rounds):
    loss, X, y, margin, objective = pair
    model = jb.train(X, y, loss=loss, num_rounds=num_rounds, max_depth=DEPTH, learning_rate=LEARNING_RATE,
                     reg_lambda=1.0, base_margin=margin)
    booster = xgb.train(dict(tree_method="hist", objective=objective, max_depth=DEPTH, eta=LEARNING_RATE,
                             reg_lambda=1.0, alpha=0.0, gamma=0.0, min_child_weight=1.0, max_bin=256, nthread=1),
                        xgb.DMatrix(X, y, base_margin=margin), num_boost_round=num_rounds)
    # Same trees is the premise of comparing importances: the raw predictions must agree.
    np.testing.assert_allclose(model.predict_raw(X, base_margin=margin),
                               booster.predict(xgb.DMatrix(X, base_margin=margin), output_margin=True),
                               rtol=1e-5, atol=1e-5)
    return model, booster


@pytest.mark.parametrize("num_rounds", [1, 5])
def test_importance_matches_xgboost(pair, num_rounds):
    model, booster = _both(pair, num_rounds)
    for kind in IMPORTANCE_KINDS:
        ours, theirs = model.feature_importance(kind), booster.get_score(importance_type=kind)
        assert ours.keys() == theirs.keys(), kind
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-4), (kind, name)


def _walk_reference(trees, n_features):
    """Count, gain sum and cover sum per feature by walking every tree from its root."""
    count, gain, cover = np.zeros(n_features), np.zeros(n_features), np.zeros(n_features)
    rounds, outputs, _ = trees.feature.shape

    def visit(r, k, node):
        if trees.is_leaf[r, k, node]:
            return
        feature = trees.feature[r, k, node]
        count[feature] += 1
        gain[feature] += float(trees.loss_change[r, k, node])
        cover[feature] += float(trees.sum_hessians[r, k, node])
        visit(r, k, 2 * node + 1)
        visit(r, k, 2 * node + 2)

    for r in range(rounds):
        for k in range(outputs):
            visit(r, k, 0)
    return count, gain, cover


def test_importance_matches_a_walk_of_the_trees(pair):
    model, _ = _both(pair, 5)
    count, gain, cover = _walk_reference(model.trees, model.n_features)
    used = count > 0
    average = lambda total: np.divide(total, count, out=np.zeros_like(total), where=used)  # noqa: E731
    expected = {"weight": count, "total_gain": gain, "gain": average(gain), "total_cover": cover,
                "cover": average(cover)}
    for kind, values in expected.items():
        np.testing.assert_allclose(importance_array(model, kind), values, rtol=1e-6, err_msg=kind)
        assert list(model.feature_importance(kind)) == [f"f{i}" for i in np.flatnonzero(used)]


def test_importance_counts_the_rounds_predict_uses(pair):
    model, _ = _both(pair, 5)
    for kind in IMPORTANCE_KINDS:
        assert model.feature_importance(kind, iteration_range=(1, 3)) == model[1:3].feature_importance(kind)
        early_stopped = dataclasses.replace(model, best_iteration=1)
        assert early_stopped.feature_importance(kind) == model[:2].feature_importance(kind)
        assert early_stopped.feature_importance(kind, iteration_range=(0, 5)) == model.feature_importance(kind)
    assert model[:2].feature_importance("weight") != model.feature_importance("weight")


def test_importance_uses_feature_names_and_checks_kind(pair):
    model, _ = _both(pair, 1)
    names = tuple(f"column_{i}" for i in range(model.n_features))
    named = dataclasses.replace(model, feature_names=names)
    plain = model.feature_importance("total_gain")
    assert named.feature_importance("total_gain") == {f"column_{name[1:]}": value for name, value in plain.items()}
    with pytest.raises(ValueError, match="importance kind"):
        model.feature_importance("split")
    assert model[0:0].feature_importance("gain") == {}
    np.testing.assert_array_equal(importance_array(model[0:0], "gain"), np.zeros(model.n_features))
