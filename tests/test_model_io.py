"""Model files (JSON and .npz): exact round trips, and a clear ModelFormatError for every kind of
damage; round slicing ``model[a:b]`` against ``predict_raw(iteration_range=(a, b))``."""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import model_io

N_ROWS, N_FEATURES, DEPTH = 400, 4, 3


def _features(seed, with_missing=False):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N_ROWS, N_FEATURES)).astype(np.float32)
    if with_missing:
        X[rng.random(X.shape) < 0.15] = np.nan
    return X, rng


@pytest.fixture(scope="module")
def regression():
    X, rng = _features(0, with_missing=True)
    filled = np.nan_to_num(X, nan=2.0)
    y = 2.0 * filled[:, 0] + np.sin(3 * filled[:, 1]) + rng.normal(scale=0.3, size=N_ROWS)
    model = jb.train(X, y, num_rounds=6, max_depth=DEPTH, learning_rate=0.3)
    assert np.isnan(X).any() and model.trees.default_left.any()
    return model, X


@pytest.fixture(scope="module")
def binary_early_stopped():
    X, rng = _features(1)
    y = (rng.random(N_ROWS) < 1 / (1 + np.exp(-X[:, 0]))).astype(np.float32)
    X_valid, rng_valid = _features(2)
    y_valid = (rng_valid.random(N_ROWS) < 1 / (1 + np.exp(-X_valid[:, 0]))).astype(np.float32)
    model = jb.train(X, y, loss="logistic", num_rounds=40, max_depth=DEPTH, learning_rate=1.0,
                     eval_set=[(X_valid, y_valid)], eval_metric=["error", "logloss"],
                     early_stopping_rounds=3)
    assert model.best_iteration is not None and model.best_iteration < model.num_rounds - 1
    return model, X_valid


@pytest.fixture(scope="module")
def multiclass():
    X, _ = _features(3)
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5)
    model = jb.train(X, y, loss="softmax", num_rounds=3, max_depth=2, learning_rate=0.5)
    assert model.num_outputs == 3
    return model, X


def _save_load(model, path, **load_options):
    model.save(path)
    return jb.load(path, **load_options)


def _assert_same_model(loaded, model):
    for name in jb.model_io.TREE_DTYPES:
        original, restored = np.asarray(getattr(model.trees, name)), getattr(loaded.trees, name)
        assert restored.dtype == original.dtype and restored.shape == original.shape, name
        # Bit-exact: compare the raw bytes, so -0.0 and every float32 digit must survive.
        assert restored.tobytes() == original.tobytes(), name
    assert loaded.bin_edges.edges.tobytes() == np.asarray(model.bin_edges.edges).tobytes()
    np.testing.assert_array_equal(loaded.bin_edges.n_edges, model.bin_edges.n_edges)
    assert loaded.base_score.tobytes() == np.asarray(model.base_score, np.float32).tobytes()
    assert loaded.link is model.link
    assert (loaded.loss_name, loaded.best_iteration, loaded.feature_names) == \
           (model.loss_name, model.best_iteration, model.feature_names)
    assert loaded.evals_result == model.evals_result
    assert loaded.params == json.loads(json.dumps(model_io._json_safe(model.params)))


@pytest.mark.parametrize("extension", ["json", "npz"])
@pytest.mark.parametrize("fixture", ["regression", "binary_early_stopped", "multiclass"])
def test_round_trip_predicts_exactly(fixture, extension, request, tmp_path):
    model, X = request.getfixturevalue(fixture)
    loaded = _save_load(model, tmp_path / f"model.{extension}")
    _assert_same_model(loaded, model)
    np.testing.assert_array_equal(loaded.predict_raw(X), model.predict_raw(X))
    np.testing.assert_array_equal(loaded.predict(X), model.predict(X))
    np.testing.assert_array_equal(loaded.predict_raw(X, iteration_range=(0, model.num_rounds)),
                                  model.predict_raw(X, iteration_range=(0, model.num_rounds)))


