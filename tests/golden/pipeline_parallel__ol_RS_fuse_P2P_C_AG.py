"""coconet: the generated step of program pipeline_parallel."""

# program:  pipeline_parallel  (digest af31dc20a17c7c00)
# schedule: schedule ol_RS_fuse_P2P_C_AG of pipeline_parallel: split(out_sum);
#   reorder(computations(out_sum), out_sum); fuse([recv_slice, biased_slice, dropped_slice,
#   out_slice, out]); overlap([out_sum_rs, recv_slice, biased_slice, dropped_slice, out_slice,
#   out], chunks=4)
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
from coconet.ir import chunks as _chunked

# each op's local meaning, shared with the simulator (coconet.ir.semantics)
_add = _ops.POINTWISE[Op.ADD]

# the program's inputs, in the order step() takes them
INPUTS = ('x', 'w', 'b', 'r', 'seed', 'step')


def _kernel_overlap_2_fused_1(recv_slice, b, seed, step_, r_slice, dropped_slice_shape, dropped_slice_offset, dropped_slice_row):
    """fuse([recv_slice, biased_slice, dropped_slice, out_slice, out]): one kernel (torch.compile, or eager)."""
    # biased_slice = add(recv_slice, b)  at examples/pipeline_parallel.py:66
    biased_slice = _add(recv_slice, b)
    # dropped_slice = dropout(biased_slice, seed, step, p=0.1)  at examples/pipeline_parallel.py:67
    dropped_slice = _ops.apply_dropout(biased_slice, 0.1, seed, step_, dropped_slice_shape, dropped_slice_offset, dropped_slice_row)
    # out_slice = add(dropped_slice, r_slice)  at examples/pipeline_parallel.py:68
    out_slice = _add(dropped_slice, r_slice)
    return (out_slice,)


KERNELS = {"overlap_2_fused_1": _kernel_overlap_2_fused_1}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # partial = matmul(x, w)  at examples/pipeline_parallel.py:63
    partial = torch.matmul(x, w)
    # r_slice = scatter(r, axis=tp, dim=0)  at examples/pipeline_parallel.py:59
    r_slice = r.narrow(0, *env.bounds['r_slice'])
    # overlap(out_sum_rs, recv_slice, biased_slice, dropped_slice, out_slice, out, chunks=4): the
    #   chain runs in 4 chunks of rows, as a pipeline of 4 stages; each chunk's values live in
    #   overlap_2[c]
    def overlap_2_stage_0(c, v):
        """Chunk c, stage 0: start out_sum_rs."""
        v['partial'] = partial.index_select(0, env.chunk_rows['overlap_2/partial'][c])
        v['r_slice'] = r_slice.index_select(0, env.chunk_rows['overlap_2/r_slice'][c])
        # out_sum_rs = reduce_scatter(partial, axis=tp, dim=0, reduce_op=sum)  at examples/pipeline_parallel.py:64
        v['out_sum_rs_work'] = comm.reduce_scatter_start(
            v['partial'], ReduceOp.SUM, dim=0, axis='tp', donate=True, label='out_sum_rs'
        )
    def overlap_2_stage_1(c, v):
        """Chunk c, stage 1: wait out_sum_rs, start recv_slice."""
        v['out_sum_rs'] = comm.wait(v['out_sum_rs_work'])
        # recv_slice = send(out_sum_rs, axis=pp)  at examples/pipeline_parallel.py:65
        v['recv_slice_work'] = comm.send_start(v['out_sum_rs'], axis='pp', label='recv_slice')
    def overlap_2_stage_2(c, v):
        """Chunk c, stage 2: wait recv_slice, kernel overlap_2_fused_1, start out."""
        v['recv_slice'] = comm.wait(v['recv_slice_work'])
        # fuse: biased_slice, dropped_slice, out_slice  (one kernel)
        (v['out_slice'],) = kernels.overlap_2_fused_1(
            v['recv_slice'], b, seed, step_, v['r_slice'], env.shapes['dropped_slice'],
            env.offsets['dropped_slice'], env.chunk_global_rows['overlap_2/dropped_slice'][c]
        )
        # out = all_gather(out_slice, axis=tp)  at examples/pipeline_parallel.py:68
        v['out_work'] = comm.all_gather_start(
            v['out_slice'], dim=0, parts=env.chunk_parts['overlap_2/out'][c], axis='tp', label='out'
        )
    def overlap_2_stage_3(c, v):
        """Chunk c, stage 3: wait out."""
        v['out'] = comm.wait(v['out_work'])
    overlap_2 = [{} for _ in range(4)]
    for _t in range(7):  # stage s works on chunk _t - s
        for _s, _stage in enumerate((overlap_2_stage_0, overlap_2_stage_1, overlap_2_stage_2, overlap_2_stage_3,)):
            if 0 <= _t - _s < 4:
                _stage(_t - _s, overlap_2[_t - _s])
    out = _chunked.assemble_rows([v['out'] for v in overlap_2], env.chunk_order['overlap_2/out'])
    return {'out': out}, {}
