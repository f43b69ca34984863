"""Program store: a fit's programs (its round's and its starting value) and a prediction's
link, traced and lowered once, kept on disk for later processes.

JAX's persistent compilation cache (``devices.configure_compilation_cache``) spares a new
process XLA's compile, but not the tracing and lowering that come before it: a fit of a
built-in loss spent 0.7-1.3 s there on a 2-core machine, most of a warm process's first fit.
Here each lowered program is kept as a serialized ``jax.export.Exported`` under a key that
names everything its tracing read, and a later process with the same key calls it instead of
tracing it again (the call's own small program then finds its compile in the persistent cache).

The key is built only from values whose meaning is fixed by jaxboost's own source: built-in
losses, links and metrics (functions of jaxboost's modules, found under their names), records of
jaxboost's types, numbers, strings, array shapes and shardings, and the mesh, with the digest of
jaxboost's source files, the JAX and jaxlib versions, the native kernels available and the
compiler options. A program that holds anything else (a custom loss, regularizer or metric) is
traced as before: its meaning lives in code the key cannot see. (A round's trees read no loss:
a custom loss's are stored, its derivatives are not.) Unreadable entries are traced
anew and written again, and a program that cannot be exported is jitted as without the store.
The key cannot see jaxboost's functions or constants replaced at run time (the test suite,
which does so, turns the store off); short of that, the store changes no model, it only skips
a trace.

``JAXBOOST_CACHE_DIR`` holds the store (``programs/`` inside it; an empty value turns it off, as
it turns off the compilation cache), and ``JAXBOOST_PROGRAM_STORE=0`` turns the store alone off.
Serializing needs the ``flatbuffers`` package (the ``fast-start`` extra); without it rounds are
traced as before. CPU and GPU programs (``STORED_PLATFORMS``).

On a CPU the store keeps the compiled program instead (``<key>.executable``, ``CompiledOnce``):
a later process loads it and skips the tracing, the lowering and the persistent cache's lookup
(its key is a hash of the lowered module); the exported form is stored only for a program whose
executable cannot be. Loading a program's executable from the store runs its machine code, as
loading it from JAX's persistent cache does: the folder must be the user's own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import pickle
import re
import threading
import zlib
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import numpy as np

from . import native
from .devices import cache_folder, write_whole

logger = logging.getLogger(__name__)

# The package whose functions and record types a key may name: their meaning is their source,
# which the key's digest covers (``SOURCE_PACKAGES``' files; the built-in losses live in a folder
# of their own, installed as ``jaxboost.losses``).
OWN_PACKAGE = "jaxboost"
SOURCE_PACKAGES = ("jaxboost", "jaxboost.losses")
# Stored programs kept (about 50 KB each); the oldest written go first past this.
MAX_STORED_PROGRAMS = 2000
_SUFFIX = ".jaxexport"
# Compiled programs (``CompiledOnce``), kept as many as the exported ones; zlib-compressed:
# a round's trees pickle to 400 KB, 80 KB compressed.
EXECUTABLE_SUFFIX = ".executable"
# Platforms whose executables are stored: a CPU's (a GPU's load has not been measured).
EXECUTABLE_PLATFORMS = ("cpu",)
# Platforms whose programs are stored (devices' names; a TPU's rounds are traced as before:
# storing them has not been run on one).
STORED_PLATFORMS = ("cpu", "gpu")


class NotStorable(Exception):
    """A value whose meaning the key cannot name (a user's function or object)."""


def _own(module_name: str | None) -> bool:
    return bool(module_name) and module_name.split(".")[0] == OWN_PACKAGE


def _named_function(function: Callable) -> str:
    """``module:qualname`` of a function of jaxboost's modules that is found under that name."""
    module_name, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not _own(module_name) or "<" in qualname:
        raise NotStorable(f"function {qualname or function!r} of {module_name}")
    found = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not function:  # replaced at run time, or not reachable by its name
        raise NotStorable(f"{module_name}.{qualname} is not the function of that name")
    return f"{module_name}:{qualname}"


def describe(value) -> str:
    """A description of ``value`` that names all its tracing can read, or ``NotStorable``."""
    if isinstance(value, jax.core.Tracer):
        raise NotStorable("a traced argument (the program is part of another)")
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        sharding = getattr(value, "sharding", None) if not isinstance(value, np.ndarray) else None
        return f"array{tuple(value.shape)}:{np.dtype(value.dtype).name}:{_describe_sharding(sharding)}"
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return f"dtype:{np.dtype(value).name}"
    if isinstance(value, jax.sharding.Mesh):
        return _describe_mesh(value)
    if isinstance(value, functools.partial):
        return (f"partial({_named_function(value.func)},{describe(value.args)},"
                f"{describe(dict(value.keywords))})")
    kind = type(value)
    if isinstance(value, tuple) and hasattr(value, "_fields") or dataclasses.is_dataclass(value):
        if not _own(kind.__module__):
            raise NotStorable(f"record of type {kind.__qualname__}")
        names = value._fields if isinstance(value, tuple) else [f.name for f in dataclasses.fields(value)]
        inner = ",".join(f"{name}={describe(getattr(value, name))}" for name in names)
        return f"{kind.__module__}.{kind.__qualname__}({inner})"
    if kind in (tuple, list):
        return f"{kind.__name__}[{','.join(describe(item) for item in value)}]"
    if kind is dict:
        if not all(isinstance(name, str) for name in value):
            raise NotStorable("dict with keys that are not strings")
        return "dict{" + ",".join(f"{name}:{describe(value[name])}" for name in sorted(value)) + "}"
    if callable(value):
        return f"function:{_named_function(value)}"
    raise NotStorable(f"value of type {kind.__qualname__}")


def _describe_mesh(mesh: jax.sharding.Mesh) -> str:
    devices = ",".join(f"{device.platform}{device.id}" for device in mesh.devices.flat)
    return f"mesh{tuple(mesh.shape.items())}[{devices}]"


def _describe_sharding(sharding) -> str:
    if sharding is None:
        return "none"
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"named({_describe_mesh(sharding.mesh)},{sharding.spec})"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        device = next(iter(sharding.device_set))
        return f"single({device.platform}{device.id})"
    raise NotStorable(f"sharding {type(sharding).__qualname__}")


@functools.cache
def _source_digest() -> str:
    """The digest of jaxboost's and the built-in losses' source files."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.glob("*.py")) + sorted(folder.glob("*.cc")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _environment(compiler_options: dict | None, platform: str) -> str:
    config = jax.config
    # Only a CPU's programs call the native kernels: asking which are built builds them (a C++
    # compile, once a machine), which a fresh GPU machine's first fit had paid for nothing.
    native_kernels = (",".join(sorted(native._registered_targets()))
                      if platform == "cpu" and native.native_enabled() else "")
    return ";".join([
        _source_digest(), jax.__version__, importlib.import_module("jaxlib").__version__, platform,
        str(native.native_enabled()), native_kernels,
        describe(compiler_options or {}), str(config.jax_enable_x64), str(config.jax_default_matmul_precision),
        str(config.jax_numpy_dtype_promotion), str(config.jax_numpy_rank_promotion),
        str(config.jax_default_prng_impl), str(config.jax_threefry_partitionable)])


def store_folder() -> Path | None:
    """Where programs are stored, or None when the store is off (or ``flatbuffers``, which
    serializing needs, is not installed)."""
    # Asked at every prediction (for its link): worked out once per setting, it took 19 us.
    return _store_folder(os.environ.get("JAXBOOST_PROGRAM_STORE", "1"), os.environ.get("JAXBOOST_CACHE_DIR"),
                         os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _store_folder(store: str, cache_dir: str | None, home: str | None) -> Path | None:
    """``store_folder`` for the settings it reads: ``JAXBOOST_PROGRAM_STORE``, and the cache
    folder's ``JAXBOOST_CACHE_DIR`` and ``HOME`` (read again by ``cache_folder``; here they key
    the cache of answers)."""
    del cache_dir, home
    if store == "0":
        return None
    cache = cache_folder()
    if not cache:
        return None
    try:
        importlib.import_module("flatbuffers")
    except ImportError:
        return None
    return Path(cache) / "programs"


@functools.lru_cache(maxsize=256)
def _described(static) -> str:
    """``describe`` of a hashable static structure, once per structure (a round's took about a
    millisecond, each fit)."""
    return describe(static)


def program_key(name: str, static, arguments: tuple, compiler_options: dict | None,
                platform: str = "cpu") -> str | None:
    """The store's key for program ``name`` of ``static`` (its static structure) called with
    ``arguments`` and lowered for ``platform`` (``export_platform``'s name); None when something
    in them is not storable."""
    try:
        try:
            static_description = _described(static)
        except TypeError:  # not hashable: described each time
            static_description = describe(static)
        description = (f"{name}|{static_description}|{describe(arguments)}|"
                       f"{_environment(compiler_options, platform)}")
    except NotStorable as reason:
        logger.debug("program %s not stored: %s", name, reason)
        return None
    return hashlib.sha256(description.encode()).hexdigest()


def _load(path: Path, specs: list) -> jax.export.Exported | None:
    try:
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - any unreadable entry is replaced
        logger.debug("stored program %s unreadable, traced anew: %s", path.name, error)
        return None
    if [(a.shape, a.dtype) for a in exported.in_avals] != [(s.shape, s.dtype) for s in specs]:
        logger.debug("stored program %s has other arguments, traced anew", path.name)
        return None
    return exported


def _save(folder: Path, path: Path, serialized: bytes) -> None:
    try:
        write_whole(path, serialized)  # whole or not at all, for processes reading meanwhile
        _trim(folder, path.suffix)
    except OSError as error:
        logger.debug("program not stored in %s: %s", folder, error)


def _trim(folder: Path, suffix: str = _SUFFIX, keep: int = MAX_STORED_PROGRAMS) -> None:
    entries = []
    for path in folder.glob("*" + suffix):
        try:
            entries.append((path.stat().st_mtime, path))
        except OSError:
            continue
    for _, path in sorted(entries)[:max(len(entries) - keep, 0)]:
        path.unlink(missing_ok=True)


def _spec(leaf) -> jax.ShapeDtypeStruct:
    """The shape, dtype, weak type and sharding of an argument: all its program depends on."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=getattr(leaf, "sharding", None),
                                weak_type=aval.weak_type)