@pytest.mark.parametrize("fixture", ["regression", "binary_early_stopped", "multiclass"])
def test_pickle_round_trip_predicts_exactly(fixture, request):
    import pickle

    model, X = request.getfixturevalue(fixture)
    restored = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(restored.predict(X), model.predict(X))
    assert restored.link is model.link


def test_round_trip_keeps_inf_padding_and_early_stopping(binary_early_stopped, tmp_path):
    model, _ = binary_early_stopped
    assert np.isinf(model.bin_edges.edges).any()
    loaded = _save_load(model, tmp_path / "model.json")
    assert loaded.best_iteration == model.best_iteration
    assert np.array_equal(np.isinf(loaded.bin_edges.edges), np.isinf(model.bin_edges.edges))
    text = (tmp_path / "model.json").read_text()
    assert "Infinity" not in text and "NaN" not in text  # strict JSON: non-finite values are strings
    document = json.loads(text)
    assert (document["format"], document["version"]) == ("jaxboost", 1)


def test_odd_float_values_round_trip_bit_exactly(regression, tmp_path):
    model, X = regression
    odd = np.array([-0.0, 1e-45, np.float32(0.1), np.finfo(np.float32).max, -3.4028235e38, 1 / 3],
                   np.float32)
    values = np.asarray(model.trees.value).copy()
    leaves = np.argwhere(model.trees.is_leaf)[: len(odd)]
    values[tuple(leaves.T)] = odd
    edited = dataclasses.replace(model, trees=model.trees._replace(value=values))
    for extension in ("json", "npz"):
        loaded = _save_load(edited, tmp_path / f"odd.{extension}")
        assert loaded.trees.value.tobytes() == values.tobytes()
        np.testing.assert_array_equal(loaded.predict_raw(X), edited.predict_raw(X))


def test_feature_names_and_params_round_trip(regression, tmp_path):
    model, _ = regression
    named = dataclasses.replace(model, feature_names=("age", "income", "x 3", "ünïcode"),
                                params={**model.params, "learning_rate": np.float32(0.25), "extra": (1, 2),
                                        "nan_param": float("nan"), "function": np.sum})
    loaded = _save_load(named, tmp_path / "named.json")
    assert loaded.feature_names == ("age", "income", "x 3", "ünïcode")
    assert loaded.params["learning_rate"] == 0.25 and loaded.params["extra"] == [1, 2]
    assert loaded.params["nan_param"] == "nan" and "sum" in loaded.params["function"]
    assert loaded.feature_importance("weight").keys() <= set(named.feature_names)


def test_custom_link_warns_and_load_accepts_the_function(regression, tmp_path):
    model, X = regression

    def doubled(raw_prediction):
        return 2.0 * raw_prediction

    custom = dataclasses.replace(model, link=doubled)
    path = tmp_path / "custom.json"
    with pytest.warns(UserWarning, match="custom function") as saved:
        custom.save(path)
    with pytest.warns(UserWarning, match="applies the identity") as loaded:
        fallback = jb.load(path)
    assert {w.filename for w in list(saved) + list(loaded)} == {__file__}  # the caller's lines
    np.testing.assert_array_equal(fallback.predict(X), custom.predict_raw(X))
    restored = jb.load(path, link=doubled)
    np.testing.assert_array_equal(restored.predict(X), custom.predict(X))


def test_format_is_chosen_by_extension(regression, tmp_path):
    model, X = regression
    model.save(tmp_path / "a.npz")
    assert (tmp_path / "a.npz").read_bytes()[:2] == b"PK"
    model.save(tmp_path / "b.json")
    assert json.loads((tmp_path / "b.json").read_text())["format"] == "jaxboost"
    model.save(tmp_path / "c.bin", format="npz")
    np.testing.assert_array_equal(jb.load(tmp_path / "c.bin").predict_raw(X), model.predict_raw(X))
    with pytest.raises(ValueError, match="extension"):
        model.save(tmp_path / "d.model")


def test_every_model_field_is_saved():
    # A field added to Model must be added to the file format (and this list) too.
    assert {field.name for field in dataclasses.fields(jb.Model)} == set(model_io.SAVED_FIELDS)


