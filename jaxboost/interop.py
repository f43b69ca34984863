"""Interop: a trained ``Model`` in other libraries' in-memory formats (shap; XGBoost boosters).

``to_shap(model)`` gives shap's own tree-ensemble dict, which ``shap.TreeExplainer`` takes as
its model: per tree, breadth-first node arrays (``node_list``) with shap's ``x <= threshold``
test. jaxboost's rule is ``x < edge`` on float32 values, so the threshold handed to shap is the
float32 just below the edge, and the explainer is told to read ``X`` as float32: both rules then
send every row the same way. The explainer's raw output (``model_output="raw"``) is jaxboost's
raw prediction and its SHAP values equal ``Model.predict_contributions``.

``to_xgboost_booster(model)`` loads the XGBoost export (``xgboost_export``) into an
``xgboost.Booster``, which ``shap.TreeExplainer`` accepts as well.
"""

from __future__ import annotations

import json

import numpy as np

from .node_list import model_node_lists


def to_shap(model, *, iteration_range: tuple[int, int] | None = None) -> dict:
    """The model as shap's tree-ensemble dict: ``shap.TreeExplainer(jb.to_shap(model))``.

    Uses the rounds ``predict_raw`` uses (up to ``best_iteration`` after early stopping)
    unless ``iteration_range`` says otherwise. Values are raw margins; ``base_offset`` is the
    starting value of each output.
    """
    start, stop = model._rounds(iteration_range)
    K = model.num_outputs
    trees = []
    for round_trees in model_node_lists(model, (start, stop)):
        for output, nodes in enumerate(round_trees):
            leaf = nodes.is_leaf
            values = np.zeros((nodes.num_nodes, K), np.float64)
            values[:, output] = nodes.value
            below_edge = np.nextafter(nodes.threshold, np.float32(-np.inf)).astype(np.float32)
            trees.append({
                "children_left": nodes.left_child.astype(np.int32),
                "children_right": nodes.right_child.astype(np.int32),
                "children_default": np.where(leaf, -1, np.where(nodes.default_left, nodes.left_child,
                                                                 nodes.right_child)).astype(np.int32),
                "features": nodes.feature.astype(np.int32),
                "thresholds": np.where(leaf, 0.0, below_edge.astype(np.float64)),
                "values": values,
                "node_sample_weight": nodes.sum_hessians.astype(np.float64),
            })
    if not trees:
        raise ValueError("the model has no trees in the chosen rounds")
    return {
        "trees": trees,
        "base_offset": np.asarray(model.base_score, np.float64).reshape(-1),
        "tree_output": "raw_value",
        "input_dtype": np.float32,
        "internal_dtype": np.float64,
    }


def to_xgboost_booster(model):
    """The model as an ``xgboost.Booster`` (all rounds), through the XGBoost JSON export."""
    try:
        import xgboost
    except ImportError as error:
        raise ImportError("to_xgboost_booster needs the xgboost package: pip install xgboost") from error
    from .xgboost_export import to_xgboost_json

    booster = xgboost.Booster()
    booster.load_model(bytearray(json.dumps(to_xgboost_json(model), allow_nan=False).encode("utf-8")))
    return booster
