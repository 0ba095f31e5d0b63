"""coconet: the generated step of program pipeline_parallel."""

# program:  pipeline_parallel  (digest 5ae293486ce56bc2)
# schedule: (none)
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
# the step's first communication is this all_reduce: the step's agreement may
# ride with it, one round for both (coconet.runtime.handshake)
AGREEMENT = 'out_sum'


KERNELS = {}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # partial = matmul(x, w)  at examples/pipeline_parallel.py:63
    partial = torch.matmul(x, w)
    # out_sum = all_reduce(partial, axis=tp, reduce_op=sum)  at examples/pipeline_parallel.py:64
    out_sum_work = comm.all_reduce_start(
        partial, ReduceOp.SUM, axis='tp', donate=True, label='out_sum'
    )
    out_sum = comm.wait(out_sum_work)
    # recv = send(out_sum, axis=pp)  at examples/pipeline_parallel.py:65
    recv_work = comm.send_start(out_sum, axis='pp', label='recv')
    recv = comm.wait(recv_work)
    # biased = add(recv, b)  at examples/pipeline_parallel.py:66
    biased = _add(recv, b)
    # dropped = dropout(biased, seed, step, p=0.1)  at examples/pipeline_parallel.py:67
    dropped = _ops.apply_dropout(biased, 0.1, seed, step_, env.shapes['dropped'], env.offsets['dropped'])
    # out = add(dropped, r)  at examples/pipeline_parallel.py:68
    out = _add(dropped, r)
    return {'out': out}, {}