def export_platform(platform: str) -> str | None:
    """``jax.export``'s name for the devices' ``platform`` (a GPU's is "cuda" or "rocm", as the
    backend present says), or None where there is none."""
    if platform == "cpu":
        return platform
    try:
        from jax._src.xla_bridge import canonicalize_platform  # what jax.jit itself lowers for
        return canonicalize_platform(platform)
    except Exception:  # noqa: BLE001 - no such backend, or a JAX without the function: traced as before
        return None


def serializable_record(record_type: type) -> None:
    """Lets stored programs return ``record_type`` (a NamedTuple of jaxboost's): JAX serializes
    only the records registered with it. A JAX without the registry stores no such program."""
    register = getattr(jax.export, "register_namedtuple_serialization", None)
    if register is None:
        return
    try:
        register(record_type, serialized_name=f"{record_type.__module__}.{record_type.__qualname__}")
    except ValueError:  # registered already (the module imported again)
        pass


def _exported(function: Callable, arguments: tuple, platform: str) -> jax.export.Exported:
    """``function`` traced and lowered for ``arguments`` (specs), taking their leaves as a flat list."""
    leaves, tree = jax.tree_util.tree_flatten(arguments)

    def flat(*flat_leaves):
        return function(*jax.tree_util.tree_unflatten(tree, flat_leaves))

    # The native kernels are FFI calls of jaxboost's own, registered again by every process.
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in native._SYMBOLS]
    return jax.export.export(jax.jit(flat), platforms=[platform], disabled_checks=checks)(*leaves)


