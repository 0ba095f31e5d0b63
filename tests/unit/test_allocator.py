"""The allocator tuning coconet.runtime.init applies by default (glibc only)."""

import ctypes.util
import sys

import pytest

from coconet.options import CommOptions
from coconet.runtime.allocator import keep_large_buffers_mapped


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
    reason="glibc only",
)
def test_glibc_malloc_is_tuned_and_it_is_the_default():
    assert keep_large_buffers_mapped() is True
    assert CommOptions().keep_buffers_mapped is True


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
    reason="glibc only",
)
def test_a_freed_large_buffer_comes_back_without_page_faults():
    """What the tuning is for: a step's large temporary, freed and allocated again the next step,
    is served from the kept heap, not faulted in page by page. glibc's defaults map and unmap
    a buffer this large (above their 32 MiB ceiling) every time: 16,384 faults per round.
    Tuned, it settles within a few rounds: each aligned allocation leaves a small remainder
    that glibc's per-thread cache holds (7 per size), which keeps the freed buffer from joining
    the heap's top until that cache is full (measured here: rounds 4-12)."""
    from support.alloc import fault_rounds

    keep_large_buffers_mapped()
    n = 16 << 20  # 64 MiB
    faults = fault_rounds(16, n)
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)  # hand the heap back
    assert max(faults[-2:]) < (4 * n // 4096) // 10, faults


def test_the_rank_environment_adds_the_tcache_setting_and_keeps_the_users():
    from coconet.runtime.allocator import TCACHE_OFF, rank_environment

    assert rank_environment({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": TCACHE_OFF}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"})["GLIBC_TUNABLES"] == (
        f"glibc.malloc.mxfast=0:{TCACHE_OFF}"
    )
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}
    assert rank_environment(mine) == mine  # the user's own tcache setting stands
