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


def _kernel_overlap_2_fused_1_one_pass(out_sum_rs_parts, b, seed, step_, r_slice, dropped_slice_shape, dropped_slice_offset, dropped_slice_row, out_slice_slot):
    """fuse([out_sum_rs, biased_slice, dropped_slice, out_slice, out]): one pass over shared memory (torch.compile, or eager)."""
    # out_sum_rs: this rank's slice, reduced from every peer's in rank order
    out_sum_rs = _ops.reduce_values(ReduceOp.SUM, out_sum_rs_parts)
    # biased_slice = add(out_sum_rs, b)  at examples/tensor_parallel.py:71
    biased_slice = _add(out_sum_rs, b)
    # dropped_slice = dropout(biased_slice, seed, step, p=0.1)  at examples/tensor_parallel.py:72
    dropped_slice = _ops.apply_dropout(biased_slice, 0.1, seed, step_, dropped_slice_shape, dropped_slice_offset, dropped_slice_row)
    # out_slice = add(dropped_slice, r_slice)  at examples/tensor_parallel.py:73
    out_slice = _add(dropped_slice, r_slice)
    out_slice_slot.copy_(out_slice)  # where the peers read it
    return ()


KERNELS = {"overlap_2_fused_1": _kernel_overlap_2_fused_1_one_pass}


def step(comm, env, kernels, x, w, b, r, seed, step_):
    """One step on this rank: (outputs, updates); the caller commits."""
    # r_slice = scatter(r, dim=0)  at examples/tensor_parallel.py:65
    r_slice = r.narrow(0, *env.bounds['r_slice'])
    # overlap(partial, out_sum_rs, biased_slice, dropped_slice, out_slice, out, chunks=4): the chain
    #   runs in 4 chunks of rows, one after the other, each as one pass over shared memory; each
    #   chunk's values live in overlap_2[c]
    overlap_2_channel = comm.one_pass(None)
    def overlap_2_stage_0(c, v):
        """Chunk c, stage 0: partial, start out_sum_rs."""
        v['x'] = x.index_select(0, env.chunk_rows['overlap_2/x'][c])
        v['r_slice'] = r_slice.index_select(0, env.chunk_rows['overlap_2/r_slice'][c])
        # partial = matmul(x, w)  at examples/tensor_parallel.py:69
        v['partial'] = torch.matmul(v['x'], w)
        # out_sum_rs = reduce_scatter(partial, dim=0, reduce_op=sum)  at examples/tensor_parallel.py:70
        v['out_sum_rs_parts'], v['out_slice_slot'] = overlap_2_channel.begin(
            v['partial'], gather_shape=(sum(env.chunk_parts['overlap_2/out'][c]),
            *env.shapes['out'][1:]), gather_dtype=torch.float32,
            gather_parts=env.chunk_parts['overlap_2/out'][c], label='out_sum_rs'
        )
    def overlap_2_stage_1(c, v):
        """Chunk c, stage 1: wait out_sum_rs, kernel overlap_2_fused_1, start out."""
        # fuse: biased_slice, dropped_slice, out_slice  (one kernel: reads every peer's rows of partial,
        #   reduces them, writes out_slice into its slot)
        _ = kernels.overlap_2_fused_1(
            v['out_sum_rs_parts'], b, seed, step_, v['r_slice'], env.shapes['dropped_slice'],
            env.offsets['dropped_slice'], env.chunk_global_rows['overlap_2/dropped_slice'][c],
            v['out_slice_slot']
        )
        # out = all_gather(out_slice)  at examples/tensor_parallel.py:73
        #   (its input is in its slot: the kernel wrote it there)
    def overlap_2_stage_2(c, v):
        """Chunk c, stage 2: wait out."""
        v['out'] = overlap_2_channel.finish(
            shape=(sum(env.chunk_parts['overlap_2/out'][c]), *env.shapes['out'][1:]),
            dtype=torch.float32, parts=env.chunk_parts['overlap_2/out'][c], label='out'
        )
    # over shared memory each chunk runs as one pass (kernel overlap_2_fused_1 reads the peers' rows
    #   of partial and writes out_slice into its slot), the chunks one after the other
    overlap_2 = [{} for _ in range(4)]
    for _c in range(4):
        for _stage in (overlap_2_stage_0, overlap_2_stage_1, overlap_2_stage_2,):
            _stage(_c, overlap_2[_c])
    out = _chunked.assemble_rows([v['out'] for v in overlap_2], env.chunk_order['overlap_2/out'])
    return {'out': out}, {}
