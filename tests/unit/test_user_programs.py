"""Programs a user writes from the README alone, against plain-torch references (issue 12): a
Lion optimizer and an RMSNorm block, world-size agnostic with no extra runtime scalars (the
averaged gradient is ``ReduceOp.MEAN``, the mean over the hidden dim divides by its ``Dim``) and
with no ``where`` tricks (``sign``, ``mean``, ``rsqrt``). Each runs unscheduled and under the
paper's schedules on 1-4 simulated ranks, and its generated code runs on a world of one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.generated import run_generated
from support.tolerances import schedule_rtol

import coconet as cc
from coconet.codegen import lower
from coconet.codegen.forms import one_pass
from coconet.schedule import RS_C_AG, Schedule, fuse_RS_C_AG

N, B, H = cc.Dim("N"), cc.Dim("B"), cc.Dim("H")


# ---------------------------------------------------------------------------------------------
# Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2)


def lion() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
    lr, beta1, beta2, wd = (cc.Scalar(s) for s in ("lr", "beta1", "beta2", "wd"))
    grad = cc.all_reduce(g, cc.ReduceOp.MEAN, name="grad")  # DDP's averaged gradient
    c = (beta1 * m + (1 - beta1) * grad).named("c")
    p_new = (p - lr * (cc.sign(c) + wd * p)).named("p_new")
    m_new = (beta2 * m + (1 - beta2) * grad).named("m_new")
    return cc.Program("lion", [g, p, m, lr, beta1, beta2, wd],
                      [cc.update(p, p_new), cc.update(m, m_new)])  # fmt: skip


def lion_reference(grads, p, m, lr, beta1, beta2, wd):
    """Lion on the mean gradient, in plain torch (the paper's pseudo-code, decoupled decay)."""
    g = sum(grads[1:], grads[0]) / len(grads)
    update = torch.sign(beta1 * m + (1 - beta1) * g)
    p = p * (1 - lr * wd) - lr * update
    return p, beta2 * m + (1 - beta2) * g


HYPER = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "wd": 0.1}


def _lion_inputs(world: int, n: int) -> dict:
    gen = torch.Generator().manual_seed(world * 100 + n)
    return {
        "g": [torch.randn(n, generator=gen) for _ in range(world)],
        "p": torch.randn(n, generator=gen),
        "m": torch.randn(n, generator=gen),
        **HYPER,
    }


@pytest.mark.parametrize("schedule", ["none", "RS_C_AG", "fuse_RS_C_AG"])
def test_lion_matches_its_reference_on_any_world(schedule, tmp_path):
    program = lion()
    target = {
        "none": Schedule(program),
        "RS_C_AG": RS_C_AG(program, state=("m",)),
        "fuse_RS_C_AG": fuse_RS_C_AG(program, state=("m",)),
    }[schedule]
    for world in (1, 2, 3, 4):
        for n in (1, 7, 16):
            ins = _lion_inputs(world, n)
            res = cc.simulate(target.program, ins, world)
            want_p, want_m = lion_reference(ins["g"], ins["p"], ins["m"], **HYPER)
            # p * (1 - lr * wd) and p - lr * wd * p round differently: a few ulp
            torch.testing.assert_close(res.updated("p"), want_p, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(res.updated("m"), want_m, rtol=1e-6, atol=1e-7)
            # the schedule only moves data: bitwise the unscheduled program
            base = cc.simulate(program, ins, world)
            assert schedule_rtol(program, target.program) == 0.0
            assert torch.equal(res.updated("p"), base.updated("p"))
    if schedule == "fuse_RS_C_AG":
        # one kernel: the momentum, which the all_gather does not need, joins the update's
        # kernel, so the group is one pass over shared memory
        (unit,) = lower(target.program).fused_collectives
        assert len(unit.kernels) == 1 and one_pass(unit) is not None
    compiled = cc.compile(target, world=1, cache_dir=tmp_path, fused_kernels=False)
    ins = _lion_inputs(1, 9)
    _, updates = run_generated(compiled, ins)
    want = cc.simulate(target.program, ins, 1)
    assert torch.equal(updates["p"], want.updates["p"][0])
    assert torch.equal(updates["m"], want.updates["m"][0])


# ---------------------------------------------------------------------------------------------
# all_reduce -> bias -> gelu -> RMSNorm -> residual (a tensor-parallel block's epilogue)


def rms_block(eps: float = 1e-6) -> cc.Program:
    part = cc.Tensor("part", cc.float32, [B, H], cc.Local)  # row-parallel matmul's partials
    bias = cc.Tensor("bias", cc.float32, [H], cc.Replicated)
    weight = cc.Tensor("weight", cc.float32, [H], cc.Replicated)
    resid = cc.Tensor("resid", cc.float32, [B, H], cc.Replicated)
    y = cc.gelu(cc.all_reduce(part, name="y_sum") + bias).named("y")
    rms = cc.rsqrt(cc.mean(y * y, dim=-1, keepdim=True) + eps).named("rms")
    out = (y * rms * weight + resid).named("out")
    return cc.Program("rms_block", [part, bias, weight, resid], {"out": out})


def rms_reference(parts, bias, weight, resid, eps=1e-6):
    y = F.gelu(sum(parts[1:], parts[0]) + bias)
    return F.rms_norm(y, (y.shape[-1],), weight, eps) + resid


def _block_inputs(world: int, b: int, h: int) -> dict:
    gen = torch.Generator().manual_seed(world * 10 + b + h)
    return {
        "part": [torch.randn(b, h, generator=gen) for _ in range(world)],
        "bias": torch.randn(h, generator=gen),
        "weight": torch.randn(h, generator=gen),
        "resid": torch.randn(b, h, generator=gen),
    }


@pytest.mark.parametrize("schedule", ["none", "MM_RS_C_AG"])
def test_rms_norm_block_matches_torch(schedule, tmp_path):
    program = rms_block()
    if schedule == "none":
        target = Schedule(program)
    else:  # reduce_scatter, the epilogue on row slices (one kernel), all_gather
        target = Schedule(program, "MM_RS_C_AG")
        rs, ag = target.split("y_sum")
        target.reorder(target.computations(ag), ag)
        target.fuse(target.computations(rs))
    for world in (1, 2, 3):
        for b, h in ((5, 8), (2, 3)):
            ins = _block_inputs(world, b, h)
            got = cc.simulate(target.program, ins, world).output("out")
            want = rms_reference(ins["part"], ins["bias"], ins["weight"], ins["resid"])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    compiled = cc.compile(target, world=1, cache_dir=tmp_path, fused_kernels=False)
    assert "env.values['size_1']" in compiled.source  # H, bound when the step runs
    ins = _block_inputs(1, 4, 6)
    outputs, _ = run_generated(compiled, ins)
    assert torch.equal(outputs["out"], cc.simulate(target.program, ins, 1).outputs["out"][0])
