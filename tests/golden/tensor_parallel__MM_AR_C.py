"""coconet: the generated step of program tensor_parallel."""

# program:  tensor_parallel  (digest e43813d3c53c8d47)
# schedule: schedule MM_AR_C of tensor_parallel: fuse([biased, dropped, out])
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
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'out_sum'


def _kernel_fused_1(out_sum, b, seed, step_, r, dropped_shape, dropped_offset):
    """fuse([biased, dropped, out]): one kernel (torch.compile, or eager)."""
    # biased = add(out_sum, b)  at examples/tensor_parallel.py:71
    biased = _add(out_sum, b)
    # dropped = dropout(biased, seed, step, p=0.1)  at examples/tensor_parallel.py:72
    dropped = _ops.apply_dropout(biased, 0.1, seed, step_, dropped_shape, dropped_offset)
    # out = add(dropped, r)  at examples/tensor_parallel.py:73
    out = _add(dropped, r)
    return (out,)


KERNELS = {"fused_1": _kernel_fused_1}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # partial = matmul(x, w)  at examples/tensor_parallel.py:69
    partial = torch.matmul(x, w)
    # out_sum = all_reduce(partial, reduce_op=sum)  at examples/tensor_parallel.py:70
    out_sum_work = comm.all_reduce_start(
        partial, ReduceOp.SUM, axis=None, donate=True, label='out_sum'
    )
    out_sum = comm.wait(out_sum_work)
    # fuse: biased, dropped, out  (one kernel)
    (out,) = kernels.fused_1(
        out_sum, b, seed, step_, r, env.shapes['dropped'], env.offsets['dropped']
    )
    return {'out': out}, {}
