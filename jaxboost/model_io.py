"""Model files: a trained ``Model`` <-> a versioned JSON document or a compact ``.npz`` archive.

The step after training (``Model.save``) and before predicting elsewhere (``jaxboost.load``).
Both formats hold the same record, ``{"format": "jaxboost", "version": 1, ...}``:

* ``trees``: the seven heap arrays (``feature``, ``threshold_bin``, ``default_left``,
  ``is_leaf``, ``value``, ``loss_change``, ``sum_hessians``), each shaped
  ``(rounds, outputs, nodes)``; ``bin_edges``: ``edges`` (``+inf`` padded) and ``n_edges``;
  ``base_score``;
* ``loss_name``, ``link``, ``best_iteration``, ``evals_result``, ``params``, ``feature_names``.

In JSON an array is ``{"dtype": ..., "shape": [...], "data": [flat values]}``. A float32 is
written as the float64 number equal to it (shortest round-trip digits), so it reads back bit for
bit; JSON has no infinity or NaN, so those are the strings ``"inf"``, ``"-inf"`` and ``"nan"``. In ``.npz`` the
arrays are stored natively and the rest is a JSON document in the ``metadata`` entry.

The link is stored by name (``jaxboost.link.LINKS``). A custom link function cannot be stored by
value: the file keeps its function name, saving warns, and loading warns that ``predict``
applies the identity (``predict_raw`` is exact) unless ``jaxboost.load(path, link=function)``
gives the function back. ``params`` is kept as a record of training: values JSON cannot hold
(functions, objects) become their ``repr`` text, tuples become lists.

Loading checks everything before building a ``Model`` and raises ``ModelFormatError`` naming
the problem: not JSON or a truncated file, another format or version, missing keys, wrong
dtypes, shapes or lengths, bin edges out of order, and tree arrays that are not a valid heap
(a split node whose children lie beyond the arrays, a leaf no path reaches, a feature index or
threshold bin out of range, non-finite values). Heap arrays hold no explicit child indices,
so cycles and nodes reached twice cannot occur.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import numbers
import os
import zipfile
import zlib

import numpy as np

from .binning import BinEdges
from .importance import reachable_nodes
from .link import LINKS, resolve_link
from .model import Model
from .tree import Tree, depth_of_heap
from .validation import warn_caller

FORMAT_NAME = "jaxboost"
FORMAT_VERSION = 1
FORMATS = ("json", "npz")

TREE_DTYPES = {"feature": np.int32, "threshold_bin": np.int32, "default_left": np.bool_, "is_leaf": np.bool_,
               "value": np.float32, "loss_change": np.float32, "sum_hessians": np.float32}
# Every array of the record, by its name in the .npz archive; in JSON "a.b" is document["a"]["b"].
ARRAY_DTYPES = {"base_score": np.float32, "bin_edges.edges": np.float32, "bin_edges.n_edges": np.int32,
                **{f"trees.{name}": dtype for name, dtype in TREE_DTYPES.items()}}
METADATA_KEYS = ("loss_name", "link", "best_iteration", "evals_result", "params", "feature_names")
# The Model fields this format version stores; a field added later must be added here too.
SAVED_FIELDS = ("trees", "bin_edges", "base_score", "link", "loss_name", "best_iteration", "evals_result", "params",
                "feature_names")
# Bin codes are uint8 with the missing-value code last, so at most 255 edge slots per feature.
MAX_EDGE_SLOTS = 255
NON_FINITE_TEXT = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


class ModelFormatError(ValueError):
    """A model file or document that is not a valid jaxboost model; the message names the problem."""


# ---------------------------------------------------------------------------------------------
# Writing


def _float_text(value: float):
    """A float as JSON can hold it: the number itself, or "inf" / "-inf" / "nan"."""
    if np.isfinite(value):
        return value
    return "nan" if np.isnan(value) else ("inf" if value > 0 else "-inf")


def _json_safe(value):
    """``value`` with every part JSON can write: numbers, strings, booleans, None, lists, dicts."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _float_text(float(value))
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return repr(value)


