"""Plots drawn with the Agg backend: the bars, lines and boxes hold the model's numbers."""

from __future__ import annotations

import dataclasses
import sys

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import jaxboost as jb  # noqa: E402
from jaxboost import plotting  # noqa: E402
from jaxboost.importance import reachable_nodes  # noqa: E402

N_FEATURES = 6


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, N_FEATURES)).astype(np.float32)
    X[rng.random(X.shape) < 0.1] = np.nan
    filled = np.nan_to_num(X)
    y = 2 * filled[:, 0] - filled[:, 1] + 0.5 * filled[:, 2] * filled[:, 3] + rng.normal(scale=1.0, size=600)
    trained = jb.train(X[:400], y[:400], num_rounds=40, max_depth=3, learning_rate=0.5,
                       eval_set=[(X[:400], y[:400]), (X[400:], y[400:])], eval_metric=["mae", "rmse"],
                       early_stopping_rounds=5)
    assert trained.best_iteration is not None
    return trained


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("kind, max_features", [("gain", 3), ("weight", None), ("total_cover", 100)])
def test_plot_importance_draws_one_bar_per_feature(model, kind, max_features):
    scores = model.feature_importance(kind)
    ax = plotting.plot_importance(model, kind=kind, max_features=max_features)
    expected = sorted(scores.items(), key=lambda item: item[1], reverse=True)[:max_features]
    bars = ax.patches
    assert len(bars) == min(len(scores), max_features or len(scores))
    # Bottom to top: least to most important of those drawn.
    np.testing.assert_allclose([bar.get_width() for bar in bars], [value for _, value in reversed(expected)])
    assert [label.get_text() for label in ax.get_yticklabels()] == [name for name, _ in reversed(expected)]
    value_labels = [text.get_text() for text in ax.texts]
    assert value_labels == [f"{value:.4g}" for _, value in reversed(expected)]
    assert kind in ax.get_xlabel()


def test_plot_importance_on_given_axes_and_bad_input(model):
    _, ax = plt.subplots()
    assert plotting.plot_importance(model, ax=ax, show_values=False) is ax
    assert len(ax.texts) == 0
    with pytest.raises(ValueError, match="max_features"):
        plotting.plot_importance(model, max_features=0)
    with pytest.raises(ValueError, match="no splits"):
        plotting.plot_importance(model[0:0])


def test_plot_metric_draws_the_history(model):
    ax = plotting.plot_metric(model, metric="rmse")
    lines = ax.get_lines()
    assert len(lines) == 3  # two eval sets and the best iteration
    for line, name in zip(lines, ["validation_0", "validation_1"]):
        np.testing.assert_allclose(line.get_ydata(), model.evals_result[name]["rmse"])
        np.testing.assert_array_equal(line.get_xdata(), np.arange(model.num_rounds))
        assert line.get_label() == name
    np.testing.assert_array_equal(lines[2].get_xdata(), [model.best_iteration] * 2)
    assert ax.get_ylabel() == "rmse"

    ax = plotting.plot_metric(model.evals_result, eval_names=["validation_1"])
    (line,) = ax.get_lines()  # the first recorded metric; a bare history has no best iteration
    np.testing.assert_allclose(line.get_ydata(), model.evals_result["validation_1"]["mae"])
    with pytest.raises(ValueError, match="auc"):
        plotting.plot_metric(model, metric="auc")
    with pytest.raises(ValueError, match="eval_set"):
        plotting.plot_metric({})


def _boxes(ax):
    return [text.get_text() for text in ax.texts if text.get_bbox_patch() is not None]


@pytest.mark.parametrize("round_index", [0, 2, -1])
def test_plot_tree_draws_every_node(model, round_index):
    trees = {name: np.asarray(getattr(model.trees, name))[round_index, 0] for name in model.trees._fields}
    reachable = reachable_nodes(trees["is_leaf"])
    splits = np.flatnonzero(reachable & ~trees["is_leaf"])
    leaves = np.flatnonzero(reachable & trees["is_leaf"])
    assert len(splits) > 0
    ax = plotting.plot_tree(model, round=round_index)
    boxes = _boxes(ax)
    assert len(boxes) == len(splits) + len(leaves)
    edges = model.bin_edges.edges
    features = trees["feature"][splits]
    thresholds = edges[features, trees["threshold_bin"][splits]]
    expected_splits = sorted(f"f{feature} < {float(edge):.4g}" for feature, edge in zip(features, thresholds))
    assert sorted(box for box in boxes if not box.startswith("leaf")) == expected_splits
    assert sorted(box for box in boxes if box.startswith("leaf")) == sorted(f"leaf {trees['value'][node]:.4g}"
                                                                            for node in leaves)
    branches = [text.get_text() for text in ax.texts if text.get_bbox_patch() is None]
    assert len(branches) == 2 * len(splits)
    assert branches.count("yes, missing") == int(trees["default_left"][splits].sum())
    assert branches.count("no, missing") == int((~trees["default_left"][splits]).sum())
    assert len(ax.get_lines()) == 2 * len(splits)


def test_plot_tree_uses_feature_names_and_cover(model):
    named = dataclasses.replace(model, feature_names=tuple(f"col{i}" for i in range(N_FEATURES)))
    ax = plotting.plot_tree(named, round=1, show_cover=True, precision=6)
    root_feature = int(model.trees.feature[1, 0, 0])
    root_box = [box for box in _boxes(ax) if box.startswith(f"col{root_feature} <")]
    assert len(root_box) >= 1
    assert any(f"cover {float(model.trees.sum_hessians[1, 0, 0]):.6g}" in box for box in root_box)
    with pytest.raises(IndexError, match="round"):
        plotting.plot_tree(model, round=model.num_rounds)
    with pytest.raises(IndexError, match="output"):
        plotting.plot_tree(model, output=1)


def test_missing_matplotlib_gives_install_hint(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install .*jaxboost-gbdt\[plot\]"):
        plotting.plot_tree(model)
