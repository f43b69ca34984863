"""XGBoost export: a trained ``Model`` -> XGBoost's JSON model format (``Booster.load_model``).

Each jaxboost tree becomes one XGBoost tree (``tree_info`` gives its output), with the node
list of ``node_list``: split conditions are raw bin edges (XGBoost also sends ``x <
split_condition`` left), missing values follow ``default_left``, and ``sum_hessian`` carries
the cover, so XGBoost's ``pred_contribs`` and ``pred_leaf`` work on the exported model.

The starting value: XGBoost stores ``base_score`` in the objective's output space (a
probability for ``binary:logistic``, a mean for log-link objectives) and turns it back into a
margin when it loads the model. jaxboost's starting margin is converted the same way, and
whatever that float32 round trip loses (or the whole margin, when the converted value is not a
valid ``base_score``, and every output's margin for multi-output models) is added to the
leaves of the first round's trees, so that ``predict(output_margin=True)`` reproduces
``predict_raw`` for every row. All rounds are written; ``best_iteration`` is kept as XGBoost's
attribute of the same name (XGBoost's scikit-learn wrapper predicts with it; with a
``Booster`` pass ``iteration_range=(0, best_iteration + 1)``).

Losses with an XGBoost counterpart keep its objective name; any other loss is written as
``reg:squarederror`` on the raw margins (with a warning): ``predict(output_margin=True)`` then
equals ``predict_raw``, and the link is not applied by XGBoost.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .node_list import NodeList, link_name, model_node_lists
from .validation import warn_caller

# Written into the file as the format version; the layout below is the one XGBoost 2.x and
# 3.x read (scalar base_score, one tree per output and round).
FORMAT_VERSION = [2, 1, 0]
# XGBoost marks the root's parent with the largest int32.
ROOT_PARENT = 2147483647


def _logit(probability: float) -> float:
    return math.log(probability / (1.0 - probability))


def _sigmoid(margin: float) -> float:
    return 1.0 / (1.0 + math.exp(-margin)) if margin >= 0 else math.exp(margin) / (1.0 + math.exp(margin))


def _identity(value: float) -> float:
    return value


def _safe_exp(margin: float) -> float:
    return math.exp(min(margin, 700.0))


class BaseScoreSpace(NamedTuple):
    """How XGBoost turns a stored ``base_score`` into a margin (``to_margin``) and back."""

    to_margin: Callable[[float], float]
    from_margin: Callable[[float], float]
    is_valid: Callable[[float], bool]


IDENTITY_SPACE = BaseScoreSpace(_identity, _identity, math.isfinite)
LOGIT_SPACE = BaseScoreSpace(_logit, _sigmoid, lambda value: 0.0 < value < 1.0)
LOG_SPACE = BaseScoreSpace(math.log, _safe_exp, lambda value: 0.0 < value < math.inf)


class XGBoostObjective(NamedTuple):
    """An XGBoost objective: its JSON entry and the space its ``base_score`` lives in."""

    entry: dict
    space: BaseScoreSpace
    exact: bool  # False: a stand-in for a loss XGBoost does not have (margins only)


def _loss_parameter(model, name: str, default_from: Callable) -> float:
    """A loss parameter as trained (``model.params["loss_params"]``), else the loss's default."""
    stored = (model.params or {}).get("loss_params", {}) or {}
    if name in stored:
        return float(np.asarray(stored[name]).reshape(-1)[0])
    return float(inspect.signature(default_from).parameters[name].default)


