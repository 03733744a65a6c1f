"""glibc's mmap threshold fixed at start (services/common/allocator.py)."""

from __future__ import annotations

import platform

import pytest

from services.common.allocator import fix_mmap_threshold


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_threshold_is_fixed_under_glibc() -> None:
    assert fix_mmap_threshold() is True


def test_an_operators_tunable_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert fix_mmap_threshold() is False
