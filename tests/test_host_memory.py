"""The malloc-arena cap set at import (``jaxboost.host_memory``): who chooses it, and bad input."""

from __future__ import annotations

import platform

import pytest

from jaxboost import host_memory

on_glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                              reason="the arena cap applies to glibc only")


@on_glibc
def test_cap_defaults_to_two_arenas_per_core(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("JAXBOOST_MALLOC_ARENAS", raising=False)
    monkeypatch.setattr(host_memory.os, "cpu_count", lambda: 3)
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
