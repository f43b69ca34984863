"""treelite export: GTIL predicts what jaxboost predicts, NaNs included."""

import dataclasses

import numpy as np
import pytest
import treelite
import treelite.gtil
from conftest import N_ROWS, TASKS, labels, make_data  # noqa: F401

from jaxboost.link import LINKS


@pytest.mark.parametrize("task", TASKS)
def test_gtil_margins_and_predictions_equal_jaxboost(task, models, data):
    X, _, _, X_test = data
    model = models[task]
    tl_model = model.export_treelite()
    assert isinstance(tl_model, treelite.Model)
    assert tl_model.num_tree == model.num_rounds * model.num_outputs
    for rows in (X, X_test):
        raw = model.predict_raw(rows)
        margin = treelite.gtil.predict(tl_model, rows, pred_margin=True).reshape(raw.shape)
        np.testing.assert_allclose(margin, raw, rtol=1e-5, atol=1e-6)
        prediction = treelite.gtil.predict(tl_model, rows).reshape(raw.shape)
        np.testing.assert_allclose(prediction, model.predict(rows), rtol=1e-5, atol=1e-6)


def test_gtil_leaves_match_predict_leaf(models, data):
    """GTIL numbers nodes breadth-first, as the export does."""
    X, _, _, _ = data
    model = models["softmax"]
    leaves = treelite.gtil.predict_leaf(model.export_treelite(), X)  # (n, trees), round-major
    heap_leaves = model.predict_leaf(X).reshape(N_ROWS, -1)
    is_leaf = np.asarray(model.trees.is_leaf).reshape(-1, model.trees.is_leaf.shape[-1])
    reached = np.zeros_like(is_leaf)
    reached[:, 0] = True
    for node in range(1, is_leaf.shape[1]):
        parent = (node - 1) // 2
        reached[:, node] = reached[:, parent] & ~is_leaf[:, parent]
    breadth_first_id = np.cumsum(reached, axis=1) - 1
    np.testing.assert_array_equal(leaves, breadth_first_id[np.arange(is_leaf.shape[0])[None, :], heap_leaves])


@pytest.mark.parametrize("link", ["exp", "sigmoid_2x"])
def test_log_link_and_scaled_sigmoid_postprocessors(link, models, data):
    """The regression trees under an exp link (count losses) and the exponential loss's
    sigmoid(2x): treelite applies the same link."""
    _, _, _, X_test = data
    model = dataclasses.replace(models["squared_error"], link=LINKS[link])
    tl_model = model.export_treelite()
    raw = model.predict_raw(X_test)
    np.testing.assert_allclose(treelite.gtil.predict(tl_model, X_test, pred_margin=True).reshape(raw.shape), raw,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(treelite.gtil.predict(tl_model, X_test).reshape(raw.shape), model.predict(X_test),
                               rtol=1e-5, atol=1e-6)


def test_custom_link_warns_and_exports_margins(models, data):
    _, _, _, X_test = data
    model = dataclasses.replace(models["squared_error"], link=lambda raw: raw ** 3, loss_name="cubed")
    with pytest.warns(UserWarning, match="identity"):
        tl_model = model.export_treelite()
    raw = model.predict_raw(X_test)
    np.testing.assert_allclose(treelite.gtil.predict(tl_model, X_test).reshape(raw.shape), raw, rtol=1e-5, atol=1e-6)
