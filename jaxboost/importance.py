"""Feature importance: tree arrays -> one score per feature, as XGBoost's ``get_score`` reports it.

Host-side NumPy over the heap arrays of a trained model. Only split nodes that a row can reach
count (every node on a path from the root through split nodes); the kinds are XGBoost's:

  weight       number of splits on the feature
  gain         average ``loss_chg`` of those splits
  total_gain   summed ``loss_chg``
  cover        average Hessian sum (``sum_hessians``) of the split nodes
  total_cover  summed Hessian sum

Every tree of every output counts (a vector-leaf tree once). By default the rounds are those ``predict`` uses (up to
``best_iteration`` after early stopping); XGBoost's ``get_score`` counts every tree, which is
``iteration_range=(0, model.num_rounds)`` here.
"""

from __future__ import annotations

import numpy as np

from .tree import depth_of_heap

IMPORTANCE_KINDS = ("weight", "gain", "total_gain", "cover", "total_cover")


def reachable_nodes(is_leaf: np.ndarray) -> np.ndarray:
    """Bool mask, same shape as ``is_leaf`` (``(..., nodes)``): the heap slots a row can reach.

    The root is always reached; a child is reached when its parent is reached and is not a leaf.
    """
    is_leaf = np.asarray(is_leaf, dtype=bool)
    reachable = np.zeros(is_leaf.shape, dtype=bool)
    if is_leaf.shape[-1] == 0:
        return reachable
    reachable[..., 0] = True
    for depth in range(1, depth_of_heap(is_leaf.shape[-1]) + 1):
        level = np.arange(2 ** depth - 1, 2 ** (depth + 1) - 1)
        parents = (level - 1) // 2
        reachable[..., level] = reachable[..., parents] & ~is_leaf[..., parents]
    return reachable


def split_nodes(trees) -> np.ndarray:
    """Bool mask of the reachable split nodes of tree arrays shaped ``(..., nodes)``."""
    is_leaf = np.asarray(trees.is_leaf, dtype=bool)
    return reachable_nodes(is_leaf) & ~is_leaf


def _check_kind(kind: str) -> None:
    if kind not in IMPORTANCE_KINDS:
        raise ValueError(f"importance kind must be one of {IMPORTANCE_KINDS}; got {kind!r}")


def importance_from_trees(trees, n_features: int, kind: str = "gain") -> tuple[np.ndarray, np.ndarray]:
    """``(scores, used)``: float64 ``(n_features,)`` scores and the bool mask of features split on.

    Unused features score 0 in every kind.
    """
    _check_kind(kind)
    mask = split_nodes(trees)
    features = np.asarray(trees.feature)[mask].astype(np.int64)
    counts = np.bincount(features, minlength=n_features).astype(np.float64)
    if kind == "weight":
        totals = counts
    else:
        per_split = trees.loss_change if kind.endswith("gain") else trees.sum_hessians
        totals = np.bincount(features, weights=np.asarray(per_split, np.float64)[mask], minlength=n_features)
    used = counts > 0
    if kind in ("gain", "cover"):
        totals = np.divide(totals, counts, out=np.zeros(n_features), where=used)
    return totals, used


def _selected_trees(model, iteration_range):
    start, stop = model._rounds(iteration_range)
    trees = type(model.trees)(*(np.asarray(field)[start:stop] for field in model.trees))
    if model.params.get("multi_strategy") == "multi_output_tree":
        # The K trees of a round are one vector-leaf tree: count each split once, with the
        # Hessian trace as its cover.
        trees = trees._replace(sum_hessians=np.sum(trees.sum_hessians, axis=1, keepdims=True))
        trees = type(trees)(*(field[:, :1] for field in trees))
    return trees


def importance_array(model, kind: str = "gain", iteration_range: tuple[int, int] | None = None) -> np.ndarray:
    """Importance of every feature as a float64 array ``(n_features,)`` (0 for unused features).

    ``iteration_range`` as in ``Model.predict``: by default the rounds ``predict`` uses.
    """
    scores, _ = importance_from_trees(_selected_trees(model, iteration_range), model.n_features, kind)
    return scores


def feature_importance(model, kind: str = "gain", iteration_range: tuple[int, int] | None = None) -> dict:
    """``{feature name: score}`` for the features the trees split on, in feature order.

    Names are the training columns' names, or ``"f{index}"`` (XGBoost's default names).
    """
    scores, used = importance_from_trees(_selected_trees(model, iteration_range), model.n_features, kind)
    names = model.feature_names or tuple(f"f{index}" for index in range(model.n_features))
    return {names[index]: float(scores[index]) for index in np.flatnonzero(used)}
