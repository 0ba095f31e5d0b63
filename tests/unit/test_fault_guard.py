"""``FaultGuard`` (``coconet.runtime.faults``): the job's failures become a ``RuntimeFault`` that
breaks the communicator; a bug raises as itself and breaks nothing (no processes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from coconet.errors import RuntimeFault
from coconet.runtime.faults import FaultGuard, is_peer_failure


def _guard() -> FaultGuard:
    return FaultGuard(0, 2, "gloo", 7.0, lambda axis: (0, 1))


def _raise(exc: BaseException):
    def fn():
        raise exc

    return fn


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), "died"),
        (RuntimeError("Connection reset by peer"), "died"),
        (RuntimeError("Timed out waiting 7000ms for recv operation to complete"), "within 7 s"),
        (dist.DistBackendError("NCCL error in: ... unhandled system error"), "failed"),
        (ConnectionResetError(104, "Connection reset"), "failed"),
        (BrokenPipeError(32, "Broken pipe"), "died"),
    ],
)
def test_a_failure_of_the_job_is_a_fault_that_breaks_the_communicator(exc, cause):
    guard = _guard()
    assert is_peer_failure(exc)
    with pytest.raises(RuntimeFault, match=cause) as info:
        guard("all_reduce", "g_sum", None, _raise(exc))
    assert "g_sum" in str(info.value) and "ranks [0, 1]" in str(info.value)
    assert guard.broken is not None
    with pytest.raises(RuntimeFault, match="unusable after an earlier failure"):
        guard("all_reduce", "next", None, lambda: 1)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("too many values to unpack"),
        TypeError("unsupported operand type(s)"),
        IndexError("list index out of range"),
        RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at dim 0"),
    ],
)
def test_a_bug_raises_as_itself_and_breaks_nothing(exc):
    guard = _guard()
    assert not is_peer_failure(exc)
    with pytest.raises(type(exc)) as info:
        guard("all_reduce", "g_sum", None, _raise(exc))
    assert info.value is exc
    assert guard.broken is None
    assert guard("all_reduce", "next", None, lambda: 41) == 41


def test_a_fault_raised_inside_passes_through():
    fault = RuntimeFault("a peer rank died", op="shared memory")
    with pytest.raises(RuntimeFault) as info:
        _guard()("reduce_scatter", "g", None, _raise(fault))
    assert info.value is fault
