"""coconet: the generated step of program lamb."""

# program:  lamb  (digest 7d0164275e969cee)
# schedule: schedule AR_C of lamb: fuse([p_norm, gt_1, mul_1, sub_1, ..., mul_8, p_new (30
#   values)])
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
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'g_sum'


def _kernel_fused_1(p, beta1, m, sub_1, g_sum, sub_2, beta2, v, sub_3, sub_4, eps, weight_decay):
    """fuse([p_norm, gt_1, mul_1, ..., p_new (30 values)]): one kernel (torch.compile, or eager)."""
    # mul_1 = mul(beta1, m)  at examples/lamb.py:82
    mul_1 = _mul(beta1, m)
    # mul_2 = mul(sub_1, g_sum)  at examples/lamb.py:82
    mul_2 = _mul(sub_1, g_sum)
    # m_new = add(mul_1, mul_2)  at examples/lamb.py:82
    m_new = _add(mul_1, mul_2)
    # div_1 = div(m_new, sub_2)  at examples/lamb.py:84
    div_1 = _div(m_new, sub_2)
    # mul_3 = mul(beta2, v)  at examples/lamb.py:83
    mul_3 = _mul(beta2, v)
    # mul_4 = mul(sub_3, g_sum)  at examples/lamb.py:83
    mul_4 = _mul(sub_3, g_sum)
    # mul_5 = mul(mul_4, g_sum)  at examples/lamb.py:83
    mul_5 = _mul(mul_4, g_sum)
    # v_new = add(mul_3, mul_5)  at examples/lamb.py:83
    v_new = _add(mul_3, mul_5)
    # div_2 = div(v_new, sub_4)  at examples/lamb.py:85
    div_2 = _div(v_new, sub_4)
    # sqrt_1 = sqrt(div_2)  at examples/lamb.py:86
    sqrt_1 = _sqrt(div_2)
    # add_1 = add(sqrt_1, eps)  at examples/lamb.py:86
    add_1 = _add(sqrt_1, eps)
    # adam_dir = div(div_1, add_1)  at examples/lamb.py:86
    adam_dir = _div(div_1, add_1)
    # mul_6 = mul(weight_decay, p)  at examples/lamb.py:87
    mul_6 = _mul(weight_decay, p)
    # direction = add(adam_dir, mul_6)  at examples/lamb.py:87
    direction = _add(adam_dir, mul_6)
    # p_norm = norm(p)  at examples/lamb.py:88
    p_norm = _ops.reduction(Op.NORM, p, None, False)
    # dir_norm = norm(direction)  at examples/lamb.py:89
    dir_norm = _ops.reduction(Op.NORM, direction, None, False)
    return (p_norm, m_new, v_new, direction, dir_norm)


def _kernel_fused_2(trust_ratio, direction, lr, p):
    """fuse([p_norm, gt_1, mul_1, ..., p_new (30 values)]): one kernel (torch.compile, or eager)."""
    # mul_7 = mul(trust_ratio, direction)  at examples/lamb.py:95
    mul_7 = _mul(trust_ratio, direction)
    # mul_8 = mul(lr, mul_7)  at examples/lamb.py:95
    mul_8 = _mul(lr, mul_7)
    # p_new = sub(p, mul_8)  at examples/lamb.py:95
    p_new = _sub(p, mul_8)
    return (p_new,)


KERNELS = {"fused_1": _kernel_fused_1, "fused_2": _kernel_fused_2}


def step(comm, env, kernels, g, p, m, v, lr, beta1, beta2, eps, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # g_sum = all_reduce(g, reduce_op=sum)  at examples/lamb.py:81
    g_sum_work = comm.all_reduce_start(g, ReduceOp.SUM, axis=None, donate=False, label='g_sum')
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
    g_sum = comm.wait(g_sum_work)
    # fuse: mul_1, mul_2, m_new, div_1, mul_3, mul_4, mul_5, v_new, div_2, sqrt_1, add_1, adam_dir,
    #   mul_6, direction, p_norm, dir_norm  (one kernel)
    p_norm, m_new, v_new, direction, dir_norm = kernels.fused_1(
        p, beta1, m, sub_1, g_sum, sub_2, beta2, v, sub_3, sub_4, eps, weight_decay
    )
    # gt_1 = gt(p_norm, 0)  at examples/lamb.py:92
    gt_1 = _gt(p_norm, _c1)
    # gt_2 = gt(dir_norm, 0)  at examples/lamb.py:91
    gt_2 = _gt(dir_norm, _c1)
    # div_3 = div(p_norm, dir_norm)  at examples/lamb.py:91
    div_3 = _div(p_norm, dir_norm)
    # where_1 = where(gt_2, div_3, 1.0)  at examples/lamb.py:91
    where_1 = _where(gt_2, div_3, _c3)
    # trust_ratio = where(gt_1, where_1, 1.0)  at examples/lamb.py:92
    trust_ratio = _where(gt_1, where_1, _c3)
    # fuse: mul_7, mul_8, p_new  (one kernel)
    (p_new,) = kernels.fused_2(trust_ratio, direction, lr, p)
    # update(p, p_new)  at examples/lamb.py:99  (committed after the step succeeds)
    # update(m, m_new)  at examples/lamb.py:99  (committed after the step succeeds)
    # update(v, v_new)  at examples/lamb.py:99  (committed after the step succeeds)
    return {}, {'p': p_new, 'm': m_new, 'v': v_new}
