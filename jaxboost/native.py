"""Native CPU kernels: compiling, caching and registering them with XLA as FFI custom calls.

The C++ sources ship with the package and are compiled on first use with the system C++
compiler against the XLA FFI headers of the installed jaxlib (``jax.ffi.include_dir()``), so the
library always matches the running jaxlib and installing needs no compiler. The shared library
is cached in ``JAXBOOST_NATIVE_DIR`` (default ``~/.cache/jaxboost/native``, or a temporary
folder when that is not writable), keyed by the source, the jaxlib version and the compiler
command. When anything fails (no compiler, no headers, a read-only disk) the kernels are
reported absent, the build is not tried again in the process, and callers use their XLA
versions, which train several times slower (a 1M x 28 tree of depth 6 on 2 cores: 229-265 ms
against 28-33): a ``RuntimeWarning`` says so once, with the reason. ``JAXBOOST_NATIVE=0``
turns the native kernels off, and with them the warning.

The library is built for the baseline of its architecture, so one build runs on every CPU of
it; the prediction kernel also holds AVX2 and AVX-512 versions, compiled for those instruction
sets alone and chosen at run time by what the CPU has. ``JAXBOOST_PREDICT_SIMD=avx2`` or
``=none`` asks for a narrower one (to compare them, or to test them all on one machine). The
route kernel routes a level's rows by node passes, sixteen rows at a time on AVX-512 and eight
on AVX2, and by gathers where a block's rows lie in more than a few nodes;
``JAXBOOST_ROUTE_SIMD=passes`` (no gathers), ``=avx2``, ``=avx2-passes`` or ``=none`` (one row at
a time) narrows that choice, the same results. The other kernels compiled for AVX2 and AVX-512
besides the baseline (the split scans, the damped solve, the histogram's channel pass) take the
widest this CPU runs, or a narrower one that ``JAXBOOST_KERNEL_SIMD=avx2`` or ``=none`` asks for,
read at each call (the tests check each variant against the XLA code on one machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .validation import warn_caller

logger = logging.getLogger(__name__)

HISTOGRAM_TARGET = "jaxboost_histogram"
ROUTE_HISTOGRAM_TARGET = "jaxboost_route_histogram"
CHANNEL_HISTOGRAM_TARGET = "jaxboost_channel_histogram"
CUMULATIVE_BINS_TARGET = "jaxboost_cumulative_bins"
FIRST_MAXIMUM_TARGET = "jaxboost_first_maximum"
TOP_AFTER_TARGET = "jaxboost_top_after"
ADD_POSITION_VALUES_TARGET = "jaxboost_add_position_values"
SORT_BY_KEY_TARGET = "jaxboost_sort_by_key"
DAMPED_SOLVE_TARGET = "jaxboost_damped_solve"
VECTOR_SPLIT_SCAN_TARGET = "jaxboost_vector_split_scan"
SCALAR_SPLIT_SCAN_TARGET = "jaxboost_scalar_split_scan"
SEGMENT_SUM_TARGET = "jaxboost_segment_sum"
SORTED_AUC_SUMS_TARGET = "jaxboost_sorted_auc_sums"
COMPACT_FLAGS_TARGET = "jaxboost_compact_flags"
SIBLING_HISTOGRAMS_TARGET = "jaxboost_sibling_histograms"
UNINITIALIZED_TARGET = "jaxboost_uninitialized"
_SOURCE = Path(__file__).with_name("histogram_kernel.cc")
_SYMBOLS = {HISTOGRAM_TARGET: "JaxboostHistogram", ROUTE_HISTOGRAM_TARGET: "JaxboostRouteHistogram",
            CHANNEL_HISTOGRAM_TARGET: "JaxboostChannelHistogram",
            CUMULATIVE_BINS_TARGET: "JaxboostCumulativeBins", FIRST_MAXIMUM_TARGET: "JaxboostFirstMaximum",
            TOP_AFTER_TARGET: "JaxboostTopAfter",
            ADD_POSITION_VALUES_TARGET: "JaxboostAddPositionValues", SORT_BY_KEY_TARGET: "JaxboostSortByKey",
            DAMPED_SOLVE_TARGET: "JaxboostDampedSolve", VECTOR_SPLIT_SCAN_TARGET: "JaxboostVectorSplitScan",
            SCALAR_SPLIT_SCAN_TARGET: "JaxboostScalarSplitScan",
            SEGMENT_SUM_TARGET: "JaxboostSegmentSum",
            SORTED_AUC_SUMS_TARGET: "JaxboostSortedAucSums", COMPACT_FLAGS_TARGET: "JaxboostCompactFlags",
            SIBLING_HISTOGRAMS_TARGET: "JaxboostSiblingHistograms",
            UNINITIALIZED_TARGET: "JaxboostUninitialized"}
# No trapping math: nothing reads the floating-point exception flags, and without it GCC may not
# evaluate both sides of a select in vectors (the scalar split scan's gains stayed scalar on AVX2).
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w", "-fno-math-errno", "-fno-trapping-math"]
_COMPILE_TIMEOUT_S = 300


def native_enabled() -> bool:
    """False when ``JAXBOOST_NATIVE`` is set to 0/false/off/no."""
    return os.environ.get("JAXBOOST_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _cache_folders() -> list[Path]:
    chosen = os.environ.get("JAXBOOST_NATIVE_DIR")
    if chosen:
        return [Path(chosen)]
    return [Path.home() / ".cache" / "jaxboost" / "native",
            Path(tempfile.gettempdir()) / f"jaxboost-native-{os.getuid() if hasattr(os, 'getuid') else 0}"]


def _compile(compiler: list[str], include_dir: str, target: Path) -> None:
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent processes never load a partial file.
    handle, partial = tempfile.mkstemp(prefix=target.stem + ".", suffix=".partial", dir=folder)
    os.close(handle)
    try:
        command = [*compiler, *_FLAGS, f"-I{include_dir}", str(_SOURCE), "-o", partial]
        finished = subprocess.run(command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False)
        if finished.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{finished.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _build_library() -> ctypes.CDLL:
    if sys.platform not in ("linux", "darwin"):
        raise RuntimeError(f"native kernels are built only on Linux and macOS, not {sys.platform}")
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C++ compiler found (tried {compiler[:1]}; set CXX to choose one)")
    include_dir = jax.ffi.include_dir()
    if not (Path(include_dir) / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"the XLA FFI headers are missing from jaxlib ({include_dir})")
    import jaxlib
    key = hashlib.sha256("\n".join([_SOURCE.read_text(), jaxlib.__version__, shlex.join(compiler + _FLAGS),
                                    platform.machine(), sys.platform]).encode()).hexdigest()[:20]
    errors = []
    for folder in _cache_folders():
        target = folder / f"jaxboost_kernels_{key}.so"
        try:
            if not target.exists():
                logger.info("compiling jaxboost's native CPU kernels into %s (once)", target)
                _compile(compiler, include_dir, target)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(f"{folder}: {error}")
    raise RuntimeError("could not build the native kernels; " + "; ".join(errors))


@functools.cache
def _library_or_failure() -> tuple[ctypes.CDLL | None, Exception | None]:
    # The failure is kept too: a compiler that fails would otherwise be run again (seconds) by
    # every call that asks, each prediction's among them.
    try:
        return _build_library(), None
    except Exception as error:  # noqa: BLE001 - reported by the callers, which fall back to XLA
        return None, error


def _load_library() -> ctypes.CDLL:
    """The native library, built (or found in the cache) once a process; raises the first
    attempt's error again if that failed."""
    library, failure = _library_or_failure()
    if failure is not None:
        raise RuntimeError(str(failure)) from failure
    return library