def _builtin_objective(model) -> XGBoostObjective | None:
    """The XGBoost objective equal to the model's built-in loss and link, if there is one."""
    from . import losses

    record = losses.BUILTINS.get(model.loss_name)
    if record is None or link_name(model) != record.link:
        return None
    function = record.function
    scale = {"scale_pos_weight": "1"}
    if record.name == "squared_error":
        return XGBoostObjective({"name": "reg:squarederror", "reg_loss_param": scale}, IDENTITY_SPACE, True)
    if record.name == "absolute_error":
        return XGBoostObjective({"name": "reg:absoluteerror"}, IDENTITY_SPACE, True)
    if record.name == "pseudo_huber":
        delta = _loss_parameter(model, "delta", function)
        return XGBoostObjective({"name": "reg:pseudohubererror", "pseudo_huber_param": {"huber_slope": repr(delta)}},
                                IDENTITY_SPACE, True)
    if record.name == "quantile":
        tau = _loss_parameter(model, "tau", function)
        return XGBoostObjective({"name": "reg:quantileerror", "quantile_loss_param": {"quantile_alpha": f"[{tau!r}]"}},
                                IDENTITY_SPACE, True)
    if record.name == "logistic":
        return XGBoostObjective({"name": "binary:logistic", "reg_loss_param": scale}, LOGIT_SPACE, True)
    if record.name == "softmax":
        return XGBoostObjective({"name": "multi:softprob",
                                 "softmax_multiclass_param": {"num_class": str(model.num_outputs)}},
                                IDENTITY_SPACE, True)
    if record.name == "poisson":
        delta_step = float((model.params or {}).get("max_delta_step", 0.0) or 0.0)
        return XGBoostObjective({"name": "count:poisson",
                                 "poisson_regression_param": {"max_delta_step": repr(delta_step)}},
                                LOG_SPACE, True)
    if record.name == "gamma":
        return XGBoostObjective({"name": "reg:gamma", "reg_loss_param": scale}, LOG_SPACE, True)
    if record.name == "tweedie":
        power = _loss_parameter(model, "power", function)
        return XGBoostObjective({"name": "reg:tweedie",
                                 "tweedie_regression_param": {"tweedie_variance_power": repr(power)}},
                                LOG_SPACE, True)
    if record.name == "hinge":
        return XGBoostObjective({"name": "binary:hinge"}, IDENTITY_SPACE, True)
    return None


def xgboost_objective(model) -> XGBoostObjective:
    """The objective written for ``model``: its XGBoost counterpart, or ``reg:squarederror``
    on raw margins (``exact=False``) for losses and links XGBoost does not have."""
    objective = _builtin_objective(model)
    if objective is not None:
        return objective
    return XGBoostObjective({"name": "reg:squarederror", "reg_loss_param": {"scale_pos_weight": "1"}},
                            IDENTITY_SPACE, False)


def stored_base_score(margin: float, space: BaseScoreSpace) -> tuple[np.float32, float]:
    """The float32 ``base_score`` XGBoost should store for a starting ``margin``, and the margin
    it leaves out (to be added to the first round's leaves).

    The result reproduces ``margin`` up to float32 rounding whatever the margin: when the
    converted value is not a valid ``base_score`` (a probability rounded to 0 or 1), the
    neutral value (margin 0) is stored and the whole margin is left to the leaves.
    """
    with np.errstate(over="ignore"):
        stored = np.float32(space.from_margin(float(margin)))
    if not space.is_valid(float(stored)):
        stored = np.float32(space.from_margin(0.0))
    return stored, float(margin) - space.to_margin(float(stored))


def _number(value) -> float:
    """A float32 as the shortest decimal that reads back as the same float32."""
    return float(np.float32(value))


def _tree_entry(nodes: NodeList, tree_id: int, n_features: int, leaf_shift: float) -> dict:
    """One tree in XGBoost's JSON layout; ``leaf_shift`` is added to every node value."""
    values = (nodes.value.astype(np.float64) + leaf_shift).astype(np.float32) if leaf_shift else nodes.value
    conditions = np.where(nodes.is_leaf, values, nodes.threshold)
    count = nodes.num_nodes
    return {
        "base_weights": [_number(v) for v in values],
        "categories": [],
        "categories_nodes": [],
        "categories_segments": [],
        "categories_sizes": [],
        "default_left": [int(flag) for flag in nodes.default_left],
        "id": tree_id,
        "left_children": [int(child) for child in nodes.left_child],
        "loss_changes": [_number(v) for v in nodes.loss_change],
        "parents": [int(parent) if parent >= 0 else ROOT_PARENT for parent in nodes.parent],
        "right_children": [int(child) for child in nodes.right_child],
        "split_conditions": [_number(v) for v in conditions],
        "split_indices": [int(max(feature, 0)) for feature in nodes.feature],
        "split_type": [0] * count,
        "sum_hessian": [_number(v) for v in nodes.sum_hessians],
        "tree_param": {"num_deleted": "0", "num_feature": str(n_features), "num_nodes": str(count),
                       "size_leaf_vector": "1"},
    }


