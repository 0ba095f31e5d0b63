"""coconet.ir.opspec: one spec per op, complete, and the single source every layer reads."""

from __future__ import annotations

import pytest

import coconet as cc
from coconet.accounting import account
from coconet.ir import semantics
from coconet.ir.ops import (
    COLLECTIVES,
    COMMUNICATION,
    COMPUTATION,
    POINTWISE,
    REDUCTIONS,
    SHAPES,
    Op,
)
from coconet.ir.opspec import SPECS, Lowering, Prop, missing_parts, ops_with, spec
from coconet.ir.rules import RULES


def test_every_op_has_a_complete_spec():
    assert set(SPECS) == set(Op)
    assert missing_parts() == []
    for op, s in SPECS.items():
        assert s.rule is RULES[op]


def test_properties_match_the_op_groups():
    """The sets that codegen, overlap and reorder used to keep for themselves."""
    assert ops_with(Prop.KERNEL) == COMPUTATION
    assert ops_with(Prop.FRESH) == (POINTWISE - {Op.CAST}) | REDUCTIONS | {
        Op.MATMUL, Op.MATMUL_TN
    } | (COLLECTIVES | {Op.SEND})
    # expand_as spreads one row over many: neither reorderable nor row-wise
    assert ops_with(Prop.REORDERABLE) == (POINTWISE - {Op.EXPAND_AS}) | REDUCTIONS | {Op.SEND}
    assert not ops_with(Prop.ROWWISE) & (SHAPES | {Op.EXPAND_AS, Op.MATMUL_TN})
    assert ops_with(Prop.COMMUNICATES) == COMMUNICATION
    assert Op.REDUCE not in ops_with(Prop.ROWWISE)
    assert {Op.MATMUL, Op.SCATTER, Op.ALL_GATHER, Op.SEND} <= ops_with(Prop.ROWWISE)


@pytest.mark.parametrize("op", sorted(COMMUNICATION, key=lambda o: o.value))
def test_communication_names_its_transport_operation(op):
    s = spec(op)
    assert s.transport is not None and s.sent is not None
    if s.lowering is Lowering.COLLECTIVE:
        assert op in semantics.COLLECTIVES


def test_work_model_counts_matmul_flops_and_pointwise_bytes():
    B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")
    x = cc.Tensor("x", cc.float32, [B, H], cc.Replicated)
    w = cc.Tensor("w", cc.float32, [H, H2], cc.Replicated)
    y = cc.matmul(x, w).named("y")
    z = (y + y).named("z")
    prog = cc.Program("mm", [x, w], {"z": z})
    acc = account(prog, 2, {"B": 4, "H": 8, "H2": 3})
    (mm,) = {acc.work_by_node["y"][0]}
    assert mm.flops == 2 * 4 * 3 * 8
    assert mm.bytes_read == (4 * 8 + 8 * 3) * 4 and mm.bytes_written == 4 * 3 * 4
    add = acc.work_by_node["z"][0]
    assert add.flops == 12 and add.bytes_read == 2 * 12 * 4 and add.bytes_written == 12 * 4
    assert acc.max_flops == mm.flops + add.flops


def test_sliced_work_is_per_rank():
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    rs = cc.reduce_scatter(g, name="g_rs")
    prog = cc.Program("p", [g], {"h": (rs * 2.0).named("h")})
    acc = account(prog, 3, {"N": 7})  # uneven: 3, 2, 2 elements
    assert [w.flops for w in acc.work_by_node["h"]] == [3, 2, 2]


@pytest.mark.parametrize("op", sorted(COMMUNICATION, key=lambda o: o.value))
def test_each_transport_implements_each_communication_op(op):
    """What generated code calls (``comm.<transport op>_start``) exists for every op, and the
    torch.distributed transport has the method the spec names."""
    from coconet.runtime.comm import Communicator
    from coconet.runtime.torchdist import TorchDistributedTransport

    name = spec(op).transport
    assert callable(getattr(TorchDistributedTransport, name))
    assert getattr(Communicator, f"{name}_start").__name__ == f"{name}_start"


def test_every_communication_op_has_a_typed_start_and_a_cost_shape():
    """``Communicator.start`` dispatches through a table of typed entry points, one per
    communication op, named by the spec; the cost model reads each op's ``CommCost``."""
    from coconet.ir.opspec import Traffic
    from coconet.runtime.comm import _STARTS

    assert set(_STARTS) == set(COMMUNICATION)
    for op in COMMUNICATION:
        assert _STARTS[op].__name__ == f"{spec(op).transport}_start"
        cost = spec(op).comm_cost
        assert cost is not None and (cost.traffic is not Traffic.RING or cost.ring_passes >= 1)


@pytest.mark.parametrize("transport", ["torchdist", "shmem", "hierarchy"])
def test_each_transport_implements_the_protocol_with_its_signatures(transport):
    """Every transport has every method of ``Transport``, with the protocol's parameters (the
    communicator calls them by keyword)."""
    import inspect

    from coconet.runtime import hierarchy, shmem, torchdist
    from coconet.runtime.transport import Transport

    cls = {
        "torchdist": torchdist.TorchDistributedTransport,
        "shmem": shmem.SharedMemoryTransport,
        "hierarchy": hierarchy.HierarchicalTransport,
    }[transport]
    for op in COMMUNICATION:
        name = spec(op).transport
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have == want, (cls.__name__, name)