_warned_unavailable = False


def _report_unavailable(error: Exception) -> None:
    """Logs why the native kernels are unavailable and warns once a process: training and
    prediction silently several times slower would look like jaxboost's speed."""
    global _warned_unavailable
    logger.debug("jaxboost native CPU kernels unavailable, using the XLA kernels: %s", error)
    if _warned_unavailable:
        return
    _warned_unavailable = True
    reason = (str(error).splitlines() or [type(error).__name__])[0][:300]
    warn_caller(f"jaxboost's native CPU kernels are unavailable ({reason}); training and prediction on CPU use "
                "the XLA kernels, several times slower (8x a tree on a 1M x 28 fit). Install a C++ compiler "
                "(or set CXX), or set JAXBOOST_NATIVE=0 to choose the XLA kernels without this warning",
                RuntimeWarning)


@functools.cache
def _registered_targets() -> frozenset[str]:
    try:
        library = _load_library()
        for name, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except Exception as error:  # noqa: BLE001 - whatever went wrong, the XLA kernels remain
        _report_unavailable(error)
        return frozenset()
    return frozenset(_SYMBOLS)


def native_target(name: str) -> str | None:
    """The registered FFI target ``name`` for CPU, building the kernels on first use; None when
    native kernels are off or could not be built (the caller then uses its XLA version), and
    for code lowered for another platform alone (``lowering_for``): a GPU's round asked for them
    while tracing, and a fresh machine's first fit built them there (a C++ compile, 6.3 s on 2
    cores) for a branch its lowering drops."""
    if not native_enabled() or _known_lowering_platform() not in (None, "cpu"):
        return None
    return name if name in _registered_targets() else None


