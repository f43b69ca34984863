"""Training: ``jb.train``, a thin host loop around the compiled boosting round.

The host validates input, bins it once, pads rows to a bucket size (zero-weight rows, spread
evenly: each device's block holds its share of the rows, then its padding), places the data on
the devices (CPU devices read the Dataset's code table in place, each from its first row),
finds the starting value (in a first fit, in a thread while the round compiles) and then calls
the compiled round once per round. Per round only a
few scalars come back: the eval metrics and the loss's health flags, so a custom loss that
returns non-finite gradients or negative Hessians stops training at that round with an error
naming it. Callbacks (``callbacks.py``) run around every round; early
stopping and the evaluation log are callbacks. Training can continue from a model
(``init_model``): its trees give the starting raw predictions and round keys go on counting.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import numbers
import weakref
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .boosting import (HESSIAN_MODES, STARTING_VALUE_FEW_ROWS, SWEEP_TOLERANCE, RoundHealth, RoundParams,
                       RoundShape, compiled_round, compiled_zero_hessian_count, histogram_buffer, round_tree_template,
                       seed_key_data, starting_value, stored_round)
from .callbacks import Callback, EarlyStopping, EvaluationMonitor, TrainingState
from .dataset import Dataset
from .derivatives import hessian_vanishes
from .devices import (copied_codes_on_mesh, float32_jax, kernel_row_ranges, kernel_threads, mesh_platform,
                      pad_rows_by_device, padded_size, replicated, row_sharding, shared_codes_on_mesh, solve_threads,
                      training_row_mesh)
from .grower import GrowthParams, prunes_splits, tree_feature_slots
from .histogram import HISTOGRAM_TARGET
from .host_memory import collection_paused, release_free_memory, release_free_memory_after
from .line_search import SLOPE_ROUNDING, newton_minimiser
from .model import Model
from .native import native_target
from .objective import ResolvedLoss, higher_is_better, resolve_loss, resolve_metrics
from .predictor import predict_raw_binned
from .program_store import ready
from .regularizer import Regularization, VectorLeaves, check_regularization, check_vector_regularization
from .tree import Tree, num_heap_nodes, unpack_fields
from .validation import check_base_margin

MAX_DEPTH_LIMIT = 12


def _check_range(name, value, low, high, low_open=False, high_open=False):
    if not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}; got {value}")


def check_flag(name: str, value) -> None:
    """A yes/no setting must be a bool (a string such as "false" would read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def _check_params(num_rounds, max_depth, learning_rate, reg_lambda, reg_alpha, gamma, min_child_weight, subsample,
                  colsample_bytree, colsample_bylevel, colsample_bynode, max_delta_step, scale_pos_weight):
    if not isinstance(num_rounds, numbers.Integral) or num_rounds < 0:
        raise ValueError(f"num_rounds must be a non-negative integer; got {num_rounds!r}")
    if not isinstance(max_depth, numbers.Integral) or not 1 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth must be an integer in [1, {MAX_DEPTH_LIMIT}]; got {max_depth!r}")
    if not callable(learning_rate):
        _check_range("learning_rate", learning_rate, 0, np.inf, low_open=True, high_open=True)
    for name, value in [("reg_lambda", reg_lambda), ("reg_alpha", reg_alpha), ("gamma", gamma),
                        ("min_child_weight", min_child_weight), ("max_delta_step", max_delta_step)]:
        _check_range(name, value, 0, np.inf, high_open=True)
    _check_range("scale_pos_weight", scale_pos_weight, 0, np.inf, low_open=True, high_open=True)
    for name, value in [("subsample", subsample), ("colsample_bytree", colsample_bytree),
                        ("colsample_bylevel", colsample_bylevel), ("colsample_bynode", colsample_bynode)]:
        _check_range(name, value, 0, 1, low_open=True)


class _DeviceRows:
    """One dataset's rows padded to a bucket size and placed on the mesh."""

    def __init__(self, dataset: Dataset, resolved: ResolvedLoss, mesh, margin: np.ndarray | None,
                 base_score: np.ndarray | None, sample_weight: np.ndarray | None = None, evaluation: bool = False):
        if dataset.y is None:
            raise ValueError("a Dataset used for training or evaluation needs labels y")
        resolved.check_labels(dataset.y)
        self.n_rows = dataset.n_rows
        self.mesh = mesh
        self.devices = mesh.size
        size = padded_size(dataset.n_rows, self.devices)
        labels = dataset.y.astype(resolved.label_dtype, copy=False)
        # Padding rows repeat a real label (so the loss stays finite there) with weight 0.
        self.y = self.pad(labels, labels[0], size)
        self.sample_weight = self.pad(dataset.sample_weight if sample_weight is None
                                      else sample_weight.astype(np.float32), 0.0, size)
        self.margin = None if margin is None else self.pad(margin, 0.0, size)
        self.X_binned = dataset.X_binned  # unpadded: the padded copies below are built once and handed over
        # CPU devices with the native kernels all read the Dataset's code table in place, each
        # from its first row; elsewhere each device gets a copy of its rows.
        # Eval sets' rows are predicted by the XLA predictor, which reads codes row by row.
        self.shared_codes = (not evaluation and mesh_platform(mesh) == "cpu"
                             and native_target(HISTOGRAM_TARGET) is not None)
        self.X_binned_T_device = self.X_binned_device = self.row_offsets_device = None
        if evaluation:
            self.X_binned_device = self.put_rows(self.pad(dataset.X_binned, 0, size))
        elif self.shared_codes:
            self.X_binned_T_device, self.row_offsets_device = shared_codes_on_mesh(dataset.X_binned_T, self.n_rows,
                                                                                   size, mesh)
        else:
            self.X_binned_T_device = copied_codes_on_mesh(dataset.X_binned, size, mesh)
            self.row_offsets_device = self.put_rows(np.zeros(self.devices, np.int32))
        self.y_device = self.put_rows(self.y)
        self.sample_weight_device = self.put_rows(self.sample_weight)
        if base_score is not None:
            self.initial_raw_prediction(base_score)

    def put_rows(self, array) -> jax.Array:
        """Per-row ``array`` in these rows' padded layout, sharded over the mesh by rows. Eval sets
        too: each device predicts its share, and committed to the mesh as the round's outputs
        are, a round's eval predictions come back as the next round takes them (an uncommitted
        first input compiled the round again for round two)."""
        return jax.device_put(array, row_sharding(self.mesh, array.ndim))

    @functools.cached_property
    def row_index_device(self) -> jax.Array:
        """Each row's index in the data (padding: -1), which row sampling draws by; built on
        first use, so training without row sampling does not hold it."""
        return self.put_rows(self.pad(np.arange(self.n_rows, dtype=np.int32), -1))

    def pad(self, array: np.ndarray, fill, size: int | None = None) -> np.ndarray:
        """Per-row ``array`` (n, ...) in these rows' padded layout: each device's share of the
        rows, then its padding (``devices.pad_rows_by_device``)."""
        return pad_rows_by_device(array, self.y.shape[0] if size is None else size, self.devices, fill)

    def raw_prediction_shape(self, num_outputs: int) -> jax.ShapeDtypeStruct:
        """The raw predictions' shape, type and sharding, before they are known."""
        return jax.ShapeDtypeStruct((self.y.shape[0], num_outputs), np.float32,
                                    sharding=row_sharding(self.mesh, 2))

    def initial_raw_prediction(self, base_score: np.ndarray):
        start = (np.broadcast_to(base_score, (self.y.shape[0], base_score.shape[0])) if self.margin is None
                 else self.margin)
        self.raw_prediction = self.put_rows(np.ascontiguousarray(start, dtype=np.float32))


def positives_weighted(dataset: Dataset, scale_pos_weight: float) -> np.ndarray:
    """The Dataset's sample weights with the rows labelled 1 weighted by ``scale_pos_weight``."""
    if scale_pos_weight == 1:
        return dataset.sample_weight
    return np.where(dataset.y == 1, dataset.sample_weight * np.float32(scale_pos_weight), dataset.sample_weight)


def _as_dataset(data, y, sample_weight, max_bin, base_margin, reference=None) -> Dataset:
    if isinstance(data, Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("pass labels and weights inside the Dataset, not beside it")
        if reference is not None and data.bin_edges is not reference.bin_edges:
            # An eval Dataset binned on other edges would route rows differently from training.
            raise ValueError("eval Dataset must be built with reference=<the training Dataset>")
        return data
    return Dataset(data, y, sample_weight, max_bin=max_bin, reference=reference, base_margin=base_margin)


# The rounds compiled ahead, each for the row counts it was compiled for (weak keys: rounds
# evicted from the caches of compiled rounds are compiled ahead again when made anew).
_ROUNDS_COMPILED_FOR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def found_while_compiling(compiled_round, arguments: tuple, find: Callable):
    """Runs ``find()`` (a fit's starting value, a program of its own) and returns its result.

    In the first fit of ``compiled_round`` for ``arguments``, in which ``jax.ShapeDtypeStruct``s
    stand for the raw predictions that wait for ``find``'s result (their shapes, the row counts,
    tell one fit's program from another's), this thread traces and lowers the round's programs
    in turn (``SplitRound.lower_in_turn``: the trees' first, then the others), each compiling
    ahead of its first call in a thread of its own as soon as it is lowered (XLA compiles without
    holding the GIL), and then runs ``find``. The trees' compile, the longest, had waited for
    the derivatives' tracing and lowering: first fits at 100k rows on 2 cores, cache off, medians
    of 6 alternating pairs, classification 2.16 -> 1.79 s (every pair lower), regression 1.95 ->
    1.74 (10 classes, vector leaves, a refit: CPU-bound throughout, within the noise). The
    derivatives' and the metrics' compile one after the other: each in a thread of its own moved
    nothing, and would hold more compilers' memory at once. A refit's compiles in a third: a
    custom loss with a refit finds its starting value with it (``_starting_value_by_round``),
    after the compiles, and it had been the last to start and end. Started before the round's
    tracing, ``find``'s own tracing had taken turns with it on the GIL: first fits took 10-13%
    longer (medians of 6-8 alternating runs on 2 cores, cache off: 100k x 28 rows 3.33 -> 3.10
    s, 1M 3.14 -> 2.70, 15k 2.65 -> 2.34).
    Later fits just call ``find``: asking for the compiled round again costs a cached compile's
    lookup (0.3 ms of a 2.4 ms fit on small data). ``compiled_round`` None (no rounds asked
    for): ``find`` alone.

    After a compile, the memory the compiler freed goes back to the system before the rounds'
    buffers come on top of it: held until training's first hand-back, 16 rounds on, it had set a
    one-fit process's peak (1M x 28, 100 rounds: 500-524 -> 489-498 MB; 10 classes at 160k rows:
    442-516 -> 419-498). The benchmark's, whose compile is a 1-round fit of its own, stayed within
    its spread (533-540 against 540-548 MB in alternating runs; 540-550 in two full runs after).
    A custom loss found to need a leaf refit compiles the refit round ahead in a second call,
    with nothing left to find."""
    row_counts = tuple(leaf.shape for leaf in jax.tree_util.tree_leaves(arguments)
                       if isinstance(leaf, jax.ShapeDtypeStruct))
    compiled_for = set() if compiled_round is None else _ROUNDS_COMPILED_FOR.setdefault(compiled_round, set())
    with collection_paused():
        if compiled_round is None or row_counts in compiled_for:
            return find()
        lower_in_turn = getattr(compiled_round, "lower_in_turn", None)
        lowered_in_turn = (lower_in_turn(*arguments) if lower_in_turn is not None
                           else iter([compiled_round.lower(*arguments)]))
        # A pool of the fit's own: a process forked after a fit would inherit a pool's
        # bookkeeping without its threads.
        with concurrent.futures.ThreadPoolExecutor(3, "jaxboost-compile") as threads:
            # In 32-bit mode, as training's thread is: compiled in another mode, a program is
            # not the one its first call looks for, and compiles again.
            compiling = [threads.submit(float32_jax(lowered.compile)) for lowered in lowered_in_turn]
            found = find()
            for pending in compiling:
                pending.result()
        release_free_memory()
    compiled_for.add(row_counts)
    return found


def distinct_labels(y: np.ndarray, weights: np.ndarray, rows: int = STARTING_VALUE_FEW_ROWS) -> tuple | None:
    """The labels of ``y`` (n, ...) that some row of positive weight holds, each once, and the
    weights ``weights`` (n,) or (models, n) of their rows summed (float64 sums, as float32):
    ``(labels (rows, ...), summed weights (rows,) or (models, rows))``, padded with weight 0 to
    ``rows``; None where the labels are more than ``rows``.

    At a constant raw prediction a row's loss depends on its label alone, so the weighted loss
    of all the rows is that of their distinct labels, each weighted by its rows' weights: a
    custom loss's starting value is found over those (classes, counts, a few levels) rather than
    every row, in a program of ``rows`` rows compiled quickly (``boosting.STARTING_VALUE_FEW_ROWS``).
    A custom 10-class softmax's Newton steps at 100k rows had run 80 ms every fit and compiled in
    0.49 s (0.59 s at LLVM's default level over its distinct labels, 0.17 at level 0, run in 1.5
    ms). Continuous labels are told apart by their first rows, before any sort of them all."""
    counted = np.any(weights > 0, axis=0) if weights.ndim > 1 else weights > 0
    labels = y[counted]
    axis = 0 if labels.ndim > 1 else None
    if labels.shape[0] == 0 or np.unique(labels[:8 * rows], axis=axis).shape[0] > rows:
        return None
    if axis is None:
        # A sort of the labels alone, then a search of each in the few distinct ones: at 800k
        # rows 7 + 4 ms, where np.unique's inverse (a sort of their indices) took 45.
        distinct = np.unique(labels)
        if distinct.shape[0] > rows:
            return None
        inverse = np.searchsorted(distinct, labels)
    else:
        distinct, inverse = np.unique(labels, axis=0, return_inverse=True)
        if distinct.shape[0] > rows:
            return None
        inverse = inverse.reshape(-1)
    counted_weights = weights[..., counted].reshape(-1, labels.shape[0]).astype(np.float64)
    summed = np.stack([np.bincount(inverse, weights=model_weights, minlength=rows)
                       for model_weights in counted_weights]).astype(np.float32)
    padded = np.concatenate([distinct, np.broadcast_to(distinct[:1], (rows - distinct.shape[0],) + distinct.shape[1:])])
    return padded.astype(y.dtype), summed.reshape(weights.shape[:-1] + (rows,))


def _starting_value(resolved: ResolvedLoss, rows: _DeviceRows, mesh, start: np.ndarray | None = None) -> np.ndarray:
    """The constant raw prediction minimising the weighted loss of ``rows``: a built-in's closed
    form where it has one (``closed_form_starting_value``), else found numerically on the mesh's
    first device, from 0 or from ``start``, over the rows' distinct labels where they are few
    (``distinct_labels``), else over every row: each of the minimisation's 25-odd passes over
    the rows had ended in a sum over the devices, most of a small fit's starting value (40k
    rows on two CPU devices: 3.7 -> 2.0 ms a fit; 800k: 32.1 -> 30.5)."""
    if resolved.optimal_constant is not None:
        return closed_form_starting_value(resolved, rows.y, rows.sample_weight)
    K = resolved.objective.num_outputs
    started = np.zeros(K, np.float32) if start is None else start
    y, weights = distinct_labels(rows.y, rows.sample_weight) or (rows.y, rows.sample_weight)
    raw_prediction, y_one, weight_one = jax.device_put(
        [np.broadcast_to(started, (y.shape[0], K)).astype(np.float32), y, weights], mesh.devices.flat[0])
    offsets = np.asarray(starting_value(resolved.objective, raw_prediction, y_one, weight_one, resolved.loss_params,
                                        _without_curvature(resolved, rows)))
    return offsets if start is None else start + offsets


def _round_finds_start(resolved: ResolvedLoss, shape: RoundShape, regularizer: Regularization,
                       rows: _DeviceRows) -> str | None:
    """How a fit's compiled round finds a custom loss's starting value, instead of a program of
    its own (``_starting_value_by_round``): "refit" (its leaves refit, scalar leaves, no custom
    leaf penalty, which the refit's minimisation would add, and one output or a Hessian zero
    everywhere), "derivatives" (one output otherwise), or None (a built-in's closed form, or
    several outputs: Newton steps on the whole vector in a program)."""
    if resolved.optimal_constant is not None or shape.vector_leaves is not None:
        return None
    single = shape.objective.num_outputs == 1
    if shape.leaf_refit and regularizer.penalty is None and (single or _hessian_vanishes(resolved, rows)):
        return "refit"
    return "derivatives" if single else None


def _starting_value_by_round(boosting_round, arguments: tuple, resolved: ResolvedLoss, rows: _DeviceRows,
                             way: str) -> np.ndarray:
    """The starting value found by the round's programs, already compiled, instead of a program
    of its own (the coordinate sweeps' had been about 0.5 s of CPU to compile, beside the
    round's, in a custom loss's first fit). ``way`` "refit": the refit's program
    (``SplitRound.constant_offsets``), its exact minimisation; several outputs (a Hessian zero
    everywhere: pinball losses, say) are each minimised with the others held at 0, then again
    from there, and where that second pass moves some output (outputs that interact), the
    coordinate sweeps go on from it. "derivatives": Newton steps on the host
    (``line_search.newton_minimiser``), each slope and curvature summed from the derivatives'
    program (``SplitRound.derivative_sums``)."""
    K = resolved.objective.num_outputs
    if way == "derivatives":
        def slope_and_curvature(constant: float) -> tuple[float, float, float]:
            rows.initial_raw_prediction(np.full(1, constant, np.float32))
            slope, gross, curvature = boosting_round.derivative_sums(arguments, rows.raw_prediction)
            return float(slope[0]), float(curvature[0]), SLOPE_ROUNDING * float(gross[0])

        found = np.full(1, newton_minimiser(slope_and_curvature), np.float32)
        rows.raw_prediction = None
        return found
    constant = np.zeros(K, np.float32)
    for _ in range(1 if K == 1 else 2):
        rows.initial_raw_prediction(constant)
        offsets = boosting_round.constant_offsets(arguments, rows.raw_prediction)
        constant = (constant + offsets).astype(np.float32)
    rows.raw_prediction = None
    if K == 1 or np.all(np.abs(offsets) <= SWEEP_TOLERANCE * np.maximum(1.0, np.abs(constant))):
        return constant
    return _starting_value(resolved, rows, rows.mesh, start=constant)


def closed_form_starting_value(resolved: ResolvedLoss, y: np.ndarray, sample_weight: np.ndarray,
                               loss_params: dict | None = None) -> np.ndarray:
    """A built-in's best constant from its closed form, on the host
    (``losses.BuiltinLoss.optimal_constant``): its numerical minimisation was a program of its
    own to trace and compile in every new shape's first fit (softmax's 10 classes: 0.3 s of
    tracing and 1.3 s of compile on 2 cores, a fit's last compile to end), and its passes over
    the rows ran in every fit. Rows of weight zero (the devices' padding) count for nothing.
    ``loss_params``: one model's (None: ``resolved``'s), over the loss's own defaults."""
    signature = inspect.signature(resolved.objective.loss)
    params = {name: parameter.default for name, parameter in signature.parameters.items()
              if parameter.default is not inspect.Parameter.empty}
    params.update({name: np.asarray(value) for name, value in
                   (resolved.loss_params if loss_params is None else loss_params).items()})
    return resolved.optimal_constant(y, sample_weight, resolved.objective.num_outputs, **params).astype(np.float32)


def _without_curvature(resolved: ResolvedLoss, rows: _DeviceRows) -> bool:
    """Whether a loss of several outputs has a Hessian zero everywhere, so that its starting
    value leaves out the Newton steps (``boosting.starting_value``). A smooth built-in is not
    traced for it: softmax's trace took 58 ms of a first fit (10 classes), the Gaussian's 43."""
    return (resolved.objective.num_outputs > 1 and resolved.leaf_refit is not False
            and _hessian_vanishes(resolved, rows))


def _hessian_vanishes(resolved: ResolvedLoss, rows: _DeviceRows) -> bool:
    """Whether a custom loss's Hessian is zero at every raw prediction, as its trace shows
    (``derivatives.hessian_vanishes``)."""
    objective = resolved.objective
    label = jax.ShapeDtypeStruct(rows.y.shape[1:], rows.y.dtype)
    return hessian_vanishes(objective.loss, label, resolved.loss_params,
                            objective.num_outputs if objective.vector_output else None)


def _leaf_refit_needed(resolved: ResolvedLoss, rows: _DeviceRows) -> bool:
    """Custom losses: refit leaves when some weighted row has an exactly zero Hessian at the
    start. A Hessian zero everywhere (``_hessian_vanishes``) compiles no count program: a
    ``train_many`` of a piecewise-linear loss had compiled one."""
    if _hessian_vanishes(resolved, rows):
        return bool(np.any(rows.sample_weight > 0))
    count = compiled_zero_hessian_count(resolved.objective, rows.mesh)
    return int(count(rows.raw_prediction, rows.y_device, rows.sample_weight_device, resolved.loss_params)) > 0


def _raise_if_unhealthy(health_flags, loss_name: str, round_index: int):
    """``health_flags``: a round's ``RoundHealth`` fields stacked along the last axis."""
    # np.asarray first: np.any of a JAX array would dispatch one more JAX computation per round.
    health = RoundHealth(*np.asarray(health_flags).T)  # (2,) or (models, 2): the fields lead
    if health.non_finite.any():
        raise FloatingPointError(f"loss {loss_name!r} produced non-finite values, gradients or Hessians at round "
                                 f"{round_index} (or gradients whose sum overflows float32); check the loss for "
                                 "overflow, log(0) or 0/0 at the raw predictions reached")
    if health.negative_hessian.any():
        raise ValueError(f"loss {loss_name!r} produced negative Hessians at round {round_index}; a loss must be "
                         "convex in the raw prediction (zero Hessians are fine), or train with hessian='floor' "
                         "or 'constant'")


# Rounds between hand-backs of the malloc arenas' free pages (``host_memory``); a hand-back
# took 0.3-3 ms in a 1M x 28 fit, under 1% of 16 rounds' time. Every 4 or 8 rounds, the
# benchmark's peak was the same (541-550 MB against 548-549).
RELEASE_MEMORY_EVERY_ROUNDS = 16


class RoundTrees:
    """The trees of the rounds dispatched so far (each round's packed into one array,
    ``tree.pack_fields``), on their way to the host.

    On an accelerator each round's array starts its copy to the host as the round is
    dispatched: they then arrive while later rounds run, instead of one small transfer after
    another when the model is built. A CPU's are on the host already (asking cost 60 us a
    round, a quarter of a round on 200 rows)."""

    def __init__(self, mesh, template: Tree, models: int | None = None):
        """``template``: ``round_tree_template``'s; ``models``: ``train_many``'s M, a round's
        trees then lead with a model axis."""
        self.rounds: list[jax.Array] = []
        self.template = template
        self.models = () if models is None else (models,)
        self.copy_ahead = mesh_platform(mesh) != "cpu"

    def append(self, packed_trees: jax.Array) -> None:
        if self.copy_ahead:
            packed_trees.copy_to_host_async()
        self.rounds.append(packed_trees)

    def __len__(self) -> int:
        return len(self.rounds)

    def stacked(self) -> Tree:
        """Host arrays with a leading round axis (then the model axis, if any), of length 0 when
        no round ran."""
        if not self.rounds:
            return Tree(*(np.zeros((0, *self.models, *field.shape), field.dtype) for field in self.template))
        return unpack_fields(np.stack([np.asarray(packed) for packed in self.rounds]), self.template)


def release_memory_now_and_then(round_index: int, n_rows: int) -> None:
    """After every ``RELEASE_MEMORY_EVERY_ROUNDS``-th round of training on ``n_rows`` rows, hand
    the free pages of the malloc arenas back, before the rounds' freed buffers pile up in them
    (``release_free_memory_after``: not for small data)."""
    if round_index % RELEASE_MEMORY_EVERY_ROUNDS == RELEASE_MEMORY_EVERY_ROUNDS - 1:
        release_free_memory_after(n_rows)


MULTI_STRATEGIES = ("one_output_per_tree", "multi_output_tree")
MULTI_OUTPUT_HESSIANS = ("full", "diagonal")


def grows_vector_leaves(multi_strategy: str, num_outputs: int) -> bool:
    """Whether ``multi_strategy`` grows one tree of vector leaves for ``num_outputs`` outputs (one
    output: a vector leaf is a scalar leaf)."""
    return multi_strategy != "one_output_per_tree" and num_outputs > 1


def vector_leaves(multi_strategy: str, multi_output_hessian: str, num_outputs: int, regularizer: Regularization,
                  monotone) -> VectorLeaves | None:
    """The vector-leaf layout for ``multi_strategy`` (None: one tree per output), checked."""
    if multi_strategy not in MULTI_STRATEGIES:
        raise ValueError(f"multi_strategy must be one of {MULTI_STRATEGIES}; got {multi_strategy!r}")
    if multi_output_hessian not in MULTI_OUTPUT_HESSIANS:
        raise ValueError(f"multi_output_hessian must be one of {MULTI_OUTPUT_HESSIANS}; got {multi_output_hessian!r}")
    if not grows_vector_leaves(multi_strategy, num_outputs):
        return None
    if monotone is not None:
        raise ValueError("monotone_constraints are not supported with multi_strategy='multi_output_tree' (a "
                         "vector leaf has no single direction to constrain); use 'one_output_per_tree'")
    leaves = VectorLeaves(num_outputs, full_hessian=multi_output_hessian == "full")
    check_vector_regularization(regularizer, leaves)
    return leaves


def _feature_index(feature, feature_names, n_features: int, what: str) -> int:
    if isinstance(feature, str):
        if feature_names is None or feature not in feature_names:
            raise ValueError(f"{what} names feature {feature!r}, which is not a column of X")
        return feature_names.index(feature)
    if not isinstance(feature, numbers.Integral) or not 0 <= feature < n_features:
        raise ValueError(f"{what} refers to feature {feature!r}; features are 0..{n_features - 1}")
    return int(feature)


def monotone_array(monotone_constraints, feature_names, n_features: int) -> np.ndarray | None:
    """+1 / -1 / 0 per feature, from a sequence over all features or a {feature: direction} dict."""
    if monotone_constraints is None:
        return None
    if isinstance(monotone_constraints, dict):
        directions = np.zeros(n_features, np.int32)
        for feature, direction in monotone_constraints.items():
            directions[_feature_index(feature, feature_names, n_features, "monotone_constraints")] = direction
        values = list(monotone_constraints.values())
    else:
        values = list(monotone_constraints)
        if len(values) != n_features:
            raise ValueError(f"monotone_constraints has {len(values)} entries but X has {n_features} features")
        directions = np.asarray(values, np.int32) if values else np.zeros(n_features, np.int32)
    if any(value not in (-1, 0, 1) for value in values):
        raise ValueError(f"monotone_constraints entries must be -1, 0 or +1; got {values}")
    return directions if directions.any() else None


def interaction_groups(interaction_constraints, feature_names, n_features: int) -> np.ndarray | None:
    """Bool (groups, n_features) from a list of feature groups (indices or names)."""
    if interaction_constraints is None:
        return None
    groups = np.zeros((len(interaction_constraints), n_features), bool)
    for row, group in enumerate(interaction_constraints):
        if isinstance(group, (str, numbers.Integral)) or len(group) == 0:
            raise ValueError(f"interaction_constraints must be a list of non-empty feature lists; got {group!r}")
        for feature in group:
            groups[row, _feature_index(feature, feature_names, n_features, "interaction_constraints")] = True
    if not groups.any():
        raise ValueError("interaction_constraints is empty")
    return groups


class _Schedule(NamedTuple):
    """The learning rate of every round: a constant or an optax schedule ``step -> rate``."""

    rate: float | Callable

    def __call__(self, round_index: int) -> float:
        if not callable(self.rate):
            return float(self.rate)
        value = float(np.asarray(self.rate(round_index)))
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"the learning-rate schedule gave {value} at round {round_index}; it must be > 0")
        return value


def _padded_trees(trees: Tree, num_nodes: int) -> Tree:
    """Tree arrays widened to ``num_nodes`` heap slots (a shallower tree keeps its indices)."""
    extra = num_nodes - trees.feature.shape[-1]
    if extra < 0:
        raise ValueError("init_model is deeper than max_depth: train the continuation with max_depth >= "
                         f"{int(np.log2(trees.feature.shape[-1] + 1)) - 1}")
    return Tree(*(np.concatenate([a, np.zeros(a.shape[:-1] + (extra,), a.dtype)], axis=-1) for a in trees))


def _add_tree_predictions(trees: Tree, rows: _DeviceRows, missing_bin: int) -> None:
    """Add the raw predictions of ``trees`` to the rows' starting raw predictions, on the
    devices where the rows lie."""
    X_binned = rows.X_binned_device if rows.X_binned_device is not None else rows.put_rows(rows.pad(rows.X_binned, 0))
    raw = predict_raw_binned(jax.device_put(trees, replicated(rows.mesh)), X_binned, rows.raw_prediction,
                             missing_bin=missing_bin, mesh=rows.mesh)
    rows.raw_prediction = rows.put_rows(raw)


@float32_jax
def train(data, y=None, *, loss="squared_error", loss_params: dict | None = None, num_rounds: int = 100,
          max_depth: int = 6, learning_rate: float | Callable = 0.1, reg_lambda: float = 1.0, reg_alpha: float = 0.0,
          gamma: float = 0.0, min_child_weight: float = 1.0, max_bin: int = 256, subsample: float = 1.0,
          colsample_bytree: float = 1.0, colsample_bylevel: float = 1.0, colsample_bynode: float = 1.0,
          sample_weight=None, base_margin=None, scale_pos_weight: float = 1.0, max_delta_step: float = 0.0,
          regularizer: Regularization | None = None, hessian: str = "exact", hessian_floor: float = 1e-3,
          monotone_constraints=None, interaction_constraints=None, multi_strategy: str = "one_output_per_tree",
          multi_output_hessian: str = "full", link=None, num_outputs: int | None = None,
          leaf_refit: bool | None = None, eval_set=None,
          eval_metric=None, early_stopping_rounds: int | None = None, verbose: bool | int = False,
          callbacks: list[Callback] | None = None, init_model: Model | None = None, seed: int = 0,
          deterministic_histogram: bool = False) -> Model:
    """Train a gradient-boosted tree ensemble.

    Args:
      data: features ``X`` (n, d) (NumPy array or DataFrame; NaN = missing), or a ``Dataset``.
      y: labels (n,) when ``data`` is not a Dataset.
      loss: a built-in name (``jaxboost.losses.BUILTINS``), a built-in function with bound
        parameters (``functools.partial(jb.losses.quantile, tau=0.9)``), or any JAX function
        ``loss(raw_prediction, y, **loss_params) -> scalar`` for one example (e.g. an optax loss).
      loss_params: keyword arguments of the loss (``{"tau": 0.9}``), passed as traced values so
        that one compiled program serves every value; keywords bound by ``functools.partial``
        are treated the same way.
      num_rounds, max_depth, reg_lambda, reg_alpha, gamma, min_child_weight,
      max_bin, subsample, colsample_bytree, colsample_bylevel, colsample_bynode,
      scale_pos_weight, max_delta_step: as XGBoost's parameters of the same names (``gamma``
        is ``min_split_loss``). The number of features a tree's sample keeps,
        ``max(1, floor(colsample_bytree * n_features))``, is part of the compiled round (its
        histograms hold only those features): fractions that keep as many share one program.
      learning_rate: a number, or a schedule ``round -> rate`` such as an optax schedule.
      regularizer: the leaf penalty, e.g. ``jb.regularizers.elastic_net(0.1, 1.0)`` or
        ``jb.regularizers.custom(penalty, params)``; replaces ``reg_lambda``/``reg_alpha``.
      hessian: ``"exact"`` (autodiff), ``"floor"`` (raised to at least ``hessian_floor``) or
        ``"constant"`` (1: first-order boosting); ``leaf_refit`` may follow any of them.
      monotone_constraints: +1 / -1 / 0 per feature (a sequence over all features, or a dict
        by feature index or column name).
      interaction_constraints: lists of features (indices or names) allowed to interact: every
        path of a tree uses features of one list only.
      multi_strategy: ``"one_output_per_tree"`` (one tree per output and round, as XGBoost's
        default) or ``"multi_output_tree"``: one tree per round whose leaves hold a K-vector,
        solving ``(H + lambda I) w = -G`` with the leaf's summed K x K Hessian (projected onto
        the positive semi-definite cone; needs ``reg_lambda > 0``). Such a model keeps K trees
        per round that share their splits.
      multi_output_hessian: for ``"multi_output_tree"``: ``"full"`` (the whole Hessian, for
        small K) or ``"diagonal"`` (per-output, XGBoost's vector leaves; cheaper for large K,
        and takes ``reg_alpha`` and custom penalties).
      sample_weight: per-row non-negative weights.
      base_margin: per-row offsets of the raw prediction; the starting value is then 0 (as
        XGBoost), and ``predict`` needs the same offsets.
      link: inverse link for ``predict`` of a custom loss: ``"identity"``, ``"sigmoid"``,
        ``"softmax"``, ``"exp"`` or a JAX function.
      num_outputs: K raw outputs per row for a custom loss taking a length-K vector.
      leaf_refit: set leaves by exact 1-D minimisation of the loss; default: the built-in's
        choice, and for custom losses whether any Hessian is exactly zero at the start.
      eval_set: list of ``(X, y)`` pairs or Datasets (binned with the training edges).
      eval_metric: metric name(s) (``rmse``, ``mae``, ``logloss``, ``auc``, ``error``,
        ``mlogloss``, ``merror``, ``loss``) or JAX callables ``f(y, y_pred, weight)``.
      early_stopping_rounds: stop when the last metric on the last eval set has not improved
        for this many rounds; ``predict`` then uses rounds up to ``best_iteration``.
      verbose: print the eval metrics every round (True) or every N rounds.
      callbacks: ``jb.callbacks.Callback`` objects run before and after every round.
      init_model: continue training this model: its trees come first, its bin edges are used,
        and round ``r`` of the continuation samples like round ``init_model.num_rounds + r``.
      seed: seeds row and column sampling; round ``r`` uses a key derived from (seed, r).
      deterministic_histogram: on a GPU (or another accelerator), sum the histograms' rows
        (and leaf refits' sums) as whole-number pieces of fixed point (``jaxboost.fixed_point``),
        whose sums are exact, so that two runs grow the same model bit for bit, as XGBoost's
        GPU histograms do. Without it the sums are float atomic adds, whose order varies
        between runs: the last bits of a sum, and through near ties a split, may differ. Each
        value keeps 24 bits relative to the level's largest one; it costs time (1.9x a tree on
        an H100 and an H200; see the README's GPU section). On CPU the rows are always added in one order,
        and this changes nothing.

    On CPU the rows are sharded over one host device per core the process may use (fewer for
    small data); ``with jb.cpu_cores(n):`` around the call caps them at ``n``.

    Returns:
      The trained ``Model``.
    """
    _check_params(num_rounds, max_depth, learning_rate, reg_lambda, reg_alpha, gamma, min_child_weight, subsample,
                  colsample_bytree, colsample_bylevel, colsample_bynode, max_delta_step, scale_pos_weight)
    if hessian not in HESSIAN_MODES:
        raise ValueError(f"hessian must be one of {HESSIAN_MODES}; got {hessian!r}")
    _check_range("hessian_floor", hessian_floor, 0, np.inf, low_open=True, high_open=True)
    check_flag("deterministic_histogram", deterministic_histogram)
    if init_model is not None:
        if not isinstance(init_model, Model):
            raise TypeError(f"init_model must be a jaxboost Model; got {type(init_model).__name__}")
        if isinstance(data, Dataset) and data.bin_edges is not init_model.bin_edges:
            raise ValueError("to continue training, build the Dataset with bin_edges=init_model.bin_edges")
        if not isinstance(data, Dataset):
            data = Dataset(data, y, sample_weight, bin_edges=init_model.bin_edges, base_margin=base_margin)
            y = sample_weight = base_margin = None
    dataset = _as_dataset(data, y, sample_weight, max_bin, base_margin)
    if dataset.y is None:
        raise ValueError("training needs labels: pass y, or a Dataset built with y")
    resolved = resolve_loss(loss, dataset.y, num_outputs, link, loss_params)
    objective = resolved.objective
    K = objective.num_outputs
    if init_model is not None and init_model.num_outputs != K:
        raise ValueError(f"init_model has {init_model.num_outputs} outputs but this loss has {K}")
    if regularizer is None:
        regularizer = Regularization(np.float32(reg_lambda), np.float32(reg_alpha), np.float32(0.0))
    elif not isinstance(regularizer, Regularization):
        raise TypeError("regularizer must come from jb.regularizers (l2, l1, elastic_net, custom)")
    elif reg_lambda != 1.0 or reg_alpha != 0.0:
        raise ValueError("pass either regularizer= or reg_lambda/reg_alpha, not both")
    regularizer = regularizer.with_max_delta_step(max_delta_step)
    check_regularization(regularizer, dataset.n_features)
    monotone = monotone_array(monotone_constraints, dataset.feature_names, dataset.n_features)
    groups = interaction_groups(interaction_constraints, dataset.feature_names, dataset.n_features)
    leaves = vector_leaves(multi_strategy, multi_output_hessian, K, regularizer, monotone)
    if init_model is not None and init_model.params.get("multi_strategy", "one_output_per_tree") != multi_strategy:
        raise ValueError(f"init_model was trained with multi_strategy="
                         f"{init_model.params.get('multi_strategy', 'one_output_per_tree')!r}; continue it with the same")
    mesh = training_row_mesh(dataset.n_rows, dataset.n_features, dataset.max_bin, rows_in_ranges=leaves is None)
    if leaves is not None:
        leaves = dataclasses.replace(leaves, solve_threads=solve_threads(mesh))
    margin = check_base_margin(dataset.base_margin, dataset.n_rows, K)
    train_rows = _DeviceRows(dataset, resolved, mesh, margin=margin, base_score=None,
                             sample_weight=positives_weighted(dataset, scale_pos_weight))
    eval_rows = []
    for entry in eval_set or []:
        X_eval, y_eval = (entry, None) if isinstance(entry, Dataset) else entry
        eval_dataset = _as_dataset(X_eval, y_eval, None, max_bin, None, reference=dataset)
        eval_margin = check_base_margin(eval_dataset.base_margin, eval_dataset.n_rows, K)
        if (eval_margin is None) != (margin is None):
            raise ValueError("eval sets need a base_margin exactly when the training data has one")
        eval_rows.append(_DeviceRows(eval_dataset, resolved, mesh, margin=eval_margin, base_score=None,
                                     evaluation=True))
    metrics = resolve_metrics(eval_metric, resolved, [rows.y.shape for rows in eval_rows])
    if early_stopping_rounds is not None and not eval_rows:
        raise ValueError("early_stopping_rounds needs an eval_set")
    num_nodes = num_heap_nodes(max_depth)
    previous_trees = None if init_model is None else _padded_trees(init_model.trees, num_nodes)

    def start_raw_predictions(base_score: np.ndarray):
        for rows in (train_rows, *eval_rows):
            rows.initial_raw_prediction(base_score)
            if previous_trees is not None:
                _add_tree_predictions(previous_trees, rows, dataset.bin_edges.missing_bin)

    base_score = None  # found below, while the round compiles
    if init_model is not None:
        base_score = np.asarray(init_model.base_score, np.float32)
    elif margin is not None:
        base_score = np.zeros(K, np.float32)
    # A custom loss: whether its leaves are refit depends on its Hessians at the start (some
    # row's exactly zero: absolute error, hinge). A Hessian zero everywhere, as the loss's trace
    # shows, refits them (some row has a positive weight: ``check_sample_weight``). Otherwise
    # the round without the refit, which most losses take, compiles while the start is found,
    # and its derivatives' program then tells (it counts zero Hessians for such a loss); where it
    # tells otherwise, the refit round's programs compile (its derivatives' are the same).
    refit_unknown = leaf_refit is None and resolved.leaf_refit is None
    if refit_unknown and _hessian_vanishes(resolved, train_rows):
        leaf_refit, refit_unknown = True, False
    elif refit_unknown:
        leaf_refit = False
    else:
        leaf_refit = bool(resolved.leaf_refit if leaf_refit is None else leaf_refit)

    shape = RoundShape(objective=objective, max_depth=int(max_depth), max_bin=dataset.max_bin,
                       leaf_refit=leaf_refit,
                       sample_columns=min(colsample_bytree, colsample_bylevel, colsample_bynode) < 1,
                       sample_rows=subsample < 1, metrics=(metrics,) * len(eval_rows), mesh=mesh,
                       hessian_mode=hessian, vector_leaves=leaves, missing_values=dataset.has_missing_values,
                       shared_codes=train_rows.shared_codes,
                       kernel_threads=kernel_threads(mesh, dataset.n_features, dataset.max_bin),
                       kernel_row_ranges=kernel_row_ranges(mesh, dataset.n_features, dataset.max_bin,
                                                           leaves is not None),
                       sample_level_columns=min(colsample_bylevel, colsample_bynode) < 1,
                       feature_slots=tree_feature_slots(colsample_bytree, dataset.n_features),
                       deterministic_histogram=bool(deterministic_histogram), prune_splits=prunes_splits(gamma),
                       counts_zero_hessians=refit_unknown)
    histograms = histogram_buffer(shape, dataset.n_features)
    schedule = _Schedule(learning_rate)
    first_round = 0 if init_model is None else init_model.num_rounds
    f32 = np.float32  # host scalars: jnp.float32 would compile a conversion in a first fit
    params = RoundParams(
        growth=GrowthParams(reg=regularizer, learning_rate=f32(schedule(first_round)), gamma=f32(gamma),
                            min_child_weight=f32(min_child_weight), colsample_bylevel=f32(colsample_bylevel),
                            colsample_bynode=f32(colsample_bynode),
                            monotone=None if monotone is None else jnp.asarray(monotone),
                            interaction_groups=None if groups is None else jnp.asarray(groups)),
        subsample=f32(subsample), colsample_bytree=f32(colsample_bytree), loss_params=resolved.loss_params,
        hessian_floor=f32(hessian_floor))
    params = jax.device_put(params, replicated(mesh))
    seed_key = jax.device_put(seed_key_data(seed), replicated(mesh))

    def round_arguments(params, raw_prediction, eval_raw, round_index, histograms) -> tuple:
        eval_data = tuple((rows.X_binned_device, rows.y_device, rows.sample_weight_device, raw)
                          for rows, raw in zip(eval_rows, eval_raw))
        return (params, train_rows.X_binned_T_device, train_rows.row_offsets_device, train_rows.y_device,
                train_rows.sample_weight_device, train_rows.row_index_device if shape.sample_rows else None,
                raw_prediction, seed_key, np.int32(round_index), eval_data, histograms)

    arguments = round_arguments(params, train_rows.raw_prediction_shape(K),
                                [rows.raw_prediction_shape(K) for rows in eval_rows], first_round, histograms)
    boosting_round = stored_round(shape, arguments) or compiled_round(shape)

    def start() -> np.ndarray:
        """The starting value (and for a custom loss, the raw predictions started from it)."""
        found = _starting_value(resolved, train_rows, mesh) if base_score is None else base_score
        if refit_unknown:
            start_raw_predictions(found)
        return found

    raw_predictions_started = refit_unknown
    # A custom loss's starting value: where the round's programs can find it, they do once
    # compiled, rather than a program of its own compiled beside them.
    way = _round_finds_start(resolved, shape, regularizer, train_rows) if base_score is None and num_rounds else None
    if way is not None:
        found_while_compiling(boosting_round, arguments, lambda: None)
        base_score = _starting_value_by_round(ready(boosting_round), arguments, resolved, train_rows, way)
        if refit_unknown:
            start_raw_predictions(base_score)
    elif base_score is None or refit_unknown:
        base_score = found_while_compiling(boosting_round if num_rounds else None, arguments, start)
    if refit_unknown:
        # The derivatives' program of the round just compiled, rather than a program of its own
        # (0.3 s of compile in a new loss's first fit).
        needs_refit = (ready(boosting_round).zero_hessian(*round_arguments(
            params, train_rows.raw_prediction, [rows.raw_prediction for rows in eval_rows], first_round, histograms))
            if num_rounds else _leaf_refit_needed(resolved, train_rows))
        if needs_refit != leaf_refit:
            leaf_refit = needs_refit
            shape = shape._replace(leaf_refit=leaf_refit)
            boosting_round = stored_round(shape, arguments) or compiled_round(shape)
            if num_rounds:
                # The refit round's new programs (its trees', its refit's) compiled side by side
                # rather than one after the other in its first call: a custom hinge loss's
                # first fit 3.76-4.43 -> 3.67-3.94 s (100k x 28 rows, 4 alternating runs).
                found_while_compiling(boosting_round, arguments, lambda: None)
    boosting_round = ready(boosting_round) if num_rounds else None
    if not raw_predictions_started:
        start_raw_predictions(base_score)

    eval_names = [f"validation_{i}" for i in range(len(eval_rows))]
    history = {name: {metric.name: [] for metric in metrics} for name in eval_names}
    round_trees = RoundTrees(mesh, round_tree_template(shape))

    def stacked_trees() -> Tree:
        grown = round_trees.stacked()
        if previous_trees is None:
            return grown
        return Tree(*(np.concatenate([old, new]) for old, new in zip(previous_trees, grown)))

    def build_model(best_iteration=None) -> Model:
        return Model(trees=stacked_trees(), bin_edges=dataset.bin_edges, base_score=base_score, link=objective.link,
                     loss_name=resolved.name, best_iteration=best_iteration, evals_result=history,
                     params=dict(loss=resolved.name, num_rounds=first_round + len(round_trees), max_depth=max_depth,
                                 learning_rate=learning_rate if not callable(learning_rate) else "schedule",
                                 reg_lambda=float(regularizer.reg_lambda), reg_alpha=float(regularizer.reg_alpha),
                                 gamma=gamma, min_child_weight=min_child_weight, max_bin=dataset.max_bin,
                                 subsample=subsample, colsample_bytree=colsample_bytree,
                                 colsample_bylevel=colsample_bylevel, colsample_bynode=colsample_bynode,
                                 max_delta_step=max_delta_step, scale_pos_weight=scale_pos_weight,
                                 leaf_refit=bool(leaf_refit), hessian=hessian, seed=seed,
                                 deterministic_histogram=bool(deterministic_histogram),
                                 multi_strategy=multi_strategy,
                                 multi_output_hessian=None if leaves is None else multi_output_hessian,
                                 loss_params={name: np.asarray(value).tolist()
                                              for name, value in resolved.loss_params.items()}),
                     feature_names=dataset.feature_names)

    watched = metrics[-1] if metrics else None
    state = TrainingState(num_rounds=num_rounds, first_round=first_round, evals_result=history,
                          watched=None if not eval_names else (eval_names[-1], watched.name,
                                                               higher_is_better(watched)),
                          build_model=build_model)
    all_callbacks = list(callbacks or [])
    if not all(isinstance(callback, Callback) for callback in all_callbacks):
        raise TypeError("callbacks must be jb.callbacks.Callback instances")
    if verbose:
        all_callbacks.append(EvaluationMonitor(1 if verbose is True else int(verbose)))
    if early_stopping_rounds is not None:
        all_callbacks.append(EarlyStopping(early_stopping_rounds))
    for callback in all_callbacks:
        callback.before_training(state)

    # The rounds donate the raw predictions (each overwrites the last), so none is kept here.
    raw_prediction, train_rows.raw_prediction = train_rows.raw_prediction, None
    eval_raw = tuple(rows.raw_prediction for rows in eval_rows)
    # With nothing to read between rounds (no eval sets, no callbacks), a round's health is
    # checked once the next round has been dispatched, so the device never waits for the host.
    defer_health_check = not eval_rows and not all_callbacks
    unchecked = None
    for round_index in range(first_round, first_round + num_rounds):
        state.round_index = round_index
        if any([callback.before_iteration(state) for callback in all_callbacks]):
            break
        if callable(learning_rate) and round_index > first_round:
            params = params._replace(growth=params.growth._replace(
                learning_rate=jax.device_put(f32(schedule(round_index)), replicated(mesh))))
        with collection_paused(round_index == first_round):  # the round compiles in its first call
            raw_prediction, trees, health, eval_raw, metric_values, histograms = boosting_round(
                *round_arguments(params, raw_prediction, eval_raw, round_index, histograms))
        # Ask an accelerator for the flags now: a copy requested only when they are read would
        # queue behind the next round, and the host would wait for that round before dispatching
        # another.
        if round_trees.copy_ahead:
            health.copy_to_host_async()
        if unchecked is not None:
            _raise_if_unhealthy(*unchecked)
        unchecked = (health, resolved.name, round_index)
        if not defer_health_check:
            _raise_if_unhealthy(*unchecked)
            unchecked = None
        round_trees.append(trees)
        release_memory_now_and_then(round_index, dataset.n_rows)
        for name, set_values in zip(eval_names, metric_values):
            for metric, value in zip(metrics, np.asarray(set_values)):
                history[name][metric.name].append(float(value))
        if any([callback.after_iteration(state) for callback in all_callbacks]):
            break
    if unchecked is not None:
        _raise_if_unhealthy(*unchecked)
    for callback in all_callbacks:
        callback.after_training(state)
    model = build_model(state.best_iteration)
    # The rounds' device buffers go now, and their pages back to the system with the arenas'
    # other free pages, rather than sitting in XLA's threads' arenas while the caller predicts.
    train_rows = eval_rows = raw_prediction = eval_raw = histograms = None
    release_free_memory_after(dataset.n_rows)
    return model
