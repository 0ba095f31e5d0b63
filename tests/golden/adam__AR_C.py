"""coconet: the generated step of program adam."""

# program:  adam  (digest 71b1cc4f76f57e13)
# schedule: schedule AR_C of adam: fuse([pow_1, sub_1, div_1, mul_1, ..., mul_7, p_new (23
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
_c1 = torch.tensor(1, dtype=torch.float32)  # const_1, const_2, const_3, const_4

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]
_div = _ops.POINTWISE[Op.DIV]
_mul = _ops.POINTWISE[Op.MUL]
_pow = _ops.POINTWISE[Op.POW]
_sqrt = _ops.POINTWISE[Op.SQRT]
_sub = _ops.POINTWISE[Op.SUB]

# the program's inputs, in the order step() takes them
INPUTS = ('g', 'p', 'm', 'v', 'lr', 'beta1', 'beta2', 'eps', 'weight_decay', 'step')
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'g_sum'


def _kernel_fused_1(beta1, m, weight_decay, p, g_sum, sub_2, beta2, v, sub_3, sqrt_2, eps, div_1):
    """fuse([pow_1, sub_1, div_1, ..., p_new (23 values)]): one kernel (torch.compile, or eager)."""
    # mul_1 = mul(beta1, m)  at examples/adam.py:75
    mul_1 = _mul(beta1, m)
    # mul_2 = mul(weight_decay, p)  at examples/adam.py:74
    mul_2 = _mul(weight_decay, p)
    # d_p = add(g_sum, mul_2)  at examples/adam.py:74
    d_p = _add(g_sum, mul_2)
    # mul_3 = mul(sub_2, d_p)  at examples/adam.py:75
    mul_3 = _mul(sub_2, d_p)
    # m_new = add(mul_1, mul_3)  at examples/adam.py:75
    m_new = _add(mul_1, mul_3)
    # mul_4 = mul(beta2, v)  at examples/adam.py:76
    mul_4 = _mul(beta2, v)
    # mul_5 = mul(sub_3, d_p)  at examples/adam.py:76
    mul_5 = _mul(sub_3, d_p)
    # mul_6 = mul(mul_5, d_p)  at examples/adam.py:76
    mul_6 = _mul(mul_5, d_p)
    # v_new = add(mul_4, mul_6)  at examples/adam.py:76
    v_new = _add(mul_4, mul_6)
    # sqrt_1 = sqrt(v_new)  at examples/adam.py:79
    sqrt_1 = _sqrt(v_new)
    # div_2 = div(sqrt_1, sqrt_2)  at examples/adam.py:79
    div_2 = _div(sqrt_1, sqrt_2)
    # denom = add(div_2, eps)  at examples/adam.py:79
    denom = _add(div_2, eps)
    # div_3 = div(m_new, denom)  at examples/adam.py:80
    div_3 = _div(m_new, denom)
    # mul_7 = mul(div_1, div_3)  at examples/adam.py:80
    mul_7 = _mul(div_1, div_3)
    # p_new = sub(p, mul_7)  at examples/adam.py:80
    p_new = _sub(p, mul_7)
    return (m_new, v_new, p_new)


KERNELS = {"fused_1": _kernel_fused_1}


def step(comm, env, kernels, g, p, m, v, lr, beta1, beta2, eps, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # g_sum = all_reduce(g, reduce_op=sum)  at examples/adam.py:73
    g_sum_work = comm.all_reduce_start(g, ReduceOp.SUM, axis=None, donate=False, label='g_sum')
    # pow_1 = pow(beta1, step)  at examples/adam.py:77
    pow_1 = _pow(beta1, step_)
    # sub_1 = sub(1, pow_1)  at examples/adam.py:77
    sub_1 = _sub(_c1, pow_1)
    # div_1 = div(lr, sub_1)  at examples/adam.py:80
    div_1 = _div(lr, sub_1)
    # sub_2 = sub(1, beta1)  at examples/adam.py:75
    sub_2 = _sub(_c1, beta1)
    # sub_3 = sub(1, beta2)  at examples/adam.py:76
    sub_3 = _sub(_c1, beta2)
    # pow_2 = pow(beta2, step)  at examples/adam.py:78
    pow_2 = _pow(beta2, step_)
    # sub_4 = sub(1, pow_2)  at examples/adam.py:78
    sub_4 = _sub(_c1, pow_2)
    # sqrt_2 = sqrt(sub_4)  at examples/adam.py:79
    sqrt_2 = _sqrt(sub_4)
    g_sum = comm.wait(g_sum_work)
    # fuse: mul_1, mul_2, d_p, mul_3, m_new, mul_4, mul_5, mul_6, v_new, sqrt_1, div_2, denom, div_3,
    #   mul_7, p_new  (one kernel)
    m_new, v_new, p_new = kernels.fused_1(
        beta1, m, weight_decay, p, g_sum, sub_2, beta2, v, sub_3, sqrt_2, eps, div_1
    )
    # update(p, p_new)  at examples/adam.py:84  (committed after the step succeeds)
    # update(m, m_new)  at examples/adam.py:84  (committed after the step succeeds)
    # update(v, v_new)  at examples/adam.py:84  (committed after the step succeeds)
    return {}, {'p': p_new, 'm': m_new, 'v': v_new}
