"""coconet: the generated step of program lamb."""

# program:  lamb  (digest b8f922e7901d0cc1)
# schedule: schedule fuse_RS_C_AG of lamb: split(g_sum); reorder(computations(g_sum), g_sum);
#   as_slice([m, v]); fuse([g_sum_rs, mul_1_slice, sub_1, mul_2_slice, ..., dir_norm_sq,
#   dir_norm_partial (23 values)]); fuse([p_norm, gt_1, dir_norm, gt_2, ..., p_new_slice, p_new
#   (11 values)])
# mesh:     Mesh(world=2)    device: cpu
# key:      <masked: depends on torch and the CPU>
#
# step() runs one step on the calling rank and returns (outputs, updates); the
# runtime commits the updates into the caller's tensors once every rank succeeded.
# Collectives start as soon as their inputs are ready and are waited for just
# before their first use.

import torch

from coconet.ir.ops import Op, ReduceOp  # noqa: F401
from coconet.ir import semantics as _ops

# the program's constants: 0-d tensors of their dtype, as in the simulator
_c1 = torch.tensor(0, dtype=torch.float32)  # const_1, const_6
_c2 = torch.tensor(1, dtype=torch.float32)  # const_2, const_3, const_4, const_5
_c3 = torch.tensor(1.0, dtype=torch.float32)  # const_7, const_8

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]
_div = _ops.POINTWISE[Op.DIV]
_gt = _ops.POINTWISE[Op.GT]
_mul = _ops.POINTWISE[Op.MUL]
_pow = _ops.POINTWISE[Op.POW]
_sqrt = _ops.POINTWISE[Op.SQRT]
_sub = _ops.POINTWISE[Op.SUB]
_where = _ops.POINTWISE[Op.WHERE]

# the program's inputs, in the order step() takes them
INPUTS = ('g', 'p', 'm', 'v', 'lr', 'beta1', 'beta2', 'eps', 'weight_decay', 'step')
REPLICA_INPUTS = ('p',)
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'p_norm_sumsq'


def _kernel_fused_1_one_pass(beta1, m, sub_1, g_sum_rs_parts, sub_2, beta2, v, sub_3, sub_4, eps, weight_decay, p_slice):
    """fuse([mul_1_slice, sub_1, g_sum_rs, ..., dir_norm_partial (23 values)]): one pass over shared memory (torch.compile, or eager)."""
    # g_sum_rs: this rank's slice, reduced from every peer's in rank order
    g_sum_rs = _ops.reduce_values(ReduceOp.SUM, g_sum_rs_parts)
    # mul_1_slice = mul(beta1, m)  at examples/lamb.py:82
    mul_1_slice = _mul(beta1, m)
    # mul_2_slice = mul(sub_1, g_sum_rs)  at examples/lamb.py:82
    mul_2_slice = _mul(sub_1, g_sum_rs)
    # m_new_slice = add(mul_1_slice, mul_2_slice)  at examples/lamb.py:82
    m_new_slice = _add(mul_1_slice, mul_2_slice)
    # div_1_slice = div(m_new_slice, sub_2)  at examples/lamb.py:84
    div_1_slice = _div(m_new_slice, sub_2)
    # mul_3_slice = mul(beta2, v)  at examples/lamb.py:83
    mul_3_slice = _mul(beta2, v)
    # mul_4_slice = mul(sub_3, g_sum_rs)  at examples/lamb.py:83
    mul_4_slice = _mul(sub_3, g_sum_rs)
    # mul_5_slice = mul(mul_4_slice, g_sum_rs)  at examples/lamb.py:83
    mul_5_slice = _mul(mul_4_slice, g_sum_rs)
    # v_new_slice = add(mul_3_slice, mul_5_slice)  at examples/lamb.py:83
    v_new_slice = _add(mul_3_slice, mul_5_slice)
    # div_2_slice = div(v_new_slice, sub_4)  at examples/lamb.py:85
    div_2_slice = _div(v_new_slice, sub_4)
    # sqrt_1_slice = sqrt(div_2_slice)  at examples/lamb.py:86
    sqrt_1_slice = _sqrt(div_2_slice)
    # add_1_slice = add(sqrt_1_slice, eps)  at examples/lamb.py:86
    add_1_slice = _add(sqrt_1_slice, eps)
    # adam_dir_slice = div(div_1_slice, add_1_slice)  at examples/lamb.py:86
    adam_dir_slice = _div(div_1_slice, add_1_slice)
    # mul_6_slice = mul(weight_decay, p_slice)  at examples/lamb.py:87
    mul_6_slice = _mul(weight_decay, p_slice)
    # direction_slice = add(adam_dir_slice, mul_6_slice)  at examples/lamb.py:87
    direction_slice = _add(adam_dir_slice, mul_6_slice)
    # dir_norm_sq = mul(direction_slice, direction_slice)  at examples/lamb.py:89
    dir_norm_sq = _mul(direction_slice, direction_slice)
    # dir_norm_partial = sum(dir_norm_sq)  at examples/lamb.py:89
    dir_norm_partial = _ops.reduction(Op.SUM, dir_norm_sq, None, False)
    return (m_new_slice, v_new_slice, direction_slice, dir_norm_partial)


def _kernel_fused_2_one_pass(trust_ratio, direction_slice, lr, p_slice, p_new_slice_slot):
    """fuse([p_norm, gt_1, dir_norm, ..., p_new (11 values)]): one pass over shared memory (torch.compile, or eager)."""
    # mul_7_slice = mul(trust_ratio, direction_slice)  at examples/lamb.py:95
    mul_7_slice = _mul(trust_ratio, direction_slice)
    # mul_8_slice = mul(lr, mul_7_slice)  at examples/lamb.py:95
    mul_8_slice = _mul(lr, mul_7_slice)
    # p_new_slice = sub(p_slice, mul_8_slice)  at examples/lamb.py:95
    p_new_slice = _sub(p_slice, mul_8_slice)
    p_new_slice_slot.copy_(p_new_slice)  # where the peers read it
    return ()


