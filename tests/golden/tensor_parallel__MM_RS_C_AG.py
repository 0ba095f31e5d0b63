"""coconet: the generated step of program tensor_parallel."""

# program:  tensor_parallel  (digest 88a4aa03cb1fb923)
# schedule: schedule MM_RS_C_AG of tensor_parallel: split(out_sum); reorder(computations(out_sum),
#   out_sum); fuse([biased_slice, dropped_slice, out_slice])
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

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]

# the program's inputs, in the order step() takes them
INPUTS = ('x', 'w', 'b', 'r', 'seed', 'step')


def _kernel_fused_1(out_sum_rs, b, seed, step_, r_slice, dropped_slice_shape, dropped_slice_offset):
    """fuse([biased_slice, dropped_slice, out_slice]): one kernel (torch.compile, or eager)."""
    # biased_slice = add(out_sum_rs, b)  at examples/tensor_parallel.py:71
    biased_slice = _add(out_sum_rs, b)
    # dropped_slice = dropout(biased_slice, seed, step, p=0.1)  at examples/tensor_parallel.py:72
    dropped_slice = _ops.apply_dropout(biased_slice, 0.1, seed, step_, dropped_slice_shape, dropped_slice_offset)
    # out_slice = add(dropped_slice, r_slice)  at examples/tensor_parallel.py:73
    out_slice = _add(dropped_slice, r_slice)
    return (out_slice,)


KERNELS = {"fused_1": _kernel_fused_1}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # partial = matmul(x, w)  at examples/tensor_parallel.py:69
    partial = torch.matmul(x, w)
    # out_sum_rs = reduce_scatter(partial, dim=0, reduce_op=sum)  at examples/tensor_parallel.py:70
    out_sum_rs_work = comm.reduce_scatter_start(
        partial, ReduceOp.SUM, dim=0, axis=None, donate=True, label='out_sum_rs'
    )
    # r_slice = scatter(r, dim=0)  at examples/tensor_parallel.py:65
    r_slice = r.narrow(0, *env.bounds['r_slice'])
    out_sum_rs = comm.wait(out_sum_rs_work)
    # fuse: biased_slice, dropped_slice, out_slice  (one kernel)
    (out_slice,) = kernels.fused_1(
        out_sum_rs, b, seed, step_, r_slice, env.shapes['dropped_slice'],
        env.offsets['dropped_slice']
    )
    # out = all_gather(out_slice)  at examples/tensor_parallel.py:73
    out_work = comm.all_gather_start(
        out_slice, dim=0, parts=env.parts['out'], axis=None, label='out'
    )
    out = comm.wait(out_work)
    return {'out': out}, {}
