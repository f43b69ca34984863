"""The program store (``jaxboost.program_store``): a fit's programs (its round and starting
value, ``train_many``'s round) lowered once, loaded by later processes instead of traced, giving
the same models; settings that change a program change its key; programs whose meaning lies in
user code are never stored."""

import collections
import functools
import os
import pickle
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import losses, program_store
from jaxboost.program_store import NotStorable, describe

pytest.importorskip("flatbuffers")


def test_descriptions_name_jaxboost_code_and_refuse_user_code(monkeypatch):
    logistic = losses.get("logistic").function
    assert describe(logistic) == f"function:{logistic.__module__}:logistic"
    # Bound parameters are part of the description; array values are not (they are traced).
    tau = [describe(functools.partial(losses.quantile, tau=t)) for t in (0.5, 0.9)]
    assert tau[0] != tau[1]
    assert describe(np.zeros((3, 2), np.float32)) == describe(np.ones((3, 2), np.float32))
    assert describe(np.zeros((3, 2), np.float32)) != describe(np.zeros((3, 3), np.float32))
    assert describe(np.float32(1.0)) != describe(np.float32(2.0))

    def user_loss(raw_prediction, y):
        return (raw_prediction - y) ** 2

    for user_value in (user_loss, lambda r, y: r, functools.partial(user_loss), object(), {1: 2}):
        with pytest.raises(NotStorable):
            describe(user_value)
    # A jaxboost function replaced at run time is not the function its name says.
    quantile = losses.BUILTINS["quantile"].function
    monkeypatch.setattr(sys.modules[quantile.__module__], "quantile", lambda raw_prediction, y, tau: raw_prediction)
    with pytest.raises(NotStorable):
        describe(quantile)


def _fit_in_process(tmp_path, monkeypatch, store: str, loss="logistic", return_model=False, **settings):
    monkeypatch.setenv("JAXBOOST_PROGRAM_STORE", store)
    monkeypatch.setenv("JAXBOOST_CACHE_DIR", str(tmp_path))
    program_store._IN_PROCESS.clear()
    rng = np.random.default_rng(3)
    X = rng.normal(size=(257, 5)).astype(np.float32)
    y = (X[:, 0] + 0.5 * rng.normal(size=257) > 0).astype(np.float32)
    model = jb.train(X, y, loss=loss, num_rounds=3, **{"max_depth": 3, **settings})
    return model if return_model else model.predict_raw(X)


def _stored_forms(folder, suffix) -> list:
    """The names of the programs stored in ``folder`` in the form of ``suffix``."""
    return sorted(path.stem for path in folder.glob("*" + suffix))


def _stored_programs(folder) -> list:
    """The stored programs' names: on a CPU, a program compiled by this process has its
    executable stored, one loaded from JAX's persistent cache its exported form (which of the
    two depends on what that cache held before, here the folder of the process's import)."""
    return sorted(set(_stored_forms(folder, program_store._SUFFIX))
                  | set(_stored_forms(folder, program_store.EXECUTABLE_SUFFIX)))


def test_a_stored_round_grows_the_trees_of_a_traced_one_and_custom_losses_store_their_trees_alone(tmp_path,
                                                                                                   monkeypatch):
    """In one process: the round (its statistics and its trees; a built-in logistic's starting
    value is a closed form, no program) exported to the store, then loaded from it, predict what the programs traced without the store do,
    bit for bit. Of a custom loss's programs, only the round's trees, which read no loss, are
    stored: on the same shapes the built-in's serve it, on new ones one more is stored."""
    traced = _fit_in_process(tmp_path, monkeypatch, "0")
    folder = tmp_path / "programs"
    assert not folder.exists()
    exported = _fit_in_process(tmp_path, monkeypatch, "1")
    stored = _stored_programs(folder)
    assert len(stored) == 2  # the round's statistics and trees
    loaded = _fit_in_process(tmp_path, monkeypatch, "1")
    np.testing.assert_array_equal(exported, traced)
    np.testing.assert_array_equal(loaded, traced)

    def custom_logistic(raw_prediction, y):
        return jax.nn.softplus(raw_prediction) - y * raw_prediction

    custom = _fit_in_process(tmp_path, monkeypatch, "1", loss=custom_logistic)
    assert _stored_programs(folder) == stored
    np.testing.assert_allclose(custom, traced, rtol=1e-5, atol=1e-5)
    deeper = _fit_in_process(tmp_path, monkeypatch, "1", loss=custom_logistic, max_depth=4)
    assert len(_stored_programs(folder)) == len(stored) + 1
    np.testing.assert_array_equal(deeper, _fit_in_process(tmp_path, monkeypatch, "0", loss=custom_logistic,
                                                          max_depth=4))