KERNELS = {"fused_1": _kernel_fused_1_one_pass, "fused_2": _kernel_fused_2_one_pass}


def step(comm, env, kernels, g, p, m, v, lr, beta1, beta2, eps, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # p_slice = scatter(p, dim=0)  at examples/lamb.py:76
    p_slice = p.narrow(0, *env.bounds['p_slice'])
    # p_norm_sq = mul(p_slice, p_slice)  at examples/lamb.py:88
    p_norm_sq = _mul(p_slice, p_slice)
    # p_norm_partial = sum(p_norm_sq)  at examples/lamb.py:88
    p_norm_partial = _ops.reduction(Op.SUM, p_norm_sq, None, False)
    # p_norm_sumsq = all_reduce(p_norm_partial, reduce_op=sum)  at examples/lamb.py:88
    p_norm_sumsq_work = comm.all_reduce_start(
        p_norm_partial, ReduceOp.SUM, axis=None, donate=True, label='p_norm_sumsq'
    )
    p_norm_sumsq = comm.wait(p_norm_sumsq_work)
    # fused_collective_1: reduce_scatter g_sum_rs, kernel fused_1 -- one fused collective; shared
    #   memory runs it as one pass: kernel fused_1 reads every peer's slice of g, reduces them in rank
    #   order, computes
    fused_collective_1_channel = comm.one_pass(None)
    # sub_1 = sub(1, beta1)  at examples/lamb.py:82
    sub_1 = _sub(_c2, beta1)
    # pow_1 = pow(beta1, step)  at examples/lamb.py:84
    pow_1 = _pow(beta1, step_)
    # sub_2 = sub(1, pow_1)  at examples/lamb.py:84
    sub_2 = _sub(_c2, pow_1)
    # sub_3 = sub(1, beta2)  at examples/lamb.py:83
    sub_3 = _sub(_c2, beta2)
    # pow_2 = pow(beta2, step)  at examples/lamb.py:85
    pow_2 = _pow(beta2, step_)
    # sub_4 = sub(1, pow_2)  at examples/lamb.py:85
    sub_4 = _sub(_c2, pow_2)
    # g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)  at examples/lamb.py:81
    g_sum_rs_parts, _ = fused_collective_1_channel.begin(g, label='g_sum_rs')
    m_new_slice, v_new_slice, direction_slice, dir_norm_partial = kernels.fused_1(
        beta1, m, sub_1, g_sum_rs_parts, sub_2, beta2, v, sub_3, sub_4, eps, weight_decay, p_slice
    )
    fused_collective_1_channel.end(label='g_sum_rs')
    # end of fused_collective_1
    # dir_norm_sumsq = all_reduce(dir_norm_partial, reduce_op=sum)  at examples/lamb.py:89
    dir_norm_sumsq_work = comm.all_reduce_start(
        dir_norm_partial, ReduceOp.SUM, axis=None, donate=True, label='dir_norm_sumsq'
    )
    dir_norm_sumsq = comm.wait(dir_norm_sumsq_work)
    # fused_collective_2: kernel fused_2, all_gather p_new -- one fused collective; shared memory runs
    #   it as one pass: kernel fused_2 computes and writes p_new_slice where the peers read it for the
    #   gather
    fused_collective_2_channel = comm.one_pass(None)
    # p_norm = sqrt(p_norm_sumsq)  at examples/lamb.py:88
    p_norm = _sqrt(p_norm_sumsq)
    # gt_1 = gt(p_norm, 0)  at examples/lamb.py:92
    gt_1 = _gt(p_norm, _c1)
    # dir_norm = sqrt(dir_norm_sumsq)  at examples/lamb.py:89
    dir_norm = _sqrt(dir_norm_sumsq)
    # gt_2 = gt(dir_norm, 0)  at examples/lamb.py:91
    gt_2 = _gt(dir_norm, _c1)
    # div_3 = div(p_norm, dir_norm)  at examples/lamb.py:91
    div_3 = _div(p_norm, dir_norm)
    # where_1 = where(gt_2, div_3, 1.0)  at examples/lamb.py:91
    where_1 = _where(gt_2, div_3, _c3)
    # trust_ratio = where(gt_1, where_1, 1.0)  at examples/lamb.py:92
    trust_ratio = _where(gt_1, where_1, _c3)
    p_new_slice_slot = fused_collective_2_channel.slot(
        shape=env.shapes['p_new'], dtype=torch.float32, parts=env.parts['p_new'], into=p,
        label='p_new'
    )
    _ = kernels.fused_2(trust_ratio, direction_slice, lr, p_slice, p_new_slice_slot)
    # p_new = all_gather(p_new_slice)  at examples/lamb.py:95  (published: the commit copies it)
    p_new = fused_collective_2_channel.finish(
        shape=env.shapes['p_new'], dtype=torch.float32, parts=env.parts['p_new'], label='p_new',
        published=True
    )
    # end of fused_collective_2
    # update(p, p_new)  at examples/lamb.py:99  (committed after the step succeeds)
    # update(m, m_new_slice)  at examples/lamb.py:99  (committed after the step succeeds)
    # update(v, v_new_slice)  at examples/lamb.py:99  (committed after the step succeeds)
    return {}, {'p': p_new, 'm': m_new_slice, 'v': v_new_slice}
