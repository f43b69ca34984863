"""Host memory: fewer glibc malloc arenas for XLA's many threads, their free pages handed back
during training, and aligned host buffers.

glibc gives each thread that allocates while another holds the lock an arena of its own (up to
eight per core), and every arena keeps what its thread freed. XLA's CPU runtime runs many
threads (compiling, one per device, its thread pools), so arenas pile up. A 1M x 28
classification fit of 100 rounds on 2 cores peaked at 733-861 MB with glibc's default and at
694-696 MB with four arenas, its compiled round loaded from the cache (802-859 against 861-892
MB when it compiles, as LLVM's own peak comes on top). One arena slowed XLA's compilation by a
third (threads queue on its lock); two per core kept it, and training's speed, as they were.
Measured again once training handed pages back (below): on 2 cores one arena held 15 MB less at
the benchmark's peak (522-530 MB against 530-552, four runs each), as fast a tree, but a compile
took 8% longer (1.02-1.04 -> 1.11-1.14 s) and the test suite, mostly compiles, 16% (113 -> 131
s). Not adopted.

At import, on glibc, jaxboost caps the arenas at two per core with ``mallopt`` unless the user
chose already: ``MALLOC_ARENA_MAX`` in the environment is left to glibc, and
``JAXBOOST_MALLOC_ARENAS=N`` sets the cap (0 leaves glibc's default).

Even so, the arenas keep the freed blocks of XLA's per-round buffers, and as the rounds' blocks
fragment them, a process could hold hundreds of MB that nothing uses (a 1M x 28 fit of 100
rounds peaked at 599-1154 MB over eight runs, three of them above 780). Training hands those
free pages back every few rounds (``release_free_memory``, glibc's ``malloc_trim``): the same
fit then peaked at 564-628 MB, no slower. A fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_`` of
256 KB or 1 MB, so that large blocks go straight back to the system when freed) took the
benchmark's peak from 534-546 to 518-523 MB, but every round's buffers then came as fresh
zeroed pages: 22.7-23.0 -> 28.3-30.0 ms a tree, binning 2-3x slower. Not adopted.

Python's cyclic garbage collector pauses while training traces and compiles its programs
(``collection_paused``): tracing makes many short-lived objects, so the collector ran again and
again, its oldest generation scanning every object JAX and its modules hold.

JAX's CPU client uses a NumPy array in place, without copying it, when its data start on a
64-byte boundary: ``aligned_empty`` makes such arrays, so data placed on the host devices
exist once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import platform

import numpy as np

from .cores import available_cpu_cores

_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas() -> int | None:
    """Cap glibc's malloc arenas (see the module docstring); returns the cap set, or None."""
    if os.environ.get("MALLOC_ARENA_MAX") or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    chosen = os.environ.get("JAXBOOST_MALLOC_ARENAS")
    try:
        arenas = int(chosen) if chosen else 2 * available_cpu_cores()
    except ValueError:
        raise ValueError(f"JAXBOOST_MALLOC_ARENAS must be a whole number; got {chosen!r}") from None
    if arenas <= 0:
        return None
    libc = _glibc()
    try:
        return arenas if libc is not None and libc.mallopt(_M_ARENA_MAX, arenas) == 1 else None
    except AttributeError:
        return None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the free pages that glibc's malloc arenas hold back to the system (``malloc_trim``);
    returns whether this was possible (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


# Below this many rows a Dataset's and a round's buffers are small, and a hand-back (0.1-0.5 ms)
# costs more than they hold: it was a tenth of a one-round fit on 200 rows.
RELEASE_MIN_ROWS = 65536


def release_free_memory_after(n_rows: int) -> bool:
    """``release_free_memory`` after work on ``n_rows`` rows, if they are enough
    (``RELEASE_MIN_ROWS``) to leave free pages worth handing back; returns whether it ran."""
    return n_rows >= RELEASE_MIN_ROWS and release_free_memory()


@contextlib.contextmanager
def collection_paused(paused: bool = True):
    """Python's cyclic garbage collector off inside (when ``paused``), as it was after: for
    tracing and compiling, whose objects go by reference counting. The collections it skips
    took 50-140 ms of a 1.4-1.5 s first fit (10 classes, full-Hessian vector leaves, 4k rows)."""
    was_enabled = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# The alignment at which a CPU device uses a host buffer in place (``jax.device_put`` copies
# less aligned arrays).
HOST_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype=np.float32, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous array whose data start on an ``alignment``-byte boundary,
    so that ``jax.device_put`` to a CPU device uses it in place."""
    dtype = np.dtype(dtype)
    n_bytes = int(np.prod(shape)) * dtype.itemsize
    buffer = np.empty(n_bytes + alignment, np.uint8)
    offset = -buffer.ctypes.data % alignment
    return buffer[offset:offset + n_bytes].view(dtype).reshape(shape)