def _link_record(link) -> dict:
    for name, function in LINKS.items():
        if link is function:
            return {"name": name}
    function_name = getattr(link, "__name__", type(link).__name__)
    warn_caller(f"the model's link is a custom function ({function_name!r}); the file keeps only its name. "
                "Pass it back with jaxboost.load(path, link=...), or predict() on the loaded model applies the "
                "identity (predict_raw is exact)")
    return {"name": None, "function": function_name}


def _model_arrays(model: Model) -> dict[str, np.ndarray]:
    arrays = {"base_score": model.base_score, "bin_edges.edges": model.bin_edges.edges,
              "bin_edges.n_edges": model.bin_edges.n_edges}
    arrays.update({f"trees.{name}": getattr(model.trees, name) for name in TREE_DTYPES})
    return {name: np.asarray(array).astype(ARRAY_DTYPES[name], copy=False) for name, array in arrays.items()}


def _model_metadata(model: Model) -> dict:
    unsaved = [field.name for field in dataclasses.fields(Model) if field.name not in SAVED_FIELDS
               and not _is_default(getattr(model, field.name), _field_default(field))]
    if unsaved:
        raise NotImplementedError(f"Model fields {unsaved} are not stored by jaxboost model format version "
                                  f"{FORMAT_VERSION}; saving would lose them")
    evals_result = {str(name): {str(metric): [_float_text(float(value)) for value in values]
                                for metric, values in per_set.items()}
                    for name, per_set in model.evals_result.items()}
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "loss_name": str(model.loss_name),
            "link": _link_record(model.link),
            "best_iteration": None if model.best_iteration is None else int(model.best_iteration),
            "evals_result": evals_result, "params": _json_safe(dict(model.params)),
            "feature_names": None if model.feature_names is None else [str(name) for name in model.feature_names]}


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _is_default(value, default) -> bool:
    try:
        return value is default or bool(value == default)
    except (TypeError, ValueError):  # arrays and other values without a single truth value
        return False


def _array_record(array: np.ndarray) -> dict:
    data = array.astype(np.float64).ravel().tolist() if array.dtype.kind == "f" else array.ravel().tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        data = [_float_text(value) for value in data]
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": data}


def model_to_dict(model: Model) -> dict:
    """The JSON document of ``model`` (a dict of JSON values). Raises if the model is not valid."""
    arrays = _model_arrays(model)
    metadata = _model_metadata(model)
    # A model that could not be loaded back must not be written.
    _build_model(metadata, arrays, link=model.link)
    document = dict(metadata)
    for name, array in arrays.items():
        group, _, member = name.partition(".")
        if member:
            document.setdefault(group, {})[member] = _array_record(array)
        else:
            document[name] = _array_record(array)
    return document


def format_of_path(path) -> str:
    """``"npz"`` for a ``.npz`` file name, ``"json"`` for ``.json``."""
    extension = os.path.splitext(os.fspath(path))[1].lower()
    if extension in (".json", ".npz"):
        return extension[1:]
    raise ValueError(f"cannot tell the model format from the file name {os.fspath(path)!r}: use a .json or .npz "
                     "extension, or pass format='json' or 'npz'")


def save_model(model: Model, path, format: str | None = None) -> None:
    """Write ``model`` to ``path``: JSON for ``.json``, a compressed NumPy archive for ``.npz``."""
    if not isinstance(model, Model):
        raise TypeError(f"save_model needs a jaxboost Model; got {type(model).__name__}")
    format = format_of_path(path) if format is None else format
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    if format == "json":
        text = json.dumps(model_to_dict(model), allow_nan=False)
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
        return
    arrays = _model_arrays(model)
    metadata = _model_metadata(model)
    _build_model(metadata, arrays, link=model.link)
    metadata_bytes = np.frombuffer(json.dumps(metadata, allow_nan=False).encode("utf-8"), dtype=np.uint8)
    # A file object keeps NumPy from appending ".npz" to a name chosen by format=.
    with open(path, "wb") as file:
        np.savez_compressed(file, metadata=metadata_bytes, **arrays)


