"""Cores: how many CPU cores this process may use, which sets jaxboost's host devices and threads.

``os.cpu_count()`` counts the machine's cores, but a process is often given fewer: an affinity
mask (``taskset``, a batch scheduler's CPU set) or a CPU quota on its control group (a
container's ``--cpus``, a Kubernetes CPU limit). One host device per machine core then puts many
devices on few cores, and every level each device waits for the slowest at the sum over devices:
400k x 28 rows at depth 6 on a 2-core machine took 27.9 ms a tree on 16 devices, 20.0 on 8 and
11.7 on 2. XGBoost reads the same quota for its default thread count.

``OMP_NUM_THREADS`` caps the count too, as it caps XGBoost's and LightGBM's OpenMP threads:
joblib sets it in its process workers (scikit-learn's ``GridSearchCV(n_jobs=...)``,
``cross_val_score``) to the cores over the workers, so that each worker's library does not take
every core and the workers do not wait on each other's threads.

Inside a ``cpu_cores(n)`` block (the scikit-learn estimators' ``n_jobs``) jaxboost takes at most
``n`` of them: its rows are sharded over that many host devices, and its binning, histogram and
prediction threads are as many.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import os
from collections.abc import Iterator

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


# The innermost cpu_cores block's limit (None outside any): a context variable, so that threads
# and asyncio tasks each see their own.
_block_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxboost_cpu_cores", default=None)


def available_cpu_cores() -> int:
    """The CPU cores jaxboost may use here: ``process_cpu_cores()``, capped by the limit of the
    ``cpu_cores`` block this runs in, if any; at least 1."""
    cores = process_cpu_cores()
    limit = _block_limit.get()
    return cores if limit is None else min(cores, limit)


def process_cpu_cores() -> int:
    """The CPU cores this process may use: the cores in its affinity mask, capped by its control
    group's CPU quota (rounded up to whole cores) and by ``OMP_NUM_THREADS`` when it is set; at
    least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    for limit in (_process_cgroup_limit(), omp_thread_limit()):
        if limit is not None:
            cores = min(cores, limit)
    return max(1, cores)


@contextlib.contextmanager
def cpu_cores(n_jobs: int | None) -> Iterator[None]:
    """Train and predict with at most ``n_jobs`` CPU cores inside the block: ``None`` or -1 for
    all the process may use (``process_cpu_cores``), a positive count for that many (never more
    than the process may use), -2 for all but one and so on (joblib's convention).

    A fit in the block shards its rows over at most that many host devices (another set of
    devices than a fit outside it, so its round compiles anew), and the binning, the wide-data
    histogram kernel and the host predictor take at most that many threads. JAX's own CPU thread
    pool keeps the size it was given when JAX started.

    Raises:
      ValueError: ``n_jobs`` is 0 or not an integer.
    """
    if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, numbers.Integral) or n_jobs == 0):
        raise ValueError(f"n_jobs must be None or a non-zero integer (-1 for every core), got {n_jobs!r}")
    if n_jobs is None:
        limit = None
    elif n_jobs > 0:
        limit = int(n_jobs)
    else:
        limit = max(1, process_cpu_cores() + 1 + int(n_jobs))
    token = _block_limit.set(limit)
    try:
        yield
    finally:
        _block_limit.reset(token)


def omp_thread_limit(value: str | None = None) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` (or ``value``) asks for, or None when it is unset or
    not a positive count. OpenMP reads a comma-separated list as counts for nested levels; the
    first is the outermost, the one a library's own threads run at."""
    if value is None:
        value = os.environ.get("OMP_NUM_THREADS", "")
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        return None
    return int(first)


@functools.cache
def _process_cgroup_limit() -> int | None:
    """``cgroup_cpu_limit()``, read once a process: training and binning ask for the cores on
    every call, and reading the files took 0.2 ms each time."""
    return cgroup_cpu_limit()


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """The tightest CPU quota on this process's control group or its ancestors, in cores rounded
    up, or None when there is none (or no control groups to read).

    cgroup v2 keeps ``quota period`` (or ``max period``) in ``cpu.max``; v1 keeps
    ``cpu.cfs_quota_us`` (-1 for none) and ``cpu.cfs_period_us`` under the ``cpu`` controller's
    mount. A container usually sees its own group as the mount itself, so the mount is read
    too when the process's path is not found below it."""
    limits = []
    for folder, version in _cgroup_folders(root, proc_cgroup):
        limit = _read_v2_limit(folder) if version == 2 else _read_v1_limit(folder)
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def _cgroup_folders(root: str, proc_cgroup: str) -> list[tuple[str, int]]:
    """The folders holding this process's CPU quota files, from its own group up to the mount,
    each with its cgroup version."""
    try:
        with open(proc_cgroup) as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            mount, version = root, 2
        elif "cpu" in controllers.split(","):
            mount = next((os.path.join(root, name) for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")
                          if os.path.isdir(os.path.join(root, name))), None)
            if mount is None:
                continue
            version = 1
        else:
            continue
        folders.extend((folder, version) for folder in _up_to(mount, path))
    return folders


def _up_to(mount: str, path: str) -> list[str]:
    """``mount``/``path`` and its parents up to ``mount``; just ``mount`` when ``path`` is not
    there (the process sees its own group at the mount)."""
    parts = [part for part in path.split("/") if part and part != ".."]
    folders = [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), 0, -1)]
    return [folder for folder in folders if os.path.isdir(folder)] + [mount]


def _read_v2_limit(folder: str) -> int | None:
    fields = _read_fields(os.path.join(folder, "cpu.max"))
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _whole_cores(fields[0], fields[1])


def _read_v1_limit(folder: str) -> int | None:
    quota = _read_fields(os.path.join(folder, "cpu.cfs_quota_us"))
    period = _read_fields(os.path.join(folder, "cpu.cfs_period_us"))
    if len(quota) != 1 or len(period) != 1:
        return None
    return _whole_cores(quota[0], period[0])


def _read_fields(file_path: str) -> list[str]:
    try:
        with open(file_path) as file:
            return file.read().split()
    except OSError:
        return []


def _whole_cores(quota: str, period: str) -> int | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no quota
        return None
    return max(1, math.ceil(quota_us / period_us))
