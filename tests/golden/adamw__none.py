"""coconet: the generated step of program adamw."""

# program:  adamw  (digest 2bca9cba290dbdd1)
# schedule: (none)
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
_c1 = torch.tensor(1, dtype=torch.float32)  # const_1, const_2, const_3, const_4, const_5

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


KERNELS = {}


def step(comm, env, kernels, g, p, m, v, lr, beta1, beta2, eps, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # g_sum = all_reduce(g, reduce_op=sum)  at examples/adamw.py:75
    g_sum_work = comm.all_reduce_start(g, ReduceOp.SUM, axis=None, donate=False, label='g_sum')
    # mul_1 = mul(lr, weight_decay)  at examples/adamw.py:76
    mul_1 = _mul(lr, weight_decay)
    # sub_1 = sub(1, mul_1)  at examples/adamw.py:76
    sub_1 = _sub(_c1, mul_1)
    # p_decayed = mul(p, sub_1)  at examples/adamw.py:76
    p_decayed = _mul(p, sub_1)
    # pow_1 = pow(beta1, step)  at examples/adamw.py:79
    pow_1 = _pow(beta1, step_)
    # sub_2 = sub(1, pow_1)  at examples/adamw.py:79
    sub_2 = _sub(_c1, pow_1)
    # div_1 = div(lr, sub_2)  at examples/adamw.py:82
    div_1 = _div(lr, sub_2)
    # mul_2 = mul(beta1, m)  at examples/adamw.py:77
    mul_2 = _mul(beta1, m)
    # sub_3 = sub(1, beta1)  at examples/adamw.py:77
    sub_3 = _sub(_c1, beta1)
    g_sum = comm.wait(g_sum_work)
    # mul_3 = mul(sub_3, g_sum)  at examples/adamw.py:77
    mul_3 = _mul(sub_3, g_sum)
    # m_new = add(mul_2, mul_3)  at examples/adamw.py:77
    m_new = _add(mul_2, mul_3)
    # mul_4 = mul(beta2, v)  at examples/adamw.py:78
    mul_4 = _mul(beta2, v)
    # sub_4 = sub(1, beta2)  at examples/adamw.py:78
    sub_4 = _sub(_c1, beta2)
    # mul_5 = mul(sub_4, g_sum)  at examples/adamw.py:78
    mul_5 = _mul(sub_4, g_sum)
    # mul_6 = mul(mul_5, g_sum)  at examples/adamw.py:78
    mul_6 = _mul(mul_5, g_sum)
    # v_new = add(mul_4, mul_6)  at examples/adamw.py:78
    v_new = _add(mul_4, mul_6)
    # sqrt_1 = sqrt(v_new)  at examples/adamw.py:81
    sqrt_1 = _sqrt(v_new)
    # pow_2 = pow(beta2, step)  at examples/adamw.py:80
    pow_2 = _pow(beta2, step_)
    # sub_5 = sub(1, pow_2)  at examples/adamw.py:80
    sub_5 = _sub(_c1, pow_2)
    # sqrt_2 = sqrt(sub_5)  at examples/adamw.py:81
    sqrt_2 = _sqrt(sub_5)
    # div_2 = div(sqrt_1, sqrt_2)  at examples/adamw.py:81
    div_2 = _div(sqrt_1, sqrt_2)
    # denom = add(div_2, eps)  at examples/adamw.py:81
    denom = _add(div_2, eps)
    # div_3 = div(m_new, denom)  at examples/adamw.py:82
    div_3 = _div(m_new, denom)
    # mul_7 = mul(div_1, div_3)  at examples/adamw.py:82
    mul_7 = _mul(div_1, div_3)
    # p_new = sub(p_decayed, mul_7)  at examples/adamw.py:82
    p_new = _sub(p_decayed, mul_7)
    # update(p, p_new)  at examples/adamw.py:86  (committed after the step succeeds)
    # update(m, m_new)  at examples/adamw.py:86  (committed after the step succeeds)
    # update(v, v_new)  at examples/adamw.py:86  (committed after the step succeeds)
    return {}, {'p': p_new, 'm': m_new, 'v': v_new}
