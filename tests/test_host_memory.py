"""Host memory (``jaxboost.host_memory``): the malloc-arena cap set at import (who chooses it,
and bad input), the hand-back of the arenas' free pages, and the garbage collector's pause
while training compiles."""

from __future__ import annotations

import gc
import os
import platform

import numpy as np
import pytest

from jaxboost import host_memory

on_glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                              reason="the arena cap applies to glibc only")


@on_glibc
def test_cap_defaults_to_two_arenas_per_core(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("JAXBOOST_MALLOC_ARENAS", raising=False)
    monkeypatch.setattr(host_memory, "available_cpu_cores", lambda: 3)
    assert host_memory.limit_malloc_arenas() == 6


@on_glibc
def test_cap_follows_the_users_choice(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv("JAXBOOST_MALLOC_ARENAS", "5")
    assert host_memory.limit_malloc_arenas() == 5
    monkeypatch.setenv("JAXBOOST_MALLOC_ARENAS", "0")
    assert host_memory.limit_malloc_arenas() is None
    # glibc's own variable wins: jaxboost leaves the arenas alone.
    monkeypatch.setenv("JAXBOOST_MALLOC_ARENAS", "5")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    assert host_memory.limit_malloc_arenas() is None


def test_bad_cap_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(host_memory.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setenv("JAXBOOST_MALLOC_ARENAS", "four")
    with pytest.raises(ValueError, match="JAXBOOST_MALLOC_ARENAS must be a whole number"):
        host_memory.limit_malloc_arenas()


@on_glibc
def test_release_free_memory_hands_freed_heap_pages_back():
    """Blocks freed below a live one stay resident in glibc's heap until handed back; then the
    process's resident memory drops by about their size (75 MB here)."""
    def resident_mb():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    blocks = [np.ones(8192) for _ in range(1200)]  # 64 KB each: heap blocks, below the mmap threshold
    last = blocks[-1]
    del blocks
    before = resident_mb()
    assert host_memory.release_free_memory()
    assert before - resident_mb() > 40, (before, resident_mb())
    assert last.sum() == 8192


def test_small_work_does_not_hand_pages_back(monkeypatch):
    """After small data (fewer than RELEASE_MIN_ROWS rows) there is little to hand back, and a
    hand-back costs 0.1-0.5 ms: it is skipped; from that many rows on it runs."""
    calls = []
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: calls.append(1) or True)
    assert not host_memory.release_free_memory_after(host_memory.RELEASE_MIN_ROWS - 1)
    assert calls == []
    assert host_memory.release_free_memory_after(host_memory.RELEASE_MIN_ROWS)
    assert calls == [1]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collection_paused_pauses_and_restores_the_collector(enabled_before):
    collection_paused = host_memory.collection_paused
    (gc.enable if enabled_before else gc.disable)()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with collection_paused(False):
            assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError), collection_paused():
            raise RuntimeError("a loss that fails while tracing")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


def test_training_leaves_the_collector_on_also_when_a_loss_fails_to_trace():
    """Training pauses the collector while its programs compile; neither a finished fit nor one
    whose loss raises while traced leaves it off."""
    import jaxboost as jb

    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    y = X[:, 0].astype(np.float32)
    jb.train(X, y, num_rounds=2, max_depth=2)
    assert gc.isenabled()

    def broken(y_true, raw_prediction):
        raise ValueError("this loss cannot be traced")

    with pytest.raises(ValueError, match="cannot be traced"):
        jb.train(X, y, loss=broken, num_rounds=2, max_depth=2)
    assert gc.isenabled()
    jb.train_many(X, y, batch={"reg_lambda": np.array([1.0, 2.0])}, num_rounds=2, max_depth=2)
    assert gc.isenabled()
