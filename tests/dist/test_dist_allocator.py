"""The allocator settings of the rank processes ``coconet.runtime.spawn`` starts: glibc's
per-thread cache off (``coconet.runtime.allocator``), so that a large buffer freed and allocated
again is served from the heap instead of faulted in again, unless the options say to leave the
allocator alone; the launcher's own environment is left as it was."""

from __future__ import annotations

import os

import pytest
from support.alloc import fault_rounds

from coconet.runtime import CommOptions, spawn
from coconet.runtime.allocator import TCACHE_OFF


def _rounds(comm) -> dict:
    return {"tunables": os.environ.get("GLIBC_TUNABLES"), "faults": fault_rounds(8)}


@pytest.mark.timeout(120)
def test_spawned_ranks_reuse_a_freed_large_buffer_without_faulting_it_in():
    before = os.environ.get("GLIBC_TUNABLES")
    (out,) = spawn(_rounds, 1, timeout=90)
    assert os.environ.get("GLIBC_TUNABLES") == before  # the launcher's environment is as it was
    assert TCACHE_OFF in out["tunables"]
    pages = (4 * (16 << 20)) // 4096
    assert out["faults"][0] >= pages // 2  # the first round maps it
    assert max(out["faults"][1:]) < pages // 10, out["faults"]  # then it is reused


@pytest.mark.timeout(120)
def test_keep_buffers_mapped_false_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    (out,) = spawn(_rounds, 1, options=CommOptions(keep_buffers_mapped=False), timeout=90)
    assert out["tunables"] is None
