"""coconet: the generated step of program sgd."""

# program:  sgd  (digest fa822ca3e89f0487)
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
_c1 = torch.tensor(1, dtype=torch.float32)  # const_1, const_2

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]
_eq = _ops.POINTWISE[Op.EQ]
_mul = _ops.POINTWISE[Op.MUL]
_sub = _ops.POINTWISE[Op.SUB]
_where = _ops.POINTWISE[Op.WHERE]

# the program's inputs, in the order step() takes them
INPUTS = ('g', 'p', 'buf', 'lr', 'momentum', 'dampening', 'weight_decay', 'step')
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'g_sum'


KERNELS = {}


def step(comm, env, kernels, g, p, buf, lr, momentum, dampening, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # g_sum = all_reduce(g, reduce_op=sum)  at examples/sgd.py:68
    g_sum_work = comm.all_reduce_start(g, ReduceOp.SUM, axis=None, donate=False, label='g_sum')
    # eq_1 = eq(step, 1)  at examples/sgd.py:71
    eq_1 = _eq(step_, _c1)
    # mul_1 = mul(weight_decay, p)  at examples/sgd.py:69
    mul_1 = _mul(weight_decay, p)
    g_sum = comm.wait(g_sum_work)
    # d_p = add(g_sum, mul_1)  at examples/sgd.py:69
    d_p = _add(g_sum, mul_1)
    # mul_2 = mul(momentum, buf)  at examples/sgd.py:72
    mul_2 = _mul(momentum, buf)
    # sub_1 = sub(1, dampening)  at examples/sgd.py:72
    sub_1 = _sub(_c1, dampening)
    # mul_3 = mul(sub_1, d_p)  at examples/sgd.py:72
    mul_3 = _mul(sub_1, d_p)
    # add_1 = add(mul_2, mul_3)  at examples/sgd.py:72
    add_1 = _add(mul_2, mul_3)
    # buf_new = where(eq_1, d_p, add_1)  at examples/sgd.py:72
    buf_new = _where(eq_1, d_p, add_1)
    # mul_4 = mul(lr, buf_new)  at examples/sgd.py:73
    mul_4 = _mul(lr, buf_new)
    # p_new = sub(p, mul_4)  at examples/sgd.py:73
    p_new = _sub(p, mul_4)
    # update(p, p_new)  at examples/sgd.py:77  (committed after the step succeeds)
    # update(buf, buf_new)  at examples/sgd.py:77  (committed after the step succeeds)
    return {}, {'p': p_new, 'buf': buf_new}
