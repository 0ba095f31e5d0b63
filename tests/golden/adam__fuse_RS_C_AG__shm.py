"""coconet: the generated step of program adam."""

# program:  adam  (digest ad6c61a4b69da121)
# schedule: schedule fuse_RS_C_AG of adam: split(g_sum); reorder(computations(g_sum), g_sum);
#   as_slice([m, v]); fuse([g_sum_rs, pow_1, sub_1, div_1, ..., p_new_slice, p_new (25 values)])
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
REPLICA_INPUTS = ('p',)


def _kernel_fused_1_one_pass(beta1, m, weight_decay, p_slice, g_sum_rs_parts, sub_2, beta2, v, sub_3, sqrt_2, eps, div_1, p_new_slice_slot):
    """fuse([pow_1, sub_1, div_1, ..., p_new (25 values)]): one pass over shared memory (torch.compile, or eager)."""
    # g_sum_rs: this rank's slice, reduced from every peer's in rank order
    g_sum_rs = _ops.reduce_values(ReduceOp.SUM, g_sum_rs_parts)
    # mul_1_slice = mul(beta1, m)  at examples/adam.py:75
    mul_1_slice = _mul(beta1, m)
    # mul_2_slice = mul(weight_decay, p_slice)  at examples/adam.py:74
    mul_2_slice = _mul(weight_decay, p_slice)
    # d_p_slice = add(g_sum_rs, mul_2_slice)  at examples/adam.py:74
    d_p_slice = _add(g_sum_rs, mul_2_slice)
    # mul_3_slice = mul(sub_2, d_p_slice)  at examples/adam.py:75
    mul_3_slice = _mul(sub_2, d_p_slice)
    # m_new_slice = add(mul_1_slice, mul_3_slice)  at examples/adam.py:75
    m_new_slice = _add(mul_1_slice, mul_3_slice)
    # mul_4_slice = mul(beta2, v)  at examples/adam.py:76
    mul_4_slice = _mul(beta2, v)
    # mul_5_slice = mul(sub_3, d_p_slice)  at examples/adam.py:76
    mul_5_slice = _mul(sub_3, d_p_slice)
    # mul_6_slice = mul(mul_5_slice, d_p_slice)  at examples/adam.py:76
    mul_6_slice = _mul(mul_5_slice, d_p_slice)
    # v_new_slice = add(mul_4_slice, mul_6_slice)  at examples/adam.py:76
    v_new_slice = _add(mul_4_slice, mul_6_slice)
    # sqrt_1_slice = sqrt(v_new_slice)  at examples/adam.py:79
    sqrt_1_slice = _sqrt(v_new_slice)
    # div_2_slice = div(sqrt_1_slice, sqrt_2)  at examples/adam.py:79
    div_2_slice = _div(sqrt_1_slice, sqrt_2)
    # denom_slice = add(div_2_slice, eps)  at examples/adam.py:79
    denom_slice = _add(div_2_slice, eps)
    # div_3_slice = div(m_new_slice, denom_slice)  at examples/adam.py:80
    div_3_slice = _div(m_new_slice, denom_slice)
    # mul_7_slice = mul(div_1, div_3_slice)  at examples/adam.py:80
    mul_7_slice = _mul(div_1, div_3_slice)
    # p_new_slice = sub(p_slice, mul_7_slice)  at examples/adam.py:80
    p_new_slice = _sub(p_slice, mul_7_slice)
    p_new_slice_slot.copy_(p_new_slice)  # where the peers read it
    return (m_new_slice, v_new_slice)


KERNELS = {"fused_1": _kernel_fused_1_one_pass}


def step(comm, env, kernels, g, p, m, v, lr, beta1, beta2, eps, weight_decay, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # p_slice = scatter(p, dim=0)  at examples/adam.py:68
    p_slice = p.narrow(0, *env.bounds['p_slice'])
    # fused_collective_1: reduce_scatter g_sum_rs, kernel fused_1, all_gather p_new -- one fused
    #   collective; shared memory runs it as one pass: kernel fused_1 reads every peer's slice of g,
    #   reduces them in rank order, computes and writes p_new_slice where the peers read it for the
    #   gather
    fused_collective_1_channel = comm.one_pass(None)
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
    # g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)  at examples/adam.py:73
    g_sum_rs_parts, p_new_slice_slot = fused_collective_1_channel.begin(
        g, gather_shape=env.shapes['p_new'], gather_dtype=torch.float32,
        gather_parts=env.parts['p_new'], gather_into=p, label='g_sum_rs'
    )
    m_new_slice, v_new_slice = kernels.fused_1(
        beta1, m, weight_decay, p_slice, g_sum_rs_parts, sub_2, beta2, v, sub_3, sqrt_2, eps, div_1,
        p_new_slice_slot
    )
    # p_new = all_gather(p_new_slice)  at examples/adam.py:80  (published: the commit copies it)
    p_new = fused_collective_1_channel.finish(
        shape=env.shapes['p_new'], dtype=torch.float32, parts=env.parts['p_new'], label='p_new',
        published=True
    )
    # end of fused_collective_1
    # update(p, p_new)  at examples/adam.py:84  (committed after the step succeeds)
    # update(m, m_new_slice)  at examples/adam.py:84  (committed after the step succeeds)
    # update(v, v_new_slice)  at examples/adam.py:84  (committed after the step succeeds)
    return {}, {'p': p_new, 'm': m_new_slice, 'v': v_new_slice}