def test_a_later_process_loads_the_round_instead_of_tracing_it(tmp_path):
    """The first process traces the round's two programs and the prediction's link as without
    the store (a built-in logistic's starting value is a closed form, no program), compiles them and stores their executables; the
    next loads them and neither traces nor lowers anything of theirs; all predict what a process
    without the store predicts, bit for bit. A program whose executable is corrupt is deleted,
    traced and loaded from JAX's persistent cache, whose executable does not serialize whole: its
    exported form (``flat``) is stored instead, and the process after lowers a call of it
    (``call``), compiles it and stores the executable again."""
    code = ("import numpy as np, jaxboost as jb\n"
            "X = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)\n"
            "model = jb.train(X, (X[:, 0] + X[:, 1] > 0).astype(np.float32), loss='logistic', num_rounds=3,"
            " max_depth=3)\n"
            "import sys\n"
            "print('scipy' in sys.modules)\n"
            "print(model.predict_raw(X[:50]).tobytes().hex() + model.predict(X[:50]).tobytes().hex())\n")

    def run(store: str, cache=tmp_path):
        env = dict(os.environ, JAXBOOST_CACHE_DIR=str(cache), JAXBOOST_PROGRAM_STORE=store, JAX_LOG_COMPILES="1",
                   JAX_PLATFORMS="cpu")
        # Run away from the repository root, whose folders a script elsewhere cannot import.
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        # Lowering a call of an exported program readies jaxlib's LAPACK kernels, importing
        # SciPy (0.23 s): the store's programs call none, so their lowering skips it.
        scipy_imported, predictions = done.stdout.strip().splitlines()[-2:]
        assert scipy_imported == "False", f"a fit with JAXBOOST_PROGRAM_STORE={store} imported SciPy"
        return predictions, done.stderr

    # The round's two programs and the prediction's link (in steps).
    traced = ("Finished tracing round_statistics", "Finished tracing round_trees", "Finished tracing stepped")
    folder = tmp_path / "store" / "programs"
    without, log_without = run("0", tmp_path / "without")  # a cache of its own: the store's starts empty
    assert all(name in log_without for name in traced)
    first, log_first = run("1", tmp_path / "store")
    assert all(name in log_first for name in traced) and "Finished tracing flat" not in log_first
    names = _stored_forms(folder, program_store.EXECUTABLE_SUFFIX)
    assert len(names) == 3 and not _stored_forms(folder, program_store._SUFFIX)
    second, log_second = run("1", tmp_path / "store")
    assert not any(name in log_second for name in traced + ("Finished tracing flat", "Finished tracing call"))
    assert first == without and second == without

    executable = folder / (names[0] + program_store.EXECUTABLE_SUFFIX)
    executable.write_bytes(b"not an executable")
    after_corruption, log_after = run("1", tmp_path / "store")
    assert after_corruption == without
    assert sum(name in log_after for name in traced) == 1 and log_after.count("Finished tracing flat") == 1
    assert not executable.exists() and _stored_forms(folder, program_store._SUFFIX) == [names[0]]
    again, log_again = run("1", tmp_path / "store")
    assert again == without
    assert log_again.count("Finished tracing call") == 1 and "Finished tracing flat" not in log_again
    assert not any(name in log_again for name in traced)
    assert executable.stat().st_size > 1000  # stored again