# JAX lowers a call to an exported program on a CPU after readying jaxlib's LAPACK kernels,
# whether the program calls LAPACK or not, and readying them imports SciPy's BLAS and LAPACK
# modules: 0.23 s on a 2-core machine, half of a later process's first fit. A stored program that
# calls no LAPACK kernel is lowered without: the readying is skipped in the thread lowering it
# (``_LoweredWithoutLapack``), and only there; it runs as before for any other program.
_WITHOUT_LAPACK = threading.local()


@functools.cache
def _lapack_readying_skippable() -> bool:
    """Wraps JAX's LAPACK readying (once) so that a thread lowering a stored program that
    calls no LAPACK kernel skips it; False where this JAX has no such function to wrap."""
    try:
        from jax._src.lax import linalg
    except ImportError:
        return False
    ready_lapack = getattr(linalg, "initialize_lapack", None)
    if not callable(ready_lapack):
        return False

    @functools.wraps(ready_lapack)
    def initialize_lapack(*args, **kwargs):
        if getattr(_WITHOUT_LAPACK, "active", False):
            return None
        return ready_lapack(*args, **kwargs)

    linalg.initialize_lapack = initialize_lapack
    return True


def calls_lapack(exported: jax.export.Exported) -> bool:
    """Whether the program calls one of jaxlib's LAPACK kernels (custom calls whose targets are
    named ``lapack_...``)."""
    # The serialized module keeps its strings as they are: without the word, no such target.
    if b"lapack" not in bytes(exported.mlir_module_serialized):
        return False
    # The word may be a source location's (a function named so); the module's text (some 30 ms
    # for a round) names the targets.
    text = exported.mlir_module()
    targets = re.findall(r'custom_call @([\w.$-]+)', text) + re.findall(r'call_target_name = "([^"]*)"', text)
    return any(target.startswith("lapack") for target in targets)


