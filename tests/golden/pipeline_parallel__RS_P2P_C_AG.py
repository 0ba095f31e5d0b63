"""coconet: the generated step of program pipeline_parallel."""

# program:  pipeline_parallel  (digest db5ad1df25435893)
# schedule: schedule RS_P2P_C_AG of pipeline_parallel: split(out_sum);
#   reorder(computations(out_sum), out_sum); fuse([biased_slice, dropped_slice, out_slice])
# mesh:     Mesh(pp=2, tp=1)    device: cpu
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


def _kernel_fused_1(recv_slice, b, seed, step_, r_slice, dropped_slice_shape, dropped_slice_offset):
    """fuse([biased_slice, dropped_slice, out_slice]): one kernel (torch.compile, or eager)."""
    # biased_slice = add(recv_slice, b)  at examples/pipeline_parallel.py:66
    biased_slice = _add(recv_slice, b)
    # dropped_slice = dropout(biased_slice, seed, step, p=0.1)  at examples/pipeline_parallel.py:67
    dropped_slice = _ops.apply_dropout(biased_slice, 0.1, seed, step_, dropped_slice_shape, dropped_slice_offset)
    # out_slice = add(dropped_slice, r_slice)  at examples/pipeline_parallel.py:68
    out_slice = _add(dropped_slice, r_slice)
    return (out_slice,)


KERNELS = {"fused_1": _kernel_fused_1}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # partial = matmul(x, w)  at examples/pipeline_parallel.py:63
    partial = torch.matmul(x, w)
    # out_sum_rs = reduce_scatter(partial, axis=tp, dim=0, reduce_op=sum)  at examples/pipeline_parallel.py:64
    out_sum_rs_work = comm.reduce_scatter_start(
        partial, ReduceOp.SUM, dim=0, axis='tp', donate=True, label='out_sum_rs'
    )
    out_sum_rs = comm.wait(out_sum_rs_work)
    # recv_slice = send(out_sum_rs, axis=pp)  at examples/pipeline_parallel.py:65
    recv_slice_work = comm.send_start(out_sum_rs, axis='pp', label='recv_slice')
    # r_slice = scatter(r, axis=tp, dim=0)  at examples/pipeline_parallel.py:59
    r_slice = r.narrow(0, *env.bounds['r_slice'])
    recv_slice = comm.wait(recv_slice_work)
    # fuse: biased_slice, dropped_slice, out_slice  (one kernel)
    (out_slice,) = kernels.fused_1(
        recv_slice, b, seed, step_, r_slice, env.shapes['dropped_slice'],
        env.offsets['dropped_slice']
    )
    # out = all_gather(out_slice, axis=tp)  at examples/pipeline_parallel.py:68
    out_work = comm.all_gather_start(
        out_slice, dim=0, parts=env.parts['out'], axis='tp', label='out'
    )
    out = comm.wait(out_work)
    return {'out': out}, {}
