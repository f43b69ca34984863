"""treelite export: a trained ``Model`` -> a ``treelite.Model`` through treelite's model builder.

Each jaxboost tree becomes one treelite tree of the output it adds to (a class of a
multiclass model, a target of a multi-output one), with the node list of ``node_list``:
numerical tests ``x < threshold`` on float32 thresholds, missing values following
``default_left``, leaf outputs and covers. The starting value goes in as ``base_scores``
(margins) and the link as treelite's postprocessor, so ``treelite.gtil.predict(...,
pred_margin=True)`` equals ``predict_raw`` and the plain ``predict`` applies the link:
``sigmoid`` (also with scale 2 for the exponential loss), ``softmax`` and ``exponential``;
other links (hinge's step, custom functions) are written as ``identity`` with a warning. All
rounds are written.

treelite is an optional dependency: ``pip install treelite`` (or the ``treelite`` extra).
"""

from __future__ import annotations

import numpy as np

from .node_list import link_name, model_node_lists
from .validation import warn_caller

# jaxboost link -> (treelite postprocessor, its sigmoid_alpha)
POSTPROCESSORS = {
    "identity": ("identity", 1.0),
    "sigmoid": ("sigmoid", 1.0),
    "sigmoid_2x": ("sigmoid", 2.0),
    "softmax": ("softmax", 1.0),
    "exp": ("exponential", 1.0),
}


def _import_treelite():
    try:
        import treelite
        import treelite.model_builder
    except ImportError as error:
        raise ImportError("exporting to treelite needs the treelite package: pip install treelite "
                          "(or pip install 'jaxboost-gbdt[treelite]')") from error
    return treelite


def to_treelite(model):
    """All rounds of ``model`` as a ``treelite.Model`` (float32 thresholds and leaf outputs)."""
    treelite = _import_treelite()
    builder_module = treelite.model_builder
    if model.num_rounds == 0:
        raise ValueError("the model has no trees to export (num_rounds == 0)")
    link = link_name(model)
    if link not in POSTPROCESSORS:
        warn_caller(f"link {link or 'custom'!r} of loss {model.loss_name!r} has no treelite postprocessor: "
                    "written as 'identity', so treelite's predictions are raw margins")
        link = "identity"
    postprocessor, sigmoid_alpha = POSTPROCESSORS[link]
    K = model.num_outputs
    multiclass = link == "softmax"
    if multiclass:
        task, num_target, num_class = "kMultiClf", 1, [K]
    elif postprocessor == "sigmoid" and K == 1:
        task, num_target, num_class = "kBinaryClf", 1, [1]
    else:
        task, num_target, num_class = "kRegressor", K, [1] * K
    node_lists = model_node_lists(model)
    num_trees = len(node_lists) * K
    outputs = [output for _ in node_lists for output in range(K)]
    builder = builder_module.ModelBuilder(
        threshold_type="float32",
        leaf_output_type="float32",
        metadata=builder_module.Metadata(num_feature=model.n_features, task_type=task, average_tree_output=False,
                                         num_target=num_target, num_class=num_class, leaf_vector_shape=(1, 1)),
        tree_annotation=builder_module.TreeAnnotation(
            num_tree=num_trees,
            target_id=[0 if multiclass else output for output in outputs],
            class_id=[output if multiclass else 0 for output in outputs]),
        postprocessor=builder_module.PostProcessorFunc(name=postprocessor, sigmoid_alpha=sigmoid_alpha),
        base_scores=[float(score) for score in np.asarray(model.base_score, np.float32).reshape(-1)],
    )
    for round_trees in node_lists:
        for nodes in round_trees:
            builder.start_tree()
            for node in range(nodes.num_nodes):
                builder.start_node(node)
                if nodes.is_leaf[node]:
                    builder.leaf(float(nodes.value[node]))
                else:
                    builder.numerical_test(feature_id=int(nodes.feature[node]), threshold=float(nodes.threshold[node]),
                                           default_left=bool(nodes.default_left[node]), opname="<",
                                           left_child_key=int(nodes.left_child[node]),
                                           right_child_key=int(nodes.right_child[node]))
                    builder.gain(float(nodes.loss_change[node]))
                builder.sum_hess(float(nodes.sum_hessians[node]))
                builder.end_node()
            builder.end_tree()
    return builder.commit()
