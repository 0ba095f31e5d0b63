"""The shared-memory transport's C reduction (shm_sync.c's ``cn_reduce``, what ``cn_one_shot``
computes for small all_reduces) gives the same bits at every vector width this CPU has, and the
same bits as torch's rank-order reduction; the width in use follows torch's own
(``ATEN_CPU_CAPABILITY``), capped by the CPU (``coconet.runtime.native``)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.runtime import native

# shm_sync.c's dtype and op codes (shmem._NATIVE, shmem._NATIVE_OPS)
DTYPES = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}
SUM, PROD, MAX, MIN = 0, 1, 2, 3


@pytest.fixture(scope="module")
def lib():
    return native.sync_library()


def _cpu_most(lib) -> int:
    """The widest this CPU has (cn_set_width(-1)), leaving the width in use as it was."""
    in_use = lib.cn_set_width(native._torch_width())
    most = lib.cn_set_width(-1)
    lib.cn_set_width(in_use)
    return most


def _reduce(lib, parts: list[torch.Tensor], op: int, width: int) -> tuple[torch.Tensor, int]:
    out = torch.empty_like(parts[0])
    inputs = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    used = lib.cn_reduce(inputs, out.data_ptr(), parts[0].numel(), DTYPES[parts[0].dtype], op,
                         len(parts), width)  # fmt: skip
    return out, used


def _rank_order(parts: list[torch.Tensor], op: int) -> torch.Tensor:
    combine = {SUM: torch.add, PROD: torch.mul, MAX: torch.maximum, MIN: torch.minimum}[op]
    total = parts[0].clone()
    for p in parts[1:]:
        total = combine(total, p)
    return total


def _floats(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random values with the awkward ones mixed in: signed zeros, infinities, NaN, subnormals
    and the largest finite values (whose sums overflow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=dtype) * torch.exp2(
        torch.randint(-30, 30, (n,), generator=g).to(dtype)
    )
    info = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny / 4, -info.tiny / 3,
         info.max, -info.max], dtype=dtype,
    )  # fmt: skip
    at = torch.randint(0, n, (min(n, 3 * len(special)),), generator=g)
    x[at] = special[torch.arange(len(at)) % len(special)]
    return x


def test_the_width_in_use_follows_torch_and_never_exceeds_the_cpu(lib):
    most = _cpu_most(lib)
    wanted = native._torch_width()
    assert native.vector_width() == {v: k for k, v in native.WIDTHS.items()}[min(wanted, most)]
    # asking for more than the CPU has gives what it has; the baseline is always there
    assert lib.cn_set_width(2) == most
    assert lib.cn_set_width(0) == 0
    lib.cn_set_width(wanted)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64]),
    op=st.sampled_from([SUM, PROD]),
    ranks=st.integers(1, 5),
    n=st.integers(1, 300),  # odd lengths: every width's remainder loop runs
    seed=st.integers(0, 2**16),
)
def test_every_width_gives_the_same_bits_as_torchs_rank_order_for_floats(
    lib, dtype, op, ranks, n, seed
):
    parts = [_floats(dtype, n, seed + r) for r in range(ranks)]
    expected = _rank_order(parts, op)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    for width in range(_cpu_most(lib) + 1):
        out, used = _reduce(lib, parts, op, width)
        assert used == width
        # NaNs compare by position (their payload bits follow the hardware's rule for two
        # NaN operands, which torch's kernels share); everything else bit for bit
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out[~nan].view(bits), expected[~nan].view(bits)), (width, dtype, op)


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.int32, torch.int64]),
    op=st.sampled_from([SUM, PROD, MAX, MIN]),
    ranks=st.integers(1, 5),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_every_width_gives_the_same_integers_as_torch_wrapping_alike(lib, dtype, op, ranks, n,
                                                                      seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    parts = [torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)
             for _ in range(ranks)]  # fmt: skip
    expected = _rank_order(parts, op)
    for width in range(_cpu_most(lib) + 1):
        out, used = _reduce(lib, parts, op, width)
        assert used == width
        assert torch.equal(out, expected), (width, dtype, op)


def test_a_reduction_without_code_is_refused_at_every_width(lib):
    parts = [torch.ones(4), torch.ones(4)]
    for width in range(_cpu_most(lib) + 1):
        assert _reduce(lib, parts, MAX, width)[1] == -1  # float MAX stays with torch (NaN rules)