class _LoweredWithoutLapack:
    """A jitted stored program whose lowering, in a first call or by ``lower``, skips JAX's
    LAPACK readying (the program calls no LAPACK kernel)."""

    def __init__(self, jitted: Callable):
        self._jitted = jitted

    def _without_lapack(self, method, arguments):
        before = getattr(_WITHOUT_LAPACK, "active", False)
        _WITHOUT_LAPACK.active = True
        try:
            return method(*arguments)
        finally:
            _WITHOUT_LAPACK.active = before

    def __call__(self, *arguments):
        return self._without_lapack(self._jitted, arguments)

    def lower(self, *arguments):
        return self._without_lapack(self._jitted.lower, arguments)


class StoredProgram:
    """A program from the store, made when first lowered or asked for (``jitted``): loaded
    when a process stored it before, else traced now and stored. Lazily, so that a first fit
    traces its round while the starting value is found in another thread, as without the store."""

    def __init__(self, folder: Path, key: str, make_function: Callable[[], Callable], arguments: tuple,
                 platform: str, jit_options: dict):
        self.path = folder / (key + _SUFFIX)
        self._platform = platform
        self._callable = None
        self._made = None
        self._traced = None
        self._making = threading.RLock()
        self._folder, self._make_function, self._jit_options = folder, make_function, jit_options
        # Their specs, not the arguments: a program never made must not keep a fit's arrays alive.
        self._specs = jax.tree_util.tree_map(_spec, arguments)

    def jitted(self) -> Callable:
        """The program's callable: on a CPU (``EXECUTABLE_PLATFORMS``) a ``CompiledOnce``, else
        the exported program (``exported_program``)."""
        with self._making:
            if self._callable is None:
                if self._platform in EXECUTABLE_PLATFORMS:
                    self._callable = CompiledOnce(self.path.with_suffix(EXECUTABLE_SUFFIX), self)
                else:
                    self._callable = self.exported_program()
        return self._callable

    def exported_program(self) -> Callable:
        """A call of the program's exported form, jitted with the options it was asked for: the
        form loaded from the store, else traced now and stored (a program that cannot be stored
        is jitted as without the store)."""
        with self._making:
            if self._made is None:
                self._make()
        return self._made

    def exported_stored(self) -> bool:
        """Whether ``exported_program`` is made here already, or its form is in the store (made
        by another process)."""
        return self._made is not None or self.path.exists()

    def traced_program(self) -> Callable:
        """The program as without the store: its function jitted with the options it was asked
        for, under a name that ends with its key's start (``_keyed``)."""
        with self._making:
            if self._traced is None:
                self._traced = jax.jit(_keyed(self._make_function(), self.path.stem), **self._jit_options)
        return self._traced

    def _make(self) -> None:
        function, specs, jit_options = self._make_function(), self._specs, self._jit_options
        self._specs = None
        exported = _load(self.path, jax.tree_util.tree_leaves(specs))
        if exported is None:
            try:
                exported = _exported(function, specs, self._platform)
                _save(self._folder, self.path, exported.serialize())
            except Exception as error:  # noqa: BLE001 - what cannot be stored is jitted as without the store
                logger.debug("program %s not stored, jitted instead: %s", self.path.name, error)
                self._made = jax.jit(function, **jit_options)
                return

        def call(*call_arguments):
            return exported.call(*jax.tree_util.tree_leaves(call_arguments))

        jitted = jax.jit(_keyed(call, self.path.stem), **jit_options)
        if self._platform == "cpu" and not calls_lapack(exported) and _lapack_readying_skippable():
            jitted = _LoweredWithoutLapack(jitted)
        self._made = jitted

    def lower(self, *arguments):
        return self.jitted().lower(*arguments)


# Characters of a program's key in the name it is compiled under.
KEY_IN_NAME = 12


