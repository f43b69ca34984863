"""Cores (``jaxboost.cores``): the cores a process may use, from its affinity mask and its
control group's CPU quota (cgroup v1 and v2 files laid out in a temporary folder) and
``OMP_NUM_THREADS``, and the host devices jaxboost sets up from them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxboost import cores


def _write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def _proc_cgroup(tmp_path, text):
    path = tmp_path / "proc_cgroup"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_v2_quota_is_rounded_up_to_whole_cores(tmp_path):
    root = tmp_path / "cgroup"
    _write(root, "cpu.max", "150000 100000\n")
    assert cores.cgroup_cpu_limit(str(root), _proc_cgroup(tmp_path, "0::/\n")) == 2
    _write(root, "cpu.max", "400000 100000\n")
    assert cores.cgroup_cpu_limit(str(root), _proc_cgroup(tmp_path, "0::/\n")) == 4
    _write(root, "cpu.max", "20000 100000\n")  # a fifth of a core still gets one
    assert cores.cgroup_cpu_limit(str(root), _proc_cgroup(tmp_path, "0::/\n")) == 1


def test_v2_without_quota_is_no_limit(tmp_path):
    root = tmp_path / "cgroup"
    _write(root, "cpu.max", "max 100000\n")
    assert cores.cgroup_cpu_limit(str(root), _proc_cgroup(tmp_path, "0::/\n")) is None


def test_v2_takes_the_tightest_quota_of_the_group_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "jobs" / "job1", "cpu.max", "max 100000\n")
    _write(root / "jobs", "cpu.max", "300000 100000\n")
    _write(root, "cpu.max", "800000 100000\n")
    proc = _proc_cgroup(tmp_path, "0::/jobs/job1\n")
    assert cores.cgroup_cpu_limit(str(root), proc) == 3
    _write(root / "jobs" / "job1", "cpu.max", "100000 50000\n")
    assert cores.cgroup_cpu_limit(str(root), proc) == 2


def test_v1_quota_under_the_cpu_mount_seen_from_a_container(tmp_path):
    # The process's path names the host's group, which a container does not see: its own group
    # is the mount itself.
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct", "cpu.cfs_quota_us", "250000\n")
    _write(root / "cpu,cpuacct", "cpu.cfs_period_us", "100000\n")
    proc = _proc_cgroup(tmp_path, """\
        12:memory:/docker/abc
        4:cpu,cpuacct:/docker/abc
        1:name=systemd:/docker/abc
        """)
    assert cores.cgroup_cpu_limit(str(root), proc) == 3
    _write(root / "cpu,cpuacct", "cpu.cfs_quota_us", "-1\n")
    assert cores.cgroup_cpu_limit(str(root), proc) is None


def test_no_control_groups_is_no_limit(tmp_path):
    assert cores.cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path / "absent_proc")) is None
    root = tmp_path / "cgroup"
    _write(root, "cpu.max", "garbage\n")
    assert cores.cgroup_cpu_limit(str(root), _proc_cgroup(tmp_path, "0::/\n")) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity masks are Linux-only")
def test_available_cores_are_the_affinity_mask_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cores, "_process_cgroup_limit", lambda: None)
    assert cores.available_cpu_cores() == 4
    monkeypatch.setattr(cores, "_process_cgroup_limit", lambda: 2)
    assert cores.available_cpu_cores() == 2
    monkeypatch.setattr(cores, "_process_cgroup_limit", lambda: 8)
    assert cores.available_cpu_cores() == 4


@pytest.mark.parametrize("value, expected", [("3", 3), (" 2 ", 2), ("4,2", 4), ("1", 1), ("", None), ("0", None),
                                             ("-2", None), ("four", None), ("2.5", None)])
def test_omp_thread_limit_reads_the_outer_level_of_a_positive_count(value, expected):
    assert cores.omp_thread_limit(value) == expected


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity masks are Linux-only")
def test_omp_num_threads_caps_the_available_cores(monkeypatch):
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cores, "_process_cgroup_limit", lambda: 3)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cores.available_cpu_cores() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cores.available_cpu_cores() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # never more than the mask and the quota allow
    assert cores.available_cpu_cores() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a count: ignored, as OpenMP ignores it
    assert cores.available_cpu_cores() == 3


def _worker_devices():
    import jax

    import jaxboost

    return os.environ.get("OMP_NUM_THREADS"), len(jax.devices("cpu")), jaxboost.available_cpu_cores()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a Linux process allowed on two or more cores")
def test_joblib_workers_get_their_share_of_the_cores(monkeypatch):
    """joblib's process workers (GridSearchCV's n_jobs) are given OMP_NUM_THREADS = cores over
    workers; jaxboost imported there sets up that many host devices, not one per core, so the
    workers' devices do not outnumber the cores."""
    joblib = pytest.importorskip("joblib")
    for name in ("XLA_FLAGS", "JAXBOOST_NO_DEVICE_SETUP", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    workers = 2
    with joblib.parallel_config(backend="loky", n_jobs=workers):
        seen = joblib.Parallel()(joblib.delayed(_worker_devices)() for _ in range(workers))
    for omp_threads, devices, available in seen:
        assert omp_threads is not None, "joblib no longer sets OMP_NUM_THREADS in its workers"
        assert devices == available == int(omp_threads), seen


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a Linux process allowed on two or more cores")
def test_import_gives_one_device_per_core_of_the_affinity_mask(tmp_path):
    # A process pinned to one core gets one device, not one per machine core.
    script = textwrap.dedent("""\
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import jax
        import jaxboost
        print(len(jax.devices("cpu")), jaxboost.available_cpu_cores())
        """)
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAXBOOST_NO_DEVICE_SETUP")}
    env.update(JAXBOOST_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


def test_rows_are_sharded_over_no_more_devices_than_cores(monkeypatch):
    """JAX may hold more CPU devices than the process has cores (set up before jaxboost, or by
    a flag): rows are then sharded over as many devices as there are cores, and the wide-data
    kernel takes as many threads."""
    import jax

    from jaxboost import devices

    import warnings

    n_devices = len(jax.local_devices())
    rows = 100 * devices.MIN_ROWS_PER_DEVICE
    monkeypatch.setattr(devices, "_warned_extra_devices", False)
    for available in (1, 2, 64):
        monkeypatch.setattr(devices, "available_cpu_cores", lambda available=available: available)
        monkeypatch.setattr(devices, "process_cpu_cores", lambda available=available: available)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert devices.row_mesh(rows).devices.size == min(n_devices, available)
        # Warned once, when there are more devices than cores.
        extra = [w for w in caught if "CPU devices but this process may use" in str(w.message)]
        assert len(extra) == (1 if available == 1 and n_devices > 1 else 0), (available, [str(w.message) for w in caught])
        assert all(w.filename == __file__ for w in extra), [w.filename for w in extra]  # the caller's line
        wide = devices.row_mesh(rows, n_features=1000, max_bin=256)
        assert wide.devices.size == 1
        assert devices.kernel_threads(wide, 1000, 256) == min(n_devices, available)


def test_training_on_the_only_device_of_a_multicore_cpu_warns_once_at_the_callers_line(monkeypatch):
    """JAX started before jaxboost could give it a device per core: training rows enough for two
    devices on its one CPU device warns, once a process, at the user's call (through
    ``jb.train``'s wrappers); predicting does not."""
    import warnings

    import jax

    import jaxboost as jb
    from jaxboost import devices

    cpu = jax.local_devices(backend="cpu")[0]
    monkeypatch.setattr(devices.jax, "local_devices", lambda *args, **kwargs: [cpu])
    monkeypatch.setattr(devices, "available_cpu_cores", lambda: 2)
    monkeypatch.setattr(devices, "_warned_single_device", False)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2 * devices.MIN_ROWS_PER_DEVICE, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        few = 100  # too few rows for two devices: no warning
        jb.train(X[:few], y[:few], loss="logistic", num_rounds=1, max_depth=2).predict(X)
        for _ in range(2):
            jb.train(X, y, loss="logistic", num_rounds=1, max_depth=2)
    single = [w for w in caught if "training on one CPU device" in str(w.message)]
    assert len(single) == 1, [str(w.message) for w in caught]
    assert single[0].category is RuntimeWarning and single[0].filename == __file__, single[0].filename


def test_compiler_options_leave_out_what_this_xla_does_not_know(monkeypatch):
    """A newer XLA refuses options it dropped (jaxlib 0.11 has no xla_cpu_use_fusion_emitters,
    and every CPU round failed to compile there): those are left out, and training works."""
    import jax
    import numpy as np

    import jaxboost as jb
    from jaxboost import boosting, devices

    for platform in ("cpu", "gpu"):  # both tried on the CPU, so both checked here
        table = f"{platform.upper()}_COMPILER_OPTIONS"
        unknown = f"xla_{platform}_option_that_no_release_has"
        monkeypatch.setattr(devices, table, {**getattr(devices, table), unknown: True})
        options = devices.compiler_options(platform)
        assert unknown not in options
        assert options and options.items() <= getattr(devices, table).items()
    if jax.default_backend() not in ("cpu", "gpu"):
        pytest.skip(f"training with the options: jaxboost sets none on {jax.default_backend()}")
    boosting.clear_compiled_rounds()  # rounds take their options when compiled
    try:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(500, 3)).astype(np.float32)
        model = jb.train(X, X[:, 0] + 0.1 * rng.normal(size=500), num_rounds=3, max_depth=3)
    finally:
        boosting.clear_compiled_rounds()
    assert np.corrcoef(model.predict(X), X[:, 0])[0, 1] > 0.9


def test_the_options_found_known_are_kept_for_later_processes(tmp_path, monkeypatch):
    """The trial compile that finds the known options runs once per jaxlib: its answer is kept in
    the cache folder, read by later processes (here: the in-process cache cleared), tried again
    when the file is unreadable or written for another jaxlib, and not kept without a cache."""
    import jaxlib

    from jaxboost import devices

    trials = []
    tried = devices._tried_options
    monkeypatch.setattr(devices, "_tried_options", lambda options: trials.append(options) or tried(options))
    unknown = ("xla_cpu_option_that_no_release_has", True)
    options = tuple(devices.CPU_COMPILER_OPTIONS.items()) + (unknown,)
    # Releases drop options (jaxlib 0.11 has no xla_cpu_use_fusion_emitters): each alone says
    # whether this one knows it.
    known_here = tuple(option for option in options[:-1] if tried((option,)) == (option,))
    assert tried((unknown,)) == ()

    def known(folder: str):
        monkeypatch.setenv("JAXBOOST_CACHE_DIR", folder)
        devices._known_options.cache_clear()
        return devices._known_options(options)

    try:
        first = known(str(tmp_path))
        assert len(trials) == 1 and unknown not in first and first == known_here
        assert known(str(tmp_path)) == first and len(trials) == 1, "the kept answer was not read"
        (tmp_path / devices.OPTIONS_FILE).write_text("{not json")
        assert known(str(tmp_path)) == first and len(trials) == 2
        assert known(str(tmp_path)) == first and len(trials) == 2, "the unreadable file was not written again"
        monkeypatch.setattr(jaxlib, "__version__", jaxlib.__version__ + ".other")
        assert known(str(tmp_path)) == first and len(trials) == 3, "another jaxlib's answer was taken"
        assert known("") == first and len(trials) == 4
        assert known("") == first and len(trials) == 5
    finally:
        devices._known_options.cache_clear()


def test_a_cpu_cores_block_caps_the_cores_and_restores_them(monkeypatch):
    monkeypatch.setattr(cores, "process_cpu_cores", lambda: 4)
    assert cores.available_cpu_cores() == 4
    for n_jobs, expected in ((None, 4), (-1, 4), (1, 1), (3, 3), (64, 4), (-2, 3), (-4, 1), (-9, 1), (np.int64(2), 2)):
        with cores.cpu_cores(n_jobs):
            assert cores.available_cpu_cores() == expected, n_jobs
    with cores.cpu_cores(2):
        with cores.cpu_cores(1):
            assert cores.available_cpu_cores() == 1
        assert cores.available_cpu_cores() == 2  # the outer block's limit again
    assert cores.available_cpu_cores() == 4
    with pytest.raises(RuntimeError, match="inside"), cores.cpu_cores(1):
        raise RuntimeError("inside")
    assert cores.available_cpu_cores() == 4  # restored after an error too


@pytest.mark.parametrize("n_jobs", [0, 1.5, "2", True])
def test_cpu_cores_rejects_zero_and_non_integers(n_jobs):
    with pytest.raises(ValueError, match="n_jobs must be None or a non-zero integer"):
        with cores.cpu_cores(n_jobs):
            pass


def test_rows_are_sharded_over_the_cores_of_the_cpu_cores_block_without_a_warning():
    """A block's limit is the caller's choice: rows go to that many devices, and the warning
    about more devices than cores is not given."""
    import warnings

    import jax

    from jaxboost import devices

    rows = 100 * devices.MIN_ROWS_PER_DEVICE
    outside = devices.row_mesh(rows).devices.size
    assert outside == min(len(jax.local_devices()), cores.process_cpu_cores())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cores.cpu_cores(1):
            assert devices.row_mesh(rows).devices.size == 1
            assert devices.predictor_threads(devices.row_mesh(rows), rows) == 1
