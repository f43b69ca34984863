"""XGBoost export: XGBoost loads the JSON and predicts what jaxboost predicts, NaNs included."""

import dataclasses
import json
import warnings

import numpy as np
import pytest
import xgboost as xgb
from conftest import N_ROWS, TASKS, labels, make_data  # noqa: F401

from jaxboost.node_list import LARGEST_THRESHOLD, reached_nodes
from jaxboost.xgboost_export import to_xgboost_json

OBJECTIVES = {"squared_error": "reg:squarederror", "logistic": "binary:logistic", "softmax": "multi:softprob"}


def load_booster(model, tmp_path):
    path = tmp_path / "model.json"
    model.export_xgboost(path)
    booster = xgb.Booster()
    booster.load_model(str(path))
    return booster


@pytest.mark.parametrize("task", TASKS)
def test_margins_and_predictions_equal_jaxboost(task, models, data, tmp_path):
    X, _, _, X_test = data
    model = models[task]
    booster = load_booster(model, tmp_path)
    assert json.loads(booster.save_config())["learner"]["objective"]["name"] == OBJECTIVES[task]
    for rows in (X, X_test):
        margin = booster.predict(xgb.DMatrix(rows), output_margin=True)
        np.testing.assert_allclose(margin, model.predict_raw(rows), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(booster.predict(xgb.DMatrix(rows)), model.predict(rows), rtol=1e-5, atol=1e-6)


def test_split_on_padded_edge_sends_all_values_left(models, data):
    """The regression model splits on the NaN-or-1.0 feature: every non-missing value goes
    left, which the export writes as the largest float32."""
    model = models["squared_error"]
    trees = model.trees
    reached_splits = reached_nodes(trees.is_leaf) & ~trees.is_leaf
    n_edges = model.bin_edges.n_edges[trees.feature]
    padded = reached_splits & (trees.threshold_bin >= n_edges)
    assert padded.any()
    conditions = [c for tree in to_xgboost_json(model)["learner"]["gradient_booster"]["model"]["trees"]
                  for c, leaf in zip(tree["split_conditions"], tree["left_children"]) if leaf != -1]
    assert np.float32(LARGEST_THRESHOLD) in np.float32(conditions)


@pytest.mark.parametrize("task", TASKS)
def test_pred_leaf_reaches_the_same_leaves(task, models, data, tmp_path):
    X, _, _, _ = data
    model = models[task]
    booster = load_booster(model, tmp_path)
    xgb_leaves = booster.predict(xgb.DMatrix(X), pred_leaf=True).astype(np.int64)  # (n, rounds * K)
    heap_leaves = model.predict_leaf(X).reshape(N_ROWS, -1)  # (n, rounds) or (n, rounds, K) -> round-major
    reached = reached_nodes(np.asarray(model.trees.is_leaf)).reshape(-1, model.trees.is_leaf.shape[-1])
    # XGBoost numbers nodes breadth-first: a heap slot's id is its rank among reached slots.
    breadth_first_id = np.cumsum(reached, axis=1) - 1
    expected = breadth_first_id[np.arange(reached.shape[0])[None, :], heap_leaves]
    np.testing.assert_array_equal(xgb_leaves, expected)


@pytest.mark.parametrize("loss, link, objective, base_score", [
    ("poisson", "exp", "count:poisson", 0.7),
    ("gamma", "exp", "reg:gamma", -1.2),
    ("tweedie", "exp", "reg:tweedie", 0.3),
    ("pseudo_huber", "identity", "reg:pseudohubererror", 0.4),
    ("absolute_error", "identity", "reg:absoluteerror", -0.2),
    ("quantile", "identity", "reg:quantileerror", 1.1),
    ("hinge", "step", "binary:hinge", 0.25),
])
def test_other_builtin_objectives(loss, link, objective, base_score, models, data, tmp_path):
    """The export depends on the trees, the starting value, the loss name and its parameters:
    the regression trees stand in for a model trained with each loss."""
    from jaxboost.link import LINKS

    _, _, _, X_test = data
    loss_params = {"tweedie": {"power": 1.3}, "quantile": {"tau": 0.9}, "pseudo_huber": {"delta": 2.0}}.get(loss, {})
    regression = models["squared_error"]
    model = dataclasses.replace(regression, loss_name=loss, link=LINKS[link],
                                base_score=np.array([base_score], np.float32),
                                params={**regression.params, "loss": loss, "loss_params": loss_params})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a built-in with an XGBoost counterpart exports without a warning
        booster = load_booster(model, tmp_path)
    config = json.loads(booster.save_config())["learner"]["objective"]
    assert config["name"] == objective
    if loss == "tweedie":
        assert np.float32(config["tweedie_regression_param"]["tweedie_variance_power"]) == np.float32(1.3)
    if loss == "quantile":
        assert json.loads(config["quantile_loss_param"]["quantile_alpha"]) == [0.9]
    if loss == "pseudo_huber":
        assert float(config["pseudo_huber_param"]["huber_slope"]) == 2.0
    margin = booster.predict(xgb.DMatrix(X_test), output_margin=True)
    np.testing.assert_allclose(margin, model.predict_raw(X_test), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(booster.predict(xgb.DMatrix(X_test)), model.predict(X_test), rtol=1e-5, atol=1e-6)


def test_extreme_starting_margin_is_reproduced(models, data, tmp_path):
    """A logistic starting margin of 30 rounds to probability 1.0 in float32, which XGBoost
    rejects as base_score: the margin goes into the first round's leaves instead."""
    X, _, _, _ = data
    model = dataclasses.replace(models["logistic"], base_score=np.array([30.0], np.float32))
    booster = load_booster(model, tmp_path)
    np.testing.assert_allclose(booster.predict(xgb.DMatrix(X), output_margin=True), model.predict_raw(X),
                               rtol=1e-5, atol=1e-5)


def test_custom_vector_loss_warns_and_exports_margins(models, data, tmp_path):
    """A custom loss (the multiclass trees under a user function's name, three raw outputs)
    has no XGBoost objective: its margins are exported as multi-target squared error."""
    _, _, _, X_test = data
    model = dataclasses.replace(models["softmax"], loss_name="cross_entropy")
    with pytest.warns(UserWarning, match="reg:squarederror") as caught:
        booster = load_booster(model, tmp_path)
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not jaxboost's
    config = json.loads(booster.save_config())["learner"]
    assert config["objective"]["name"] == "reg:squarederror"
    assert config["learner_model_param"]["num_target"] == "3"
    margin = booster.predict(xgb.DMatrix(X_test), output_margin=True)
    np.testing.assert_allclose(margin, model.predict_raw(X_test), rtol=1e-5, atol=1e-6)


def test_best_iteration_is_kept(models, data, tmp_path):
    X, _, _, _ = data
    model = dataclasses.replace(models["softmax"], best_iteration=2)
    booster = load_booster(model, tmp_path)
    assert booster.best_iteration == 2
    assert booster.num_boosted_rounds() == model.num_rounds  # every round is written
    margin = booster.predict(xgb.DMatrix(X), output_margin=True, iteration_range=(0, 3))
    np.testing.assert_allclose(margin, model.predict_raw(X), rtol=1e-5, atol=1e-6)


def test_rejects_non_json_path(models, tmp_path):
    with pytest.raises(ValueError, match=".json"):
        models["squared_error"].export_xgboost(tmp_path / "model.ubj")