def _keyed(function: Callable, key: str) -> Callable:
    """``function`` under its name followed by the start of the program's key. JAX's persistent
    cache keys a program by its module, whose name this is: a program of another jaxboost (or
    other settings the key names) is another entry, so its first process compiles it and stores
    the executable, where it had found the old entry, whose executable does not serialize whole,
    and stored none (after an upgrade, the second process had then compiled it)."""
    base = getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", "program")

    @functools.wraps(function)
    def program(*arguments):
        return function(*arguments)

    program.__name__ = program.__qualname__ = f"{base}_{key[:KEY_IN_NAME]}"
    return program


def _executable_environment() -> str:
    """What a CPU executable depends on beyond its program's key: the backend's version and
    XLA's flags (as JAX's persistent cache keys its entries)."""
    client = jax.devices("cpu")[0].client
    return f"{client.platform_version};{os.environ.get('XLA_FLAGS', '')}"


# A CPU executable that JAX loaded from its persistent cache does not serialize whole: loaded
# again, it fails to find its own functions when run. So only an executable just compiled is
# stored, one for which JAX writes a persistent cache entry: it records that event in the
# compiling thread, counted here per thread (a JAX that records no such event stores none).
_CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"
_CACHE_WRITES = threading.local()


@functools.cache
def _count_cache_writes() -> None:
    def on_event(event: str, **_) -> None:
        if event == _CACHE_WRITE_EVENT:
            _CACHE_WRITES.count = getattr(_CACHE_WRITES, "count", 0) + 1

    jax.monitoring.register_event_listener(on_event)


def _cache_writes() -> int:
    """Persistent cache entries written by this thread's compiles so far."""
    _count_cache_writes()
    return getattr(_CACHE_WRITES, "count", 0)


def _store_executable(path: Path, compiled) -> None:
    try:
        from jax.experimental import serialize_executable
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        devices = [device.id for device in compiled.runtime_executable().local_devices()]
        record = pickle.dumps((_executable_environment(), devices, payload, in_tree, out_tree))
        _save(path.parent, path, zlib.compress(record, 1))
    except Exception as error:  # noqa: BLE001 - an executable that cannot be stored is compiled again next time
        logger.debug("executable %s not stored: %s", path.name, error)


# jaxlib's LAPACK kernels' custom call targets begin so (``lapack_ssyevd_ffi``...); a serialized
# executable holds its targets' names as they are (a source location that happens to hold the
# word only readies the kernels for nothing).
_LAPACK_TARGET_PREFIX = b"lapack_"


def _ready_lapack() -> bool:
    """Readies jaxlib's LAPACK kernels, which take their routines from SciPy when a program
    calling them is lowered: an executable calling them, loaded unlowered, had crashed the
    process. False where this JAX has no such step to take."""
    try:
        from jax._src.lax import linalg
        linalg.initialize_lapack()
    except (ImportError, AttributeError) as error:
        logger.debug("LAPACK's kernels not readied: %s", error)
        return False
    return True


def _load_executable(path: Path):
    """The ``jax.stages.Compiled`` stored at ``path``, or None (none stored, unreadable, or
    compiled by another backend or with other XLA flags)."""
    try:
        record = path.read_bytes()
    except OSError:
        return None
    try:
        environment, device_ids, payload, in_tree, out_tree = pickle.loads(zlib.decompress(record))
        if environment != _executable_environment():
            logger.debug("executable %s compiled elsewhere, compiled anew", path.name)
            return None
        if _LAPACK_TARGET_PREFIX in payload and not _ready_lapack():
            return None  # lowered and compiled as without its executable, which stays for a later JAX
        from jax.experimental import serialize_executable
        by_id = {device.id: device for device in jax.devices("cpu")}
        devices = [by_id[device_id] for device_id in device_ids]
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, backend=devices[0].client,
                                                         execution_devices=devices)
    except Exception as error:  # noqa: BLE001 - any unreadable entry is compiled anew
        logger.debug("executable %s unreadable, compiled anew: %s", path.name, error)
        path.unlink(missing_ok=True)  # stored again if compiled, not read again if loaded from JAX's cache
        return None