_lowering = threading.local()


@contextlib.contextmanager
def lowering_for(backend: str):
    """Code traced inside will be lowered for the platform ``backend`` alone (a round compiled
    for its mesh's devices): ``per_platform`` then traces only that platform's branch."""
    previous = _known_lowering_platform()
    _lowering.platform = backend
    try:
        yield
    finally:
        _lowering.platform = previous


def _known_lowering_platform() -> str | None:
    """``lowering_for``'s platform around the code traced now, None outside it."""
    return getattr(_lowering, "platform", None)


def lowering_platform() -> str:
    """The platform that code traced now is lowered for: ``lowering_for``'s, else JAX's default
    backend."""
    return _known_lowering_platform() or jax.default_backend()


def per_platform(*args, cpu: Callable, default: Callable):
    """``lax.platform_dependent(*args, cpu=cpu, default=default)``, but tracing only one branch
    where the platform is known (``lowering_for``). Tracing the accelerators' XLA kernels for a
    branch that a CPU round drops took 0.7 s of a first fit with 10-output vector leaves."""
    known = _known_lowering_platform()
    if known is None:
        return lax.platform_dependent(*args, cpu=cpu, default=default)
    return (cpu if known == "cpu" else default)(*args)


# Which kernel a caller asks for: the native one where it is built ("auto"), or either one.
KERNELS = ("auto", "xla", "native")


def available_native_target(name: str, what: str, kernel: str) -> str | None:
    """The FFI target for ``kernel`` ("auto": native where built, "xla": None, "native": the
    target or an error saying why there is none)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    target = None if kernel == "xla" else native_target(name)
    if kernel == "native" and target is None:
        raise RuntimeError(f"the native {what} kernel is unavailable (turned off by JAXBOOST_NATIVE=0, or it "
                           "could not be built: enable debug logging for jaxboost.native to see why)")
    return target


def uninitialized(shape: tuple, dtype, like: jax.Array, tag: int = 0) -> jax.Array:
    """An array of ``shape`` and ``dtype`` whose values are unspecified, for a caller that writes
    every element before it reads any: on CPU a native call that writes nothing, elsewhere (and
    without the native kernels) zeros. ``jnp.zeros`` is written whole first: for the
    derivatives' output of 10-output vector leaves (a device's 80k rows of 55 packed Hessian
    entries), 10 ms a round of each device's time. ``like``: an array inside the same
    ``shard_map`` whose varying axes the result takes. ``tag`` tells a caller's calls apart: XLA
    would take identical calls for one value, one buffer then copied for each use."""
    target = native_target(UNINITIALIZED_TARGET)

    def zeros(like):
        # Varying as the native branch's result is: inside a shard_map that checks it, both
        # branches are traced (platform unknown) and their types must match.
        return as_varying_as(jnp.zeros(shape, dtype), (like,))

    if target is None:
        return zeros(like)

    def native(like):
        result = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype))(tag=np.int64(tag))
        return as_varying_as(result, (like,))

    return per_platform(like, cpu=native, default=zeros)


def as_varying_as(result, inputs):
    """Inside shard_map a custom call's result is typed as replicated, but it varies with the
    local rows like the XLA kernel's: say so, or the two platform branches disagree in type."""
    varying = frozenset().union(*(_varying_axes(x) for x in inputs))
    missing = tuple(sorted(varying - _varying_axes(result)))
    return lax.pcast(result, missing, to="varying") if missing else result


