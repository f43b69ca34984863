"""Plots of a trained model: feature importance bars, learning curves, one tree's splits.

The last step, for people reading a model. matplotlib is optional (``pip install
"jaxboost-gbdt[plot]"``) and imported only when a plot is drawn. Every function draws on
``ax`` (a new figure's axes when None) and returns the axes.
"""

from __future__ import annotations

import numpy as np

from .importance import feature_importance, reachable_nodes


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError('jaxboost plotting needs matplotlib: pip install "jaxboost-gbdt[plot]" '
                          "(or pip install matplotlib)") from error
    return plt


def _axes(ax, figsize):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=figsize)
    return ax


def plot_importance(model, kind: str = "gain", max_features: int | None = 20, *,
                    iteration_range: tuple[int, int] | None = None, ax=None, show_values: bool = True,
                    title: str | None = None):
    """Horizontal bars of ``model.feature_importance(kind)``, the most important feature on top.

    Args:
      model: a trained ``Model``.
      kind: ``"weight"``, ``"gain"``, ``"total_gain"``, ``"cover"`` or ``"total_cover"``.
      max_features: draw at most this many features (None: every feature split on).
      iteration_range: the rounds to count, as in ``Model.predict``.
      ax: matplotlib axes to draw on.
      show_values: write each bar's score beside it.

    Returns:
      The axes; one bar per feature drawn.
    """
    if max_features is not None and (not isinstance(max_features, int) or max_features < 1):
        raise ValueError(f"max_features must be a positive integer or None; got {max_features!r}")
    scores = feature_importance(model, kind, iteration_range)
    if not scores:
        raise ValueError("the model has no splits, so no feature has an importance to plot")
    ranked = sorted(scores.items(), key=lambda item: item[1], reverse=True)[:max_features]
    names = [name for name, _ in reversed(ranked)]
    values = [value for _, value in reversed(ranked)]
    ax = _axes(ax, (6, max(2.0, 0.3 * len(names) + 1)))
    bars = ax.barh(np.arange(len(names)), values, align="center", height=0.6)
    ax.set_yticks(np.arange(len(names)), labels=names)
    if show_values:
        ax.bar_label(bars, labels=[f"{value:.4g}" for value in values], padding=3)
    ax.set_xlabel(f"importance ({kind})")
    ax.set_ylabel("feature")
    ax.set_title("Feature importance" if title is None else title)
    ax.margins(x=0.15)
    return ax


def plot_metric(model_or_evals_result, metric: str | None = None, *, eval_names=None, ax=None,
                title: str | None = None):
    """Learning curves: one metric per round, one line per eval set.

    Args:
      model_or_evals_result: a ``Model`` (its ``evals_result``; its ``best_iteration``, when set,
        is marked by a dashed vertical line) or an ``{eval name: {metric: [values]}}`` dict.
      metric: the metric to draw; default: the first metric of the first eval set.
      eval_names: the eval sets to draw (default: all).
      ax: matplotlib axes to draw on.

    Returns:
      The axes: one line per eval set, plus the best-iteration line for a model that has one.
    """
    evals_result = getattr(model_or_evals_result, "evals_result", model_or_evals_result)
    best_iteration = getattr(model_or_evals_result, "best_iteration", None)
    if not isinstance(evals_result, dict) or not evals_result:
        raise ValueError("no evaluation history to plot: train with eval_set=... to record one")
    names = list(evals_result) if eval_names is None else list(eval_names)
    unknown = [name for name in names if name not in evals_result]
    if unknown:
        raise ValueError(f"eval sets {unknown} are not in the history; it has {list(evals_result)}")
    if metric is None:
        metric = next(iter(evals_result[names[0]]), None)
    missing = [name for name in names if metric not in evals_result[name]]
    if metric is None or missing:
        available = sorted({m for name in names for m in evals_result[name]})
        raise ValueError(f"metric {metric!r} is not recorded for {missing or names}; recorded metrics: {available}")
    ax = _axes(ax, (6, 4))
    for name in names:
        values = evals_result[name][metric]
        ax.plot(np.arange(len(values)), values, label=name)
    if best_iteration is not None:
        ax.axvline(best_iteration, color="gray", linestyle="--", label="best iteration")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per round" if title is None else title)
    ax.legend()
    return ax