def to_xgboost_json(model, *, warn: bool = True) -> dict:
    """The model as a dict in XGBoost's JSON model format (``json.dump`` it to a ``.json`` file).

    All rounds are included. A loss without an XGBoost counterpart is written as
    ``reg:squarederror`` on raw margins, with a ``UserWarning`` unless ``warn=False``.
    """
    if model.num_rounds == 0:
        raise ValueError("the model has no trees to export (num_rounds == 0)")
    objective = xgboost_objective(model)
    if not objective.exact and warn:
        warn_caller(f"loss {model.loss_name!r} (link {link_name(model) or 'custom'}) has no XGBoost objective: "
                    "exported as 'reg:squarederror' on raw margins; XGBoost's predict(output_margin=True) "
                    "equals predict_raw, and its plain predict does not apply the link")
    K = model.num_outputs
    base_margin = np.asarray(model.base_score, np.float64).reshape(-1)
    if K == 1:
        stored, leftover = stored_base_score(base_margin[0], objective.space)
        leaf_shifts = [leftover]
    else:
        # One scalar base_score serves every output in XGBoost 2.x; each output's starting
        # margin goes into its first tree instead.
        stored = np.float32(objective.space.from_margin(0.0))
        leaf_shifts = list(base_margin - objective.space.to_margin(float(stored)))
    node_lists = model_node_lists(model)
    trees, tree_info = [], []
    for round_index, round_trees in enumerate(node_lists):
        for output, nodes in enumerate(round_trees):
            shift = leaf_shifts[output] if round_index == 0 else 0.0
            trees.append(_tree_entry(nodes, len(trees), model.n_features, shift))
            tree_info.append(output)
    multiclass = objective.entry["name"] == "multi:softprob"
    learner = {
        "attributes": {} if model.best_iteration is None else {"best_iteration": str(int(model.best_iteration))},
        "feature_names": list(model.feature_names) if model.feature_names else [],
        "feature_types": ["float"] * model.n_features if model.feature_names else [],
        "gradient_booster": {
            "model": {
                "gbtree_model_param": {"num_parallel_tree": "1", "num_trees": str(len(trees))},
                "iteration_indptr": [K * r for r in range(model.num_rounds + 1)],
                "tree_info": tree_info,
                "trees": trees,
            },
            "name": "gbtree",
        },
        "learner_model_param": {
            "base_score": repr(float(stored)),
            "boost_from_average": "0",
            "num_class": str(K) if multiclass else "0",
            "num_feature": str(model.n_features),
            "num_target": "1" if multiclass else str(K),
        },
        "objective": objective.entry,
    }
    return {"learner": learner, "version": list(FORMAT_VERSION)}


def export_xgboost(model, path) -> None:
    """Write ``model`` to ``path`` in XGBoost's JSON format (load with ``Booster().load_model``).

    ``booster.predict(DMatrix(X), output_margin=True)`` then equals ``model.predict_raw(X)``
    over all rounds (pass ``iteration_range=(0, model.best_iteration + 1)`` after early stopping).
    """
    path = os.fspath(path)
    if not path.endswith(".json"):
        raise ValueError(f"XGBoost reads this format from files ending in '.json'; got {path!r}")
    document = to_xgboost_json(model)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, allow_nan=False)