# ---------------------------------------------------------------------------------------------
# Damaged documents


@pytest.fixture(scope="module")
def document(regression):
    return model_io.model_to_dict(regression[0])


def _set(document, field, index, value):
    record = document["trees"][field]
    flat = int(np.ravel_multi_index(index, record["shape"]))
    record["data"][flat] = value


def _tree_array(document, field):
    record = document["trees"][field]
    return np.asarray(record["data"]).reshape(record["shape"])


def _root_split(document):
    is_leaf = _tree_array(document, "is_leaf")
    index = np.argwhere(~is_leaf[..., 0])[0]
    return (int(index[0]), int(index[1]), 0)


def _a_leaf(document):
    is_leaf = _tree_array(document, "is_leaf")
    return tuple(int(i) for i in np.argwhere(is_leaf)[0])


def _damage(document, change):
    damaged = copy.deepcopy(document)
    change(damaged)
    return damaged


def _deepest_leaf(document):
    is_leaf = _tree_array(document, "is_leaf")
    nodes = is_leaf.shape[-1]
    last = np.argwhere(is_leaf[..., (nodes - 1) // 2:])[0]
    return (int(last[0]), int(last[1]), int(last[2]) + (nodes - 1) // 2)


def _drop_last_node(record):
    rounds, outputs, nodes = record["shape"]
    record.update(shape=[rounds, outputs, nodes - 1],
                  data=np.asarray(record["data"]).reshape(rounds, outputs, nodes)[..., :-1].ravel().tolist())


DAMAGE = {
    "wrong format name": (lambda d: d.update(format="xgboost"), "not a jaxboost model"),
    "unsupported version": (lambda d: d.update(version=2), "unsupported .* version 2"),
    "missing key": (lambda d: d.pop("base_score"), "missing key 'base_score'"),
    "missing tree field": (lambda d: d["trees"].pop("sum_hessians"), "missing key 'trees.sum_hessians'"),
    "missing metadata key": (lambda d: d.pop("link"), "missing key 'link'"),
    "short data": (lambda d: d["trees"]["value"]["data"].pop(), "trees.value: data has"),
    "wrong shape": (lambda d: d["trees"]["value"].update(
        shape=[1, d["trees"]["value"]["shape"][0] * d["trees"]["value"]["shape"][1], d["trees"]["value"]["shape"][2]]),
        "same shape"),
    "n_edges length": (lambda d: d["bin_edges"]["n_edges"].update(data=d["bin_edges"]["n_edges"]["data"][:-1],
                                                                  shape=[N_FEATURES - 1]), "n_edges must have shape"),
    "outputs disagree": (lambda d: d["base_score"].update(data=[0.0, 0.0], shape=[2]), "outputs"),
    "not a heap size": (lambda d: [_drop_last_node(d["trees"][f]) for f in model_io.TREE_DTYPES],
                        "2\\^\\(D\\+1\\) - 1"),
    "children beyond the arrays": (lambda d: _set(d, "is_leaf", _deepest_leaf(d), False), "child index out of range"),
    # A root turned into a leaf leaves the leaves below it unreachable.
    "leaf nobody reaches": (lambda d: _set(d, "is_leaf", _root_split(d), True), "no path from the root reaches"),
    "negative feature": (lambda d: _set(d, "feature", _root_split(d), -1), "splits on feature -1"),
    "feature too large": (lambda d: _set(d, "feature", _root_split(d), N_FEATURES), f"splits on feature {N_FEATURES}"),
    "threshold bin too large": (lambda d: _set(d, "threshold_bin", _root_split(d), 255), "threshold bin 255"),
    "negative threshold bin": (lambda d: _set(d, "threshold_bin", _root_split(d), -3), "threshold bin -3"),
    "NaN leaf value": (lambda d: _set(d, "value", _a_leaf(d), "nan"), "trees.value: .* not finite"),
    "infinite leaf value": (lambda d: _set(d, "value", _a_leaf(d), "inf"), "trees.value: .* not finite"),
    "float feature": (lambda d: _set(d, "feature", _root_split(d), 1.5), "trees.feature: .*wrong dtype"),
    "int for bool": (lambda d: _set(d, "is_leaf", _a_leaf(d), 1), "trees.is_leaf: .*wrong dtype"),
    "string value": (lambda d: _set(d, "value", _a_leaf(d), "0.5"), "trees.value: element .*wrong dtype"),
    "dtype field": (lambda d: d["trees"]["feature"].update(dtype="int64"), "dtype must be 'int32'"),
    "unsorted edges": (lambda d: d["bin_edges"]["edges"]["data"].__setitem__(0, 1e6), "increasing order"),
    "padding not inf": (lambda d: d["bin_edges"]["edges"]["data"].__setitem__(
        len(d["bin_edges"]["edges"]["data"]) - 1, 0.0), "must be \\+inf padding"),
    "best_iteration out of range": (lambda d: d.update(best_iteration=99), "best_iteration"),
    "unknown link": (lambda d: d.update(link={"name": "tanh"}), "unknown link 'tanh'"),
    "feature_names length": (lambda d: d.update(feature_names=["a"]), "feature_names has 1 names"),
    "evals_result values": (lambda d: d.update(evals_result={"validation_0": {"rmse": [None]}}), "not a number"),
    "no format at all": (lambda d: d.pop("format"), "not a jaxboost model"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_document_raises_model_format_error(case, document, tmp_path):
    change, message = DAMAGE[case]
    damaged = _damage(document, change)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(damaged))
    with pytest.raises(jb.ModelFormatError, match=message):
        jb.load(path)
    assert issubclass(jb.ModelFormatError, ValueError)


def test_undamaged_document_loads(document, regression):
    # The damage helpers change a loadable document: without damage it loads and predicts the same.
    model, X = regression
    np.testing.assert_array_equal(model_io.model_from_dict(copy.deepcopy(document)).predict_raw(X),
                                  model.predict_raw(X))


@pytest.mark.parametrize("extension", ["json", "npz"])
def test_truncated_file_raises_model_format_error(regression, extension, tmp_path):
    path = tmp_path / f"model.{extension}"
    regression[0].save(path)
    content = path.read_bytes()
    for keep in (len(content) // 2, len(content) - 5, 10):
        path.write_bytes(content[:keep])
        with pytest.raises(jb.ModelFormatError, match="truncated or corrupt"):
            jb.load(path)


def test_not_json_raises_model_format_error(tmp_path):
    path = tmp_path / "model.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(jb.ModelFormatError, match="not UTF-8"):
        jb.load(path)
    path.write_text("[1, 2, 3]")
    with pytest.raises(jb.ModelFormatError, match="JSON object"):
        jb.load(path)
    with pytest.raises(FileNotFoundError):
        jb.load(tmp_path / "absent.json")


def _rewrite_npz(source, target, **changes):
    with np.load(source) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays.update(changes)
    for name in [name for name, value in changes.items() if value is None]:
        del arrays[name]
    np.savez(target, **arrays)


def test_damaged_npz_raises_model_format_error(regression, tmp_path):
    model, _ = regression
    source = tmp_path / "model.npz"
    model.save(source)
    feature = np.asarray(model.trees.feature)
    root_split = tuple(np.argwhere(~np.asarray(model.trees.is_leaf)[..., 0])[0]) + (0,)
    bad_feature = feature.copy()
    bad_feature[root_split] = N_FEATURES + 3
    bad_value = np.asarray(model.trees.value).copy()
    bad_value[tuple(np.argwhere(model.trees.is_leaf)[0])] = np.nan
    metadata = json.loads(bytes(np.load(source)["metadata"]).decode())
    cases = {
        "feature index": (dict(**{"trees.feature": bad_feature}), f"splits on feature {N_FEATURES + 3}"),
        "dtype": (dict(**{"trees.feature": feature.astype(np.int64)}), "dtype must be int32"),
        "float for bool": (dict(**{"trees.is_leaf": np.asarray(model.trees.is_leaf, np.float32)}), "wrong dtype"),
        "non-finite leaf": (dict(**{"trees.value": bad_value}), "trees.value: .* not finite"),
        "shape": (dict(**{"trees.value": bad_value[:, :, :7]}), "same shape"),
        "missing array": (dict(**{"bin_edges.n_edges": None}), "missing key 'bin_edges.n_edges'"),
        "version": (dict(metadata=np.frombuffer(json.dumps({**metadata, "version": 7}).encode(), np.uint8)),
                    "version 7"),
        "metadata not JSON": (dict(metadata=np.frombuffer(b"{not json", np.uint8)), "not valid JSON"),
    }
    for case, (changes, message) in cases.items():
        target = tmp_path / f"{case}.npz"
        _rewrite_npz(source, target, **changes)
        with pytest.raises(jb.ModelFormatError, match=message):
            jb.load(target)


def test_saving_an_invalid_model_raises(regression, tmp_path):
    model, _ = regression
    values = np.asarray(model.trees.value).copy()
    values[tuple(np.argwhere(model.trees.is_leaf)[0])] = np.inf
    with pytest.raises(jb.ModelFormatError, match="not finite"):
        dataclasses.replace(model, trees=model.trees._replace(value=values)).save(tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


# ---------------------------------------------------------------------------------------------
# Slicing


@pytest.mark.parametrize("fixture", ["regression", "multiclass"])
def test_slice_predicts_like_iteration_range(fixture, request):
    model, X = request.getfixturevalue(fixture)
    rounds = model.num_rounds
    cases = [(slice(1, 3), (1, 3)), (slice(None, 2), (0, 2)), (slice(-2, None), (rounds - 2, rounds)),
             (slice(0, -1), (0, rounds - 1)), (slice(1, 100), (1, rounds)), (0, (0, 1)), (-1, (rounds - 1, rounds)),
             (slice(2, 2), (2, 2)), (slice(None), (0, rounds))]
    for index, (start, stop) in cases:
        sliced = model[index]
        assert sliced.num_rounds == stop - start and sliced.best_iteration is None
        np.testing.assert_array_equal(sliced.base_score, model.base_score)
        np.testing.assert_array_equal(sliced.predict_raw(X), model.predict_raw(X, iteration_range=(start, stop)))
        np.testing.assert_array_equal(sliced.trees.value, np.asarray(model.trees.value)[start:stop])


def test_slice_of_early_stopped_model(binary_early_stopped):
    model, X = binary_early_stopped
    best = model.best_iteration
    head = model[: best + 1]
    assert head.best_iteration is None and head.num_rounds == best + 1
    np.testing.assert_array_equal(head.predict(X), model.predict(X))
    assert all(len(values) == best + 1 for values in head.evals_result["validation_0"].values())
    assert model[1:].evals_result == {}
    # Slices go by the full model, not by best_iteration.
    assert model[:].num_rounds == model.num_rounds


def test_bad_slices_raise(regression):
    model, _ = regression
    with pytest.raises(ValueError, match="step"):
        model[0:4:2]
    with pytest.raises(IndexError, match="outside"):
        model[model.num_rounds]
    with pytest.raises(IndexError, match="outside"):
        model[-model.num_rounds - 1]
    with pytest.raises(TypeError, match="slice"):
        model["0"]


def test_slice_saves_and_loads(regression, tmp_path):
    model, X = regression
    loaded = _save_load(model[1:3], tmp_path / "slice.npz")
    np.testing.assert_array_equal(loaded.predict_raw(X), model.predict_raw(X, iteration_range=(1, 3)))
    for extension in ("json", "npz"):
        empty = _save_load(model[2:2], tmp_path / f"empty.{extension}")
        assert empty.num_rounds == 0
        np.testing.assert_array_equal(empty.predict_raw(X), np.full(len(X), model.base_score[0]))


def test_slices_compose_with_jax_tree_arrays(regression):
    model, X = regression
    as_jax = dataclasses.replace(model, trees=jax.tree_util.tree_map(jax.numpy.asarray, model.trees))
    np.testing.assert_array_equal(as_jax[2:4].predict_raw(X), model.predict_raw(X, iteration_range=(2, 4)))