def test_programs_calling_lapack_are_told_apart():
    """``calls_lapack`` finds jaxlib's LAPACK kernels in an exported program (a solve calls
    two), and none in one that calls none, though the word is in its source locations (this
    test's name, and the function's): only the latter's lowering skips LAPACK's readying."""
    import jax.numpy as jnp

    def exported(function, *arguments):
        return jax.export.export(jax.jit(function), platforms=["cpu"])(*arguments)

    def no_lapack_called(a):
        return jnp.cumsum(a) @ a

    assert program_store.calls_lapack(exported(jnp.linalg.solve, np.eye(3, dtype=np.float32),
                                                np.ones(3, np.float32)))
    named = exported(no_lapack_called, np.ones(3, np.float32))
    assert b"lapack" in bytes(named.mlir_module_serialized)
    assert not program_store.calls_lapack(named)


def test_a_refit_round_stores_its_programs_and_custom_losses_store_none_of_their_own(tmp_path, monkeypatch):
    """A round with a leaf refit (absolute error) stores its statistics, its trees and its refit
    (its starting value, a weighted median, is a closed form: no program), and the loaded
    programs predict what the traced ones do, bit for bit. A custom absolute error's refit and derivatives read its code and are not stored; its
    refit round's trees are the built-in's (its Hessian, the literal zero in its trace,
    foretells the refit). A custom Huber loss, whose tails' zero Hessians its first fit finds
    at the start, stores one entry more: the round without a refit, compiled while its need of
    one was unknown."""
    traced = _fit_in_process(tmp_path, monkeypatch, "0", loss="absolute_error")
    folder = tmp_path / "programs"
    exported = _fit_in_process(tmp_path, monkeypatch, "1", loss="absolute_error")
    stored = _stored_programs(folder)
    assert len(stored) == 3
    loaded = _fit_in_process(tmp_path, monkeypatch, "1", loss="absolute_error")
    np.testing.assert_array_equal(exported, traced)
    np.testing.assert_array_equal(loaded, traced)

    def custom_absolute_error(raw_prediction, y):
        return jax.numpy.abs(raw_prediction - y)

    custom = _fit_in_process(tmp_path, monkeypatch, "1", loss=custom_absolute_error)
    assert len(_stored_programs(folder)) == len(stored)
    np.testing.assert_allclose(custom, traced, rtol=1e-5, atol=1e-5)

    def custom_huber(raw_prediction, y, delta=0.01):
        residual = jax.numpy.abs(raw_prediction - y)
        return jax.numpy.where(residual <= delta, 0.5 * residual ** 2, delta * (residual - 0.5 * delta))

    assert _fit_in_process(tmp_path, monkeypatch, "1", loss=custom_huber, return_model=True).params["leaf_refit"]
    assert len(_stored_programs(folder)) == len(stored) + 1


@pytest.mark.parametrize("step, error", [
    ("_exported", NotImplementedError("no export for this program")),
    # Exported, but not written: a record type JAX cannot serialize, say.
    ("_save", ValueError("Cannot serialize PyTreeDef containing an unregistered type")),
])
def test_a_program_that_cannot_be_exported_or_written_is_jitted_as_without_the_store(tmp_path, monkeypatch, step,
                                                                                     error):
    traced = _fit_in_process(tmp_path, monkeypatch, "0")

    def refuse(*args):
        raise error

    monkeypatch.setattr(program_store, step, refuse)
    np.testing.assert_array_equal(_fit_in_process(tmp_path, monkeypatch, "1"), traced)
    assert not _stored_forms(tmp_path / "programs", program_store._SUFFIX)


