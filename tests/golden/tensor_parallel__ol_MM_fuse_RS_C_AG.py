"""coconet: the generated step of program tensor_parallel."""

# program:  tensor_parallel  (digest ced98f7edb99c016)
# schedule: schedule ol_MM_fuse_RS_C_AG of tensor_parallel: split(out_sum);
#   reorder(computations(out_sum), out_sum); fuse([out_sum_rs, biased_slice, dropped_slice,
#   out_slice, out]); overlap([partial, out_sum_rs, biased_slice, dropped_slice, out_slice, out],
#   chunks=4)
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
from coconet.ir import chunks as _chunked

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]

# the program's inputs, in the order step() takes them
INPUTS = ('x', 'w', 'b', 'r', 'seed', 'step')


def _kernel_overlap_2_fused_1(out_sum_rs, b, seed, step_, r_slice, dropped_slice_shape, dropped_slice_offset, dropped_slice_row):
    """fuse([out_sum_rs, biased_slice, dropped_slice, out_slice, out]): one kernel (torch.compile, or eager)."""
    # biased_slice = add(out_sum_rs, b)  at examples/tensor_parallel.py:71
    biased_slice = _add(out_sum_rs, b)
    # dropped_slice = dropout(biased_slice, seed, step, p=0.1)  at examples/tensor_parallel.py:72
    dropped_slice = _ops.apply_dropout(biased_slice, 0.1, seed, step_, dropped_slice_shape, dropped_slice_offset, dropped_slice_row)
    # out_slice = add(dropped_slice, r_slice)  at examples/tensor_parallel.py:73
    out_slice = _add(dropped_slice, r_slice)
    return (out_slice,)


KERNELS = {"overlap_2_fused_1": _kernel_overlap_2_fused_1}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # r_slice = scatter(r, dim=0)  at examples/tensor_parallel.py:65
    r_slice = r.narrow(0, *env.bounds['r_slice'])
    # overlap(partial, out_sum_rs, biased_slice, dropped_slice, out_slice, out, chunks=4): the chain
    #   runs in 4 chunks of rows, as a pipeline of 3 stages; each chunk's values live in overlap_2[c]
    def overlap_2_stage_0(c, v):
        """Chunk c, stage 0: partial, start out_sum_rs."""
        v['x'] = x.index_select(0, env.chunk_rows['overlap_2/x'][c])
        v['r_slice'] = r_slice.index_select(0, env.chunk_rows['overlap_2/r_slice'][c])
        # partial = matmul(x, w)  at examples/tensor_parallel.py:69
        v['partial'] = torch.matmul(v['x'], w)
        # out_sum_rs = reduce_scatter(partial, dim=0, reduce_op=sum)  at examples/tensor_parallel.py:70
        v['out_sum_rs_work'] = comm.reduce_scatter_start(
            v['partial'], ReduceOp.SUM, dim=0, axis=None, donate=True, label='out_sum_rs'
        )
    def overlap_2_stage_1(c, v):
        """Chunk c, stage 1: wait out_sum_rs, kernel overlap_2_fused_1, start out."""
        v['out_sum_rs'] = comm.wait(v['out_sum_rs_work'])
        # fuse: biased_slice, dropped_slice, out_slice  (one kernel)
        (v['out_slice'],) = kernels.overlap_2_fused_1(
            v['out_sum_rs'], b, seed, step_, v['r_slice'], env.shapes['dropped_slice'],
            env.offsets['dropped_slice'], env.chunk_global_rows['overlap_2/dropped_slice'][c]
        )
        # out = all_gather(out_slice)  at examples/tensor_parallel.py:73
        v['out_work'] = comm.all_gather_start(
            v['out_slice'], dim=0, parts=env.chunk_parts['overlap_2/out'][c], axis=None, label='out'
        )
    def overlap_2_stage_2(c, v):
        """Chunk c, stage 2: wait out."""
        v['out'] = comm.wait(v['out_work'])
    overlap_2 = [{} for _ in range(4)]
    for _t in range(6):  # stage s works on chunk _t - s
        for _s, _stage in enumerate((overlap_2_stage_0, overlap_2_stage_1, overlap_2_stage_2,)):
            if 0 <= _t - _s < 4:
                _stage(_t - _s, overlap_2[_t - _s])
    out = _chunked.assemble_rows([v['out'] for v in overlap_2], env.chunk_order['overlap_2/out'])
    return {'out': out}, {}