class CompiledOnce:
    """A stored program on a CPU, compiled once for the arguments its key describes and then
    called as that executable (a ``jax.stages.Compiled``). A process that finds the executable
    in the store (``path``) loads it: it traces and lowers nothing, and skips the persistent
    cache's lookup, which hashes the lowered module (a later process's first fit of 455 x 30
    rows had spent 0.10-0.12 s lowering its round's two programs). One that does not lowers the
    program: a call of its exported form where the store holds that, else the program traced as
    without the store (``source``: the ``StoredProgram``). Compiled here, the executable is
    stored, and the exported form is not made: exporting had cost the first process 0.4 s of a
    new shape's 3 s on a 2-core machine. Loaded from JAX's persistent cache instead, the
    executable cannot be stored (``_CACHE_WRITE_EVENT``), so the exported form is stored: later
    processes lower it rather than trace the program, and store the executable that compiles.
    Should a call's arguments differ from those it was compiled for (in type or placement), this
    and later calls go to the program traced as without the store."""

    def __init__(self, path: Path, source: StoredProgram):
        self.path, self._source = path, source
        self._compiled = None
        self._jitted_only = False
        self._compiling = threading.Lock()

    def _to_lower(self) -> Callable:
        source = self._source
        return source.exported_program() if source.exported_stored() else source.traced_program()

    def lower(self, *arguments) -> "_Compiling":
        """What ``compile()`` readies: the program lowered for ``arguments`` here, in the
        caller's thread, unless its executable is stored (loaded by ``compile``)."""
        if self._compiled is not None or self._jitted_only or self.path.exists():
            return _Compiling(self, None, arguments)
        return _Compiling(self, self._to_lower().lower(*arguments), arguments)

    def compiled(self, lowered, arguments: tuple):
        """The executable: this object's, else the stored one, else ``lowered`` (or the program
        lowered for ``arguments``) compiled now and stored."""
        with self._compiling:
            if self._compiled is None:
                compiled = _load_executable(self.path)
                if compiled is None:
                    writes = _cache_writes()
                    compiled = (lowered or self._to_lower().lower(*arguments)).compile()
                    if _cache_writes() > writes:  # compiled here, not loaded from JAX's cache
                        _store_executable(self.path, compiled)
                    else:
                        self._source.exported_program()
                self._compiled = compiled
        return self._compiled

    def __call__(self, *arguments):
        if self._jitted_only:
            return self._source.traced_program()(*arguments)
        compiled = self._compiled if self._compiled is not None else self.compiled(None, arguments)
        try:
            return compiled(*arguments)
        except (TypeError, ValueError) as mismatch:  # checked before the call runs: no donated buffer is spent
            logger.debug("executable %s called with other arguments, jitted instead: %s", self.path.name, mismatch)
            self._jitted_only = True
            return self._source.traced_program()(*arguments)


class _Compiling(NamedTuple):
    program: CompiledOnce
    lowered: object  # jax.stages.Lowered, or None where the executable is to be loaded
    arguments: tuple

    def compile(self) -> None:
        self.program.compiled(self.lowered, self.arguments)


def ready(program) -> Callable:
    """The callable program of ``stored_program``'s result (or of a program made of such, that
    has a ``jitted`` method too), or ``program`` as it is."""
    jitted = getattr(program, "jitted", None)
    return jitted() if callable(jitted) else program


# The programs of this process, by key (the most recently asked for kept, as many as the
# compiled rounds' cache keeps).
_IN_PROCESS: collections.OrderedDict[str, StoredProgram] = collections.OrderedDict()
IN_PROCESS_PROGRAMS = 64
_IN_PROCESS_LOCK = threading.Lock()


def stored_program(name: str, make_function: Callable[[], Callable], static, arguments: tuple, platform: str,
                   jit_options: dict) -> StoredProgram | None:
    """The program that runs ``make_function()`` (unjitted, made only when this process traces
    or jits it: a round's took 40 us, every fit; its static structure ``static``) on
    arguments like ``arguments`` (arrays or ``ShapeDtypeStruct``s with their shardings) through
    the store; None when the store is off or the program cannot be stored (the caller then jits
    the function itself). ``jit_options``: ``jax.jit``'s (donation, compiler options). One
    object per key in a process; ``ready`` gives its callable."""
    folder = store_folder()
    if folder is None or platform not in STORED_PLATFORMS:
        return None
    platform = export_platform(platform)
    if platform is None:
        return None
    key = program_key(name, static, arguments, jit_options.get("compiler_options"), platform)
    if key is None:
        return None
    with _IN_PROCESS_LOCK:  # a first fit asks for its starting value's program in a thread of its own
        program = _IN_PROCESS.get(key)
        if program is None:
            program = _IN_PROCESS[key] = StoredProgram(folder, key, make_function, arguments, platform, jit_options)
            while len(_IN_PROCESS) > IN_PROCESS_PROGRAMS:
                _IN_PROCESS.popitem(last=False)
        _IN_PROCESS.move_to_end(key)
    return program