def test_train_many_stores_its_round_and_grows_the_same_models(tmp_path, monkeypatch):
    """``train_many``'s round of several models (split over the cores on few rows) goes through
    the store too: exported, then loaded, it grows what the traced round grows, bit for bit."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(300, 4)).astype(np.float32)
    y = (X[:, 0] + rng.normal(size=300) > 0).astype(np.float32)
    raw = []
    for store in ("0", "1", "1"):
        monkeypatch.setenv("JAXBOOST_PROGRAM_STORE", store)
        monkeypatch.setenv("JAXBOOST_CACHE_DIR", str(tmp_path))
        program_store._IN_PROCESS.clear()
        models = jb.train_many(X, y, loss="logistic", num_rounds=3, max_depth=3, seeds=[0, 1],
                               batch=dict(reg_lambda=[0.5, 2.0]), subsample=0.8)
        raw.append(np.stack([model.predict_raw(X) for model in models]))
    assert len(_stored_programs(tmp_path / "programs")) == 1
    np.testing.assert_array_equal(raw[1], raw[0])
    np.testing.assert_array_equal(raw[2], raw[0])


def test_settings_that_change_a_program_but_no_shape_get_programs_of_their_own(tmp_path, monkeypatch):
    """Fits whose arrays have the same shapes but whose programs differ (a static flag of the
    regularizer, a Hessian mode, a row sample, another built-in loss) each store their own
    round, and each grows what its traced round grows."""
    variants = [dict(), dict(max_delta_step=0.7), dict(hessian="floor"), dict(subsample=0.5),
                dict(loss="hinge")]
    seen = set()
    for settings in variants:
        traced = _fit_in_process(tmp_path, monkeypatch, "0", **settings)
        stored = _fit_in_process(tmp_path, monkeypatch, "1", **settings)
        np.testing.assert_array_equal(stored, traced, err_msg=str(settings))
        entries = set((tmp_path / "programs").iterdir())
        assert entries - seen, f"{settings} reused a stored program"  # its round at least is new
        seen = entries


def test_programs_are_stored_for_platforms_with_a_backend_present(tmp_path, monkeypatch):
    """A CPU's and a GPU's programs are stored under jax.export's name of their backend; a
    platform with no backend in this process (a GPU here when there is none), or one not yet
    run with the store (a TPU), gets None: its program is jitted as without the store."""
    monkeypatch.setenv("JAXBOOST_PROGRAM_STORE", "1")
    monkeypatch.setenv("JAXBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(program_store, "_IN_PROCESS", collections.OrderedDict())
    assert program_store.export_platform("cpu") == "cpu"
    gpu = program_store.export_platform("gpu")
    has_gpu = any(device.platform == "gpu" for device in jax.devices())
    assert gpu in (("cuda", "rocm") if has_gpu else (None,))
    arguments = (jax.ShapeDtypeStruct((4,), np.float32),)
    stored = program_store.stored_program("double", lambda: lambda x: 2 * x, "double", arguments, "cpu", {})
    assert stored is not None
    # A CPU program takes CPU arrays, also where a GPU is the default device.
    on_cpu = jax.device_put(np.ones(4, np.float32), jax.devices("cpu")[0])
    np.testing.assert_array_equal(program_store.ready(stored)(on_cpu), 2.0)
    assert (program_store.stored_program("double", lambda: lambda x: 2 * x, "double", arguments, "gpu", {}) is None) \
        == (not has_gpu)
    assert program_store.stored_program("double", lambda: lambda x: 2 * x, "double", arguments, "tpu", {}) is None


def test_only_a_cpu_programs_key_asks_which_native_kernels_are_built(monkeypatch):
    """Asking builds them (a C++ compile, once a machine): a GPU's program never calls them, and
    a fresh GPU machine's first fit had paid for that build through its key."""
    from jaxboost import native

    asked = []
    monkeypatch.setattr(native, "_registered_targets", lambda: asked.append(True) or {"jaxboost_histogram"})
    monkeypatch.setenv("JAXBOOST_NATIVE", "1")  # asked for even where the suite runs without them
    arguments = (jax.ShapeDtypeStruct((4,), np.float32),)
    gpu_key = program_store.program_key("double", "double", arguments, None, "cuda")
    assert gpu_key is not None and not asked
    cpu_key = program_store.program_key("double", "double", arguments, None, "cpu")
    assert asked and cpu_key != gpu_key


