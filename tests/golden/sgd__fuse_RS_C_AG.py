"""coconet: the generated step of program sgd."""

# program:  sgd  (digest 100a0ed92ebda304)
# schedule: schedule fuse_RS_C_AG of sgd: split(g_sum); reorder(computations(g_sum), g_sum);
#   as_slice([buf]); fuse([g_sum_rs, eq_1, mul_1_slice, d_p_slice, ..., p_new_slice, p_new (12
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
_c1 = torch.tensor(1, dtype=torch.float32)  # const_1, const_2

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]
_eq = _ops.POINTWISE[Op.EQ]
_mul = _ops.POINTWISE[Op.MUL]
_sub = _ops.POINTWISE[Op.SUB]
_where = _ops.POINTWISE[Op.WHERE]

# the program's inputs, in the order step() takes them
INPUTS = ('g', 'p', 'buf', 'lr', 'momentum', 'dampening', 'weight_decay', 'step')


def _kernel_fused_1(weight_decay, p_slice, g_sum_rs, momentum, buf, sub_1, eq_1, lr):
    """fuse([eq_1, g_sum_rs, mul_1_slice, ..., p_new (12 values)]): one kernel (torch.compile, or eager)."""
    # mul_1_slice = mul(weight_decay, p_slice)  at examples/sgd.py:69
    mul_1_slice = _mul(weight_decay, p_slice)
    # d_p_slice = add(g_sum_rs, mul_1_slice)  at examples/sgd.py:69
    d_p_slice = _add(g_sum_rs, mul_1_slice)
    # mul_2_slice = mul(momentum, buf)  at examples/sgd.py:72
    mul_2_slice = _mul(momentum, buf)
    # mul_3_slice = mul(sub_1, d_p_slice)  at examples/sgd.py:72
    mul_3_slice = _mul(sub_1, d_p_slice)
    # add_1_slice = add(mul_2_slice, mul_3_slice)  at examples/sgd.py:72
    add_1_slice = _add(mul_2_slice, mul_3_slice)
    # buf_new_slice = where(eq_1, d_p_slice, add_1_slice)  at examples/sgd.py:72
    buf_new_slice = _where(eq_1, d_p_slice, add_1_slice)
    # mul_4_slice = mul(lr, buf_new_slice)  at examples/sgd.py:73
    mul_4_slice = _mul(lr, buf_new_slice)
    # p_new_slice = sub(p_slice, mul_4_slice)  at examples/sgd.py:73
    p_new_slice = _sub(p_slice, mul_4_slice)
    return (buf_new_slice, p_new_slice)


KERNELS = {"fused_1": _kernel_fused_1}


def step(comm, env, kernels, g, p, buf, lr, momentum, dampening, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # p_slice = scatter(p, dim=0)  at examples/sgd.py:62
    p_slice = p.narrow(0, *env.bounds['p_slice'])
    # fused_collective_1: reduce_scatter g_sum_rs, kernel fused_1, all_gather p_new -- one fused
    #   collective; torch.distributed runs its collectives and kernels one after the other
    # g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)  at examples/sgd.py:68
    g_sum_rs_work = comm.reduce_scatter_start(
        g, ReduceOp.SUM, dim=0, axis=None, donate=False, label='g_sum_rs'
    )
    # eq_1 = eq(step, 1)  at examples/sgd.py:71
    eq_1 = _eq(step_, _c1)
    # sub_1 = sub(1, dampening)  at examples/sgd.py:72
    sub_1 = _sub(_c1, dampening)
    g_sum_rs = comm.wait(g_sum_rs_work)
    # fuse: mul_1_slice, d_p_slice, mul_2_slice, mul_3_slice, add_1_slice, buf_new_slice, mul_4_slice,
    #   p_new_slice  (one kernel)
    buf_new_slice, p_new_slice = kernels.fused_1(
        weight_decay, p_slice, g_sum_rs, momentum, buf, sub_1, eq_1, lr
    )
    # p_new = all_gather(p_new_slice)  at examples/sgd.py:73
    p_new_work = comm.all_gather_start(
        p_new_slice, dim=0, parts=env.parts['p_new'], axis=None, label='p_new'
    )
    p_new = comm.wait(p_new_work)
    # end of fused_collective_1
    # update(p, p_new)  at examples/sgd.py:77  (committed after the step succeeds)
    # update(buf, buf_new_slice)  at examples/sgd.py:77  (committed after the step succeeds)
    return {}, {'p': p_new, 'buf': buf_new_slice}
