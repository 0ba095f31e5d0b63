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