def test_a_stored_executable_is_loaded_donates_as_the_jitted_program_and_takes_other_arguments_jitted(
        tmp_path, monkeypatch):
    """On a CPU a stored program's executable is stored by the process that compiles it (and its
    exported form is not made); a new program object for the same key loads it without tracing
    or lowering anything and donates what the jitted program donates; arguments placed otherwise
    go to the program jitted as without the store. An executable that JAX loaded from its
    persistent cache is not stored: the exported form is, instead."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("JAX's persistent cache is off in this process (JAXBOOST_CACHE_DIR empty)")
    monkeypatch.setenv("JAXBOOST_PROGRAM_STORE", "1")
    monkeypatch.setenv("JAXBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(program_store, "_IN_PROCESS", collections.OrderedDict())
    # A program no earlier process compiled (JAX's cache misses), kept there however fast it compiles.
    factor = float(np.random.default_rng().integers(2, 2 ** 24))
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        arguments = (jax.ShapeDtypeStruct((64,), np.float32), jax.ShapeDtypeStruct((), np.float32))

        def program(version="this jaxboost"):
            stored = program_store.stored_program("scaled", lambda: lambda x, y: (x * factor + y, y + 1),
                                                  ("scaled", factor, version), arguments, "cpu",
                                                  dict(donate_argnums=(0,)))
            program_store._IN_PROCESS.clear()
            return stored

        cpus = jax.devices("cpu")  # a CPU program's arguments, also where the default backend is a GPU

        def check(callable_program, device=cpus[0]):
            x = jax.device_put(np.arange(64, dtype=np.float32), device)
            scaled, plus_one = callable_program(x, np.float32(2.0))
            np.testing.assert_allclose(scaled, np.arange(64) * factor + 2, rtol=1e-6)
            assert float(plus_one) == 3.0
            assert x.is_deleted()  # donated

        first = program()
        check(program_store.ready(first))
        executable = first.path.with_suffix(program_store.EXECUTABLE_SUFFIX)
        assert executable.stat().st_size > 1000 and not first.path.exists()  # compiled: not exported

        loaded = program()
        callable_program = program_store.ready(loaded)
        assert isinstance(callable_program, program_store.CompiledOnce)
        check(callable_program)
        assert loaded._made is None and loaded._traced is None  # nothing traced or lowered
        if len(cpus) > 1:  # compiled for the first device, given rows on the last
            check(callable_program, device=cpus[-1])
            assert callable_program._jitted_only and loaded._traced is not None

        executable.unlink()
        from_jax_cache = program()
        check(program_store.ready(from_jax_cache))
        assert not executable.exists() and from_jax_cache.path.exists()  # exported instead

        # The same function under another key (another jaxboost, say) is compiled under another
        # name, so JAX's cache has no entry for it: compiled, its executable is stored.
        upgraded = program("another jaxboost")
        check(program_store.ready(upgraded))
        assert upgraded.path.with_suffix(program_store.EXECUTABLE_SUFFIX).exists() and not upgraded.path.exists()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)


def test_a_later_process_readies_lapack_for_a_loaded_executable_that_calls_it(tmp_path):
    """A built-in vector loss's starting value without a closed form takes Newton steps along
    the Hessian's eigenvectors (LAPACK's ``syevd``). jaxlib's LAPACK kernels take their routines
    from SciPy when a program calling them is lowered; a later process loads that program's
    executable unlowered, and had crashed calling it. It readies them first, and predicts what
    the first process predicted. Every built-in now has its constant on the host (the Student t
    likelihood's since its float64 minimisation there), so each process takes the Student t's
    away to stand for such a loss."""
    code = ("import numpy as np, jaxboost as jb\n"
            "record = jb.losses.BUILTINS['student_t_nll']\n"
            "jb.losses.BUILTINS['student_t_nll'] = record._replace(optimal_constant=None)\n"
            "rng = np.random.default_rng(1)\n"
            "X = rng.normal(size=(240, 4)).astype(np.float32)\n"
            "y = (X[:, 0] + 0.3 * rng.standard_t(3, size=240)).astype(np.float32)\n"
            "model = jb.train(X, y, loss='student_t_nll', num_rounds=2, max_depth=2)\n"
            "print(model.base_score.tobytes().hex() + model.predict(X[:20]).tobytes().hex())\n")

    def run():
        env = dict(os.environ, JAXBOOST_CACHE_DIR=str(tmp_path), JAXBOOST_PROGRAM_STORE="1", JAX_LOG_COMPILES="1",
                   JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
        return done.stdout.strip().splitlines()[-1], done.stderr

    first, log_first = run()
    assert "Finished tracing newton_constant" in log_first
    payloads = [pickle.loads(zlib.decompress(path.read_bytes()))[2]
                for path in (tmp_path / "programs").glob("*" + program_store.EXECUTABLE_SUFFIX)]
    assert sum(program_store._LAPACK_TARGET_PREFIX in payload for payload in payloads) == 1  # the Newton steps'
    second, log_second = run()
    assert "Finished tracing newton_constant" not in log_second
    assert second == first