def _node_positions(is_leaf: np.ndarray, reachable: np.ndarray) -> dict[int, tuple[float, int]]:
    """(x, depth) of every reachable node: leaves evenly spaced left to right, a split node
    centred over its children."""
    positions: dict[int, tuple[float, int]] = {}
    next_leaf_x = [0.0]

    def place(node: int, depth: int) -> float:
        if is_leaf[node]:
            x = next_leaf_x[0]
            next_leaf_x[0] += 1.0
        else:
            x = 0.5 * (place(2 * node + 1, depth + 1) + place(2 * node + 2, depth + 1))
        positions[node] = (x, depth)
        return x

    if reachable[0]:
        place(0, 0)
    return positions


def split_label(model, feature: int, threshold_bin: int, precision: int = 4) -> str:
    """``"name < edge"``: the split's condition on raw values (rows with it true go left)."""
    names = model.feature_names
    name = names[feature] if names is not None else f"f{feature}"
    edge = float(np.asarray(model.bin_edges.edges)[feature, threshold_bin])
    return f"{name} < {edge:.{precision}g}"


def plot_tree(model, round: int = 0, output: int = 0, *, ax=None, precision: int = 4, show_cover: bool = False):
    """One tree drawn top-down: split boxes ``"f3 < 0.52"`` (the bin edge as threshold; "yes"
    goes left), leaf boxes with their values; the branch missing values take says "missing".

    Args:
      model: a trained ``Model``.
      round: the round index (negative counts from the end).
      output: the output (class) whose tree to draw.
      ax: matplotlib axes to draw on.
      precision: significant digits of thresholds and values.
      show_cover: add each node's Hessian sum (cover) to its box.

    Returns:
      The axes: one boxed text per node of the tree, one label per branch.
    """
    if not -model.num_rounds <= round < model.num_rounds:
        raise IndexError(f"round {round} is outside the model's {model.num_rounds} rounds")
    if not 0 <= output < model.num_outputs:
        raise IndexError(f"output {output} is outside the model's {model.num_outputs} outputs")
    trees = model.trees
    tree = {name: np.asarray(getattr(trees, name))[round, output] for name in trees._fields}
    is_leaf = tree["is_leaf"].astype(bool)
    positions = _node_positions(is_leaf, reachable_nodes(is_leaf))
    ax = _axes(ax, (max(4.0, 1.6 * sum(is_leaf[list(positions)])), 1.2 * (1 + max(d for _, d in positions.values()))))
    box = dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor="black")
    for node, (x, depth) in positions.items():
        if is_leaf[node]:
            label = f"leaf {tree['value'][node]:.{precision}g}"
        else:
            label = split_label(model, int(tree["feature"][node]), int(tree["threshold_bin"][node]), precision)
        if show_cover:
            label += f"\ncover {tree['sum_hessians'][node]:.{precision}g}"
        ax.text(x, -depth, label, ha="center", va="center", bbox=dict(box, facecolor="white" if not is_leaf[node]
                                                                      else "#e8f0fe"), zorder=3)
        if is_leaf[node]:
            continue
        for child, answer, missing in ((2 * node + 1, "yes", tree["default_left"][node]),
                                       (2 * node + 2, "no", not tree["default_left"][node])):
            child_x, child_depth = positions[child]
            ax.plot([x, child_x], [-depth, -child_depth], color="gray", zorder=1)
            ax.text(0.5 * (x + child_x), -0.5 * (depth + child_depth), answer + (", missing" if missing else ""),
                    ha="center", va="center", fontsize=8, color="dimgray", zorder=2)
    xs = [x for x, _ in positions.values()]
    depths = [d for _, d in positions.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-max(depths) - 0.5, 0.5)
    ax.set_axis_off()
    ax.set_title(f"round {round % model.num_rounds}, output {output}")
    return ax