def _varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` varies inside shard_map (empty outside it)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


@functools.cache
def _forest_functions():
    """The native predictor's three entry points: prepare a forest, walk rows through it, free it."""
    library = _load_library()
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    prepare, walk, free = library.JaxboostPrepareForest, library.JaxboostPredictPrepared, library.JaxboostFreeForest
    prepare.restype = walk.restype = ctypes.c_char_p
    prepare.argtypes = [pointer, pointer, pointer, size, size, size, size, ctypes.POINTER(ctypes.c_void_p)]
    walk.argtypes = [pointer, pointer, size, size, size, size, size, size, pointer]
    free.restype, free.argtypes = None, [pointer]
    return prepare, walk, free


def feature_predictor_available() -> bool:
    """Whether ``NativeForest`` can run: native kernels on and built."""
    if not native_enabled():
        return False
    try:
        _forest_functions()
    except Exception as error:  # noqa: BLE001 - whatever went wrong, the XLA predictor remains
        _report_unavailable(error)
        return False
    return True


class NativeForest:
    """Trees checked and laid out once by the native CPU predictor, for walking raw features.

    ``packed`` (``predictor.packed_nodes``), ``thresholds`` (the splits' bin edges) and
    ``values`` are shaped ``(rounds, K, nodes)`` over ``n_features`` features. A row goes left
    when ``x < threshold`` (exactly "bin <= threshold_bin") and NaN takes the node's default
    direction. The native copy is freed with this object."""

    def __init__(self, packed: np.ndarray, thresholds: np.ndarray, values: np.ndarray, n_features: int):
        checks = [(packed, np.int32), (thresholds, np.float32), (values, np.float32)]
        for array, dtype in checks:
            if array.dtype != dtype or array.ndim != 3 or not array.flags.c_contiguous:
                raise TypeError(f"NativeForest needs C-contiguous {dtype.__name__} arrays of 3 dimensions")
        if thresholds.shape != packed.shape or values.shape != packed.shape:
            raise ValueError(f"inconsistent tree shapes: {packed.shape}, {thresholds.shape}, {values.shape}")
        prepare, _, free = _forest_functions()
        rounds, self.outputs, nodes = packed.shape
        self.n_features = int(n_features)
        handle = ctypes.c_void_p()
        error = prepare(packed.ctypes.data, thresholds.ctypes.data, values.ctypes.data, rounds, self.outputs, nodes,
                        self.n_features, ctypes.byref(handle))
        if error:
            raise ValueError(error.decode())
        self._handle = handle.value
        weakref.finalize(self, free, handle.value)

    def add_to(self, X: np.ndarray, raw: np.ndarray, threads: int) -> None:
        """Add every tree's leaf value to ``raw`` (C-contiguous float32 ``(n, K)``, holding the
        starting values) in place, for the rows of ``X`` (float32 or float64 ``(n,
        n_features)``, in any layout). The C++ walk reads ``X`` where it lies, with ``threads``
        threads and without the GIL: float32 rows in C order as they are, any others copied to
        that a block of 64 rows at a time (float64 rounded as NumPy rounds it), so neither a
        float64 ``X`` nor a DataFrame's Fortran-ordered values are copied whole."""
        if X.dtype not in (np.float32, np.float64) or X.ndim != 2:
            raise TypeError("NativeForest.add_to needs float32 or float64 features of 2 dimensions")
        if raw.dtype != np.float32 or raw.ndim != 2 or not raw.flags.c_contiguous:
            raise TypeError("NativeForest.add_to needs a C-contiguous float32 raw of 2 dimensions")
        if X.shape[1] != self.n_features or raw.shape != (X.shape[0], self.outputs):
            raise ValueError(f"inconsistent shapes: X {X.shape} for {self.n_features} features, raw {raw.shape} "
                             f"for {self.outputs} outputs")
        if not raw.flags.writeable:
            raise ValueError("raw must be writeable: it receives the predictions")
        if any(stride % X.itemsize for stride in X.strides):
            X = np.ascontiguousarray(X)  # strides between whole values (a view of raw bytes): copied
        _, walk, _ = _forest_functions()
        row_stride, feature_stride = (stride // X.itemsize for stride in X.strides)
        error = walk(self._handle, X.ctypes.data, int(X.dtype == np.float64), row_stride, feature_stride, X.shape[0],
                     X.shape[1], int(threads), raw.ctypes.data)
        if error:
            raise ValueError(error.decode())