# ---------------------------------------------------------------------------------------------
# Reading


def _decode_floats(data: list, where: str) -> np.ndarray:
    """A JSON list of numbers (non-finite ones as "inf" / "-inf" / "nan") -> float64 array."""
    if all(type(item) is float or type(item) is int for item in data):
        return np.asarray(data, dtype=np.float64)
    decoded = []
    for index, item in enumerate(data):
        if isinstance(item, str) and item in NON_FINITE_TEXT:
            decoded.append(NON_FINITE_TEXT[item])
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            decoded.append(float(item))
        else:
            raise ModelFormatError(f"{where}: element {index} is {item!r}, not a number (wrong dtype)")
    return np.asarray(decoded, dtype=np.float64)


def _to_float32(values: np.ndarray, where: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        as_float32 = values.astype(np.float32)
    overflow = np.isfinite(values) & ~np.isfinite(as_float32)
    if overflow.any():
        raise ModelFormatError(f"{where}: element {int(np.argmax(overflow))} is out of float32 range")
    return as_float32


def _decode_array(record, where: str, dtype) -> np.ndarray:
    """One JSON array record -> a NumPy array of ``dtype``, checking the record's own claims."""
    if not isinstance(record, dict):
        raise ModelFormatError(f"{where}: expected an array record {{dtype, shape, data}}; got {type(record).__name__}")
    for key in ("dtype", "shape", "data"):
        if key not in record:
            raise ModelFormatError(f"{where}: missing key {key!r}")
    expected = np.dtype(dtype).name
    if record["dtype"] != expected:
        raise ModelFormatError(f"{where}: dtype must be {expected!r}; got {record['dtype']!r}")
    shape, data = record["shape"], record["data"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                for n in shape):
        raise ModelFormatError(f"{where}: shape must be a list of non-negative integers; got {shape!r}")
    if not isinstance(data, list):
        raise ModelFormatError(f"{where}: data must be a flat list; got {type(data).__name__}")
    if len(data) != math.prod(shape):
        raise ModelFormatError(f"{where}: data has {len(data)} values but shape {shape} needs {math.prod(shape)} "
                               "(truncated or wrong length)")
    if np.dtype(dtype).kind == "f":
        return _to_float32(_decode_floats(data, where), where).reshape(shape)
    try:
        values = np.asarray(data)
    except (TypeError, ValueError):
        values = None
    wanted_kind = "b" if np.dtype(dtype).kind == "b" else "i"
    if values is not None and values.size == 0:
        return np.zeros(shape, dtype)
    if values is None or values.ndim != 1 or values.dtype.kind != wanted_kind:
        what = "booleans" if wanted_kind == "b" else "integers"
        raise ModelFormatError(f"{where}: data must be a flat list of {what} ({expected}) (wrong dtype)")
    if wanted_kind == "i" and (values.min() < np.iinfo(dtype).min or values.max() > np.iinfo(dtype).max):
        raise ModelFormatError(f"{where}: values out of {expected} range")
    return values.astype(dtype).reshape(shape)


def _json_arrays(document: dict) -> dict[str, np.ndarray]:
    arrays = {}
    for name, dtype in ARRAY_DTYPES.items():
        group, _, member = name.partition(".")
        if group not in document:
            raise ModelFormatError(f"missing key {group!r}")
        record = document[group]
        if member:
            if not isinstance(record, dict):
                raise ModelFormatError(f"{group!r} must be an object holding {member!r}")
            if member not in record:
                raise ModelFormatError(f"missing key {name!r}")
            record = record[member]
        arrays[name] = _decode_array(record, name, dtype)
    return arrays


def _check_header(document) -> None:
    if not isinstance(document, dict):
        raise ModelFormatError(f"a jaxboost model document is a JSON object; got {type(document).__name__}")
    if document.get("format") != FORMAT_NAME:
        raise ModelFormatError(f"not a jaxboost model: 'format' is {document.get('format')!r}, expected "
                               f"{FORMAT_NAME!r}")
    version = document.get("version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ModelFormatError(f"unsupported jaxboost model format version {version!r}; this jaxboost reads "
                               f"version {FORMAT_VERSION}")
    for key in METADATA_KEYS:
        if key not in document:
            raise ModelFormatError(f"missing key {key!r}")


def _check_array_shapes(arrays: dict[str, np.ndarray]) -> tuple[int, int, int, int, int]:
    """Dtypes and shapes of all arrays; returns ``(rounds, outputs, nodes, n_features, edge_slots)``."""
    for name, dtype in ARRAY_DTYPES.items():
        if arrays[name].dtype != np.dtype(dtype):
            raise ModelFormatError(f"{name}: dtype must be {np.dtype(dtype).name}; got {arrays[name].dtype.name} "
                                   "(wrong dtype)")
    base_score, edges, n_edges = arrays["base_score"], arrays["bin_edges.edges"], arrays["bin_edges.n_edges"]
    if base_score.ndim != 1 or base_score.shape[0] < 1:
        raise ModelFormatError(f"base_score must have shape (outputs,) with at least one output; got "
                               f"{base_score.shape}")
    if edges.ndim != 2 or edges.shape[0] < 1 or not 1 <= edges.shape[1] <= MAX_EDGE_SLOTS:
        raise ModelFormatError(f"bin_edges.edges must have shape (n_features >= 1, 1..{MAX_EDGE_SLOTS} edge slots); "
                               f"got {edges.shape}")
    n_features, edge_slots = edges.shape
    if n_edges.shape != (n_features,):
        raise ModelFormatError(f"bin_edges.n_edges must have shape ({n_features},), one count per feature; got "
                               f"{n_edges.shape}")
    tree_shape = arrays["trees.feature"].shape
    if len(tree_shape) != 3:
        raise ModelFormatError(f"trees.feature must have shape (rounds, outputs, nodes); got {tree_shape}")
    for name in TREE_DTYPES:
        if arrays[f"trees.{name}"].shape != tree_shape:
            raise ModelFormatError(f"trees.{name} has shape {arrays[f'trees.{name}'].shape} but trees.feature has "
                                   f"{tree_shape}: every tree array must have the same shape")
    rounds, outputs, nodes = tree_shape
    if outputs != base_score.shape[0]:
        raise ModelFormatError(f"the trees have {outputs} outputs per round but base_score has {base_score.shape[0]}")
    if nodes < 1 or nodes + 1 != 2 ** (depth_of_heap(nodes) + 1):
        raise ModelFormatError(f"trees have {nodes} nodes per tree; a heap of depth D has 2^(D+1) - 1")
    return rounds, outputs, nodes, n_features, edge_slots


def _check_bin_edges(edges: np.ndarray, n_edges: np.ndarray) -> None:
    edge_slots = edges.shape[1]
    bad = (n_edges < 0) | (n_edges >= edge_slots)
    if bad.any():
        feature = int(np.argmax(bad))
        raise ModelFormatError(f"bin_edges.n_edges[{feature}] = {int(n_edges[feature])} must be in "
                               f"0..{edge_slots - 1} (the last edge slot is padding before the missing-value bin)")
    for feature in range(edges.shape[0]):
        real, padding = edges[feature, : n_edges[feature]], edges[feature, n_edges[feature]:]
        if not np.isfinite(real).all():
            raise ModelFormatError(f"bin_edges.edges[{feature}]: the {int(n_edges[feature])} real edges must be finite")
        if (np.diff(real) < 0).any():
            raise ModelFormatError(f"bin_edges.edges[{feature}]: edges must be in increasing order")
        if not (padding == np.inf).all():
            raise ModelFormatError(f"bin_edges.edges[{feature}]: slots after the {int(n_edges[feature])} real edges "
                                   "must be +inf padding")


def _first_node(mask: np.ndarray) -> str:
    round_index, output, node = np.argwhere(mask)[0]
    return f"round {round_index}, output {output}, node {node}"


def _check_trees(trees: Tree, n_features: int, edge_slots: int) -> None:
    """The heap arrays describe trees a row can walk: see the module docstring."""
    nodes = trees.is_leaf.shape[-1]
    reachable = reachable_nodes(trees.is_leaf)
    splits = reachable & ~trees.is_leaf
    last_level_start = (nodes - 1) // 2
    beyond = splits.copy()
    beyond[..., :last_level_start] = False
    if beyond.any():
        node = np.argwhere(beyond)[0][2]
        raise ModelFormatError(f"trees: {_first_node(beyond)} is a split node but its children {2 * node + 1} and "
                               f"{2 * node + 2} are beyond the {nodes}-node arrays (child index out of range)")
    orphan = trees.is_leaf & ~reachable
    if orphan.any():
        raise ModelFormatError(f"trees: {_first_node(orphan)} is a leaf that no path from the root reaches")
    bad_feature = splits & ((trees.feature < 0) | (trees.feature >= n_features))
    if bad_feature.any():
        index = tuple(np.argwhere(bad_feature)[0])
        raise ModelFormatError(f"trees.feature: {_first_node(bad_feature)} splits on feature "
                               f"{int(trees.feature[index])}; the model has features 0..{n_features - 1}")
    bad_threshold = splits & ((trees.threshold_bin < 0) | (trees.threshold_bin >= edge_slots))
    if bad_threshold.any():
        index = tuple(np.argwhere(bad_threshold)[0])
        raise ModelFormatError(f"trees.threshold_bin: {_first_node(bad_threshold)} has threshold bin "
                               f"{int(trees.threshold_bin[index])}; bins are 0..{edge_slots - 1}")
    for name in ("value", "loss_change", "sum_hessians"):
        non_finite = reachable & ~np.isfinite(getattr(trees, name))
        if non_finite.any():
            raise ModelFormatError(f"trees.{name}: {_first_node(non_finite)} is not finite")


def _float_list(values, where: str) -> list[float]:
    if not isinstance(values, list):
        raise ModelFormatError(f"{where} must be a list of numbers; got {type(values).__name__}")
    return _decode_floats(values, where).tolist()


def _check_metadata(metadata: dict, rounds: int, n_features: int, link) -> dict:
    """The non-array fields as Model arguments."""
    loss_name = metadata["loss_name"]
    if not isinstance(loss_name, str):
        raise ModelFormatError(f"loss_name must be a string; got {loss_name!r}")
    link_function = _link_function(metadata["link"], link)
    best_iteration = metadata["best_iteration"]
    if best_iteration is not None and (not isinstance(best_iteration, int) or isinstance(best_iteration, bool)
                                       or not 0 <= best_iteration < rounds):
        raise ModelFormatError(f"best_iteration must be null or a round index in 0..{rounds - 1}; got "
                               f"{best_iteration!r}")
    evals_result = metadata["evals_result"]
    if not isinstance(evals_result, dict) or not all(isinstance(per_set, dict) for per_set in evals_result.values()):
        raise ModelFormatError("evals_result must be {eval name: {metric name: [values]}}")
    evals_result = {name: {metric: _float_list(values, f"evals_result[{name!r}][{metric!r}]")
                           for metric, values in per_set.items()} for name, per_set in evals_result.items()}
    params = metadata["params"]
    if not isinstance(params, dict):
        raise ModelFormatError(f"params must be an object; got {type(params).__name__}")
    feature_names = metadata["feature_names"]
    if feature_names is not None:
        if not isinstance(feature_names, list) or not all(isinstance(name, str) for name in feature_names):
            raise ModelFormatError("feature_names must be null or a list of strings")
        if len(feature_names) != n_features:
            raise ModelFormatError(f"feature_names has {len(feature_names)} names but the model has {n_features} "
                                   "features")
        feature_names = tuple(feature_names)
    return dict(loss_name=loss_name, link=link_function, best_iteration=best_iteration, evals_result=evals_result,
                params=params, feature_names=feature_names)


def _link_function(record, link):
    if not isinstance(record, dict) or "name" not in record:
        raise ModelFormatError(f"link must be an object with a 'name'; got {record!r}")
    name = record["name"]
    if link is not None:
        return resolve_link(link)
    if name is None:
        function_name = record.get("function", "?")
        warn_caller(f"the model was trained with a custom link function ({function_name!r}) that a file cannot "
                    "hold: predict() applies the identity (predict_raw is exact). Pass the function with "
                    "jaxboost.load(path, link=...)")
        return LINKS["identity"]
    if name not in LINKS:
        raise ModelFormatError(f"unknown link {name!r}; known links: {sorted(LINKS)}")
    return LINKS[name]


def _build_model(metadata: dict, arrays: dict[str, np.ndarray], link=None) -> Model:
    """Validate a header/metadata dict and the named arrays, then build the Model."""
    _check_header(metadata)
    for name in ARRAY_DTYPES:
        if name not in arrays:
            raise ModelFormatError(f"missing key {name!r}")
    rounds, _, _, n_features, edge_slots = _check_array_shapes(arrays)
    base_score = arrays["base_score"]
    if not np.isfinite(base_score).all():
        raise ModelFormatError("base_score is not finite")
    edges, n_edges = arrays["bin_edges.edges"], arrays["bin_edges.n_edges"]
    _check_bin_edges(edges, n_edges)
    trees = Tree(*(np.ascontiguousarray(arrays[f"trees.{name}"]) for name in TREE_DTYPES))
    _check_trees(trees, n_features, edge_slots)
    return Model(trees=trees, bin_edges=BinEdges(edges=np.ascontiguousarray(edges), n_edges=n_edges),
                 base_score=base_score, **_check_metadata(metadata, rounds, n_features, link))


def model_from_dict(document, *, link=None) -> Model:
    """The Model of a JSON document (as ``model_to_dict`` writes it), validated."""
    _check_header(document)
    return _build_model(document, _json_arrays(document), link=link)


def _load_npz(content: bytes, link) -> Model:
    try:
        with np.load(io.BytesIO(content), allow_pickle=False) as archive:
            missing = [name for name in ("metadata", *ARRAY_DTYPES) if name not in archive.files]
            if missing:
                raise ModelFormatError(f"missing key {missing[0]!r} in the .npz archive")
            arrays = {name: archive[name] for name in ARRAY_DTYPES}
            metadata_bytes = archive["metadata"]
    except ModelFormatError:
        raise
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as error:
        raise ModelFormatError(f"not a readable .npz model archive (truncated or corrupt?): {error}") from error
    if metadata_bytes.dtype != np.uint8 or metadata_bytes.ndim != 1:
        raise ModelFormatError("metadata must be the UTF-8 bytes of a JSON object (uint8, 1-D)")
    metadata = _parse_json(metadata_bytes.tobytes(), "the .npz metadata")
    return _build_model(metadata, arrays, link=link)


def _parse_json(content: bytes, what: str):
    try:
        return json.loads(content.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ModelFormatError(f"{what} is not UTF-8 text: {error}") from error
    except json.JSONDecodeError as error:
        raise ModelFormatError(f"{what} is not valid JSON (truncated or corrupt?): {error}") from error


def load(path, *, link=None) -> Model:
    """Load a model written by ``Model.save``; the format (JSON or ``.npz``) is read from the file.

    Args:
      path: the file.
      link: the inverse link for ``predict``, a name or a JAX function: needed for a model trained
        with a custom link function (the file holds only its name); overrides the stored link.

    Raises:
      ModelFormatError: the file is not a valid jaxboost model; the message names the problem.
    """
    with open(path, "rb") as file:
        content = file.read()
    if content.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # a zip archive: .npz
        return _load_npz(content, link)
    return model_from_dict(_parse_json(content, os.fspath(path)), link=link)
