"""coconet.nn layers inside torch.compile (``coconet.nn.traceable``): a layer call is one custom
op of the graph, so a model holding the layers compiles as one graph (``fullgraph=True``),
forward and backward bitwise the eager model's (``aot_eager``: nothing around the layers is
rewritten); the output shape each rank names alone, including a sequence-parallel row layer's
uneven part; a copied or unpickled layer is named apart from its original; what one rank cannot
shape alone stays a graph break.

Run in this process on a communicator of one rank (``runtime.init``), as the tracing tests'
world of one: the ops' two sides run the layers' compiled steps as an eager call does."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from support.one_rank import one_rank_comm
from torch import nn

from coconet import Mesh, runtime
from coconet.ir.types import slice_bounds
from coconet.nn import ColumnParallelLinear, RowParallelLinear, traceable
from coconet.runtime import CommOptions
from coconet.runtime.comm import Communicator


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


class _Block(nn.Module):
    def __init__(self, comm, gather: bool, residual: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = ColumnParallelLinear(8, 16, comm=comm, gather_output=gather)
        self.proj = RowParallelLinear(16, 8, comm=comm)
        self.residual = residual

    def forward(self, x):
        h = torch.relu(self.fc(self.ln(x)))
        return self.proj(h, residual=x) if self.residual else self.proj(h)


@pytest.mark.parametrize(("gather", "residual"), [(False, False), (False, True), (True, True)])
def test_a_compiled_model_is_one_graph_and_the_eager_models_bits(comm, gather, residual):
    torch.manual_seed(0)
    model = _Block(comm, gather, residual)
    if gather:  # a gathered output feeds the row layer whole
        model.proj = RowParallelLinear(16, 8, comm=comm, input_is_parallel=False)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for length in (3, 5):
        x = torch.randn(2, length, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = model(xa)
        ya.square().sum().backward()
        eager = (ya.detach(), xa.grad, model.fc.weight.grad.clone(),
                 model.proj.weight.grad.clone(), model.proj.bias.grad.clone())  # fmt: skip
        model.zero_grad()
        yb = compiled(xb)
        yb.square().sum().backward()
        traced = (yb.detach(), xb.grad, model.fc.weight.grad, model.proj.weight.grad,
                  model.proj.bias.grad)  # fmt: skip
        for a, b in zip(eager, traced, strict=True):
            assert torch.equal(a, b)
        model.zero_grad()
    with torch.no_grad():  # inference: the op without its gradient
        x = torch.randn(4, 8)
        assert torch.equal(compiled(x), model(x))


def _two_rank_comm(rank: int) -> Communicator:
    comm = one_rank_comm()
    comm.mesh, comm.rank, comm.world, comm.members = Mesh.world(2), rank, 2, (0, 1)
    return comm


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("length", [6, 7])
def test_each_rank_names_its_output_shape_alone(rank, length):
    comm = _two_rank_comm(rank)
    lo, hi = slice_bounds(10, 2, rank)
    col = ColumnParallelLinear(4, 10, comm=comm)
    assert col.traced_shape(torch.empty(length, 2, 4)) == [length, 2, hi - lo]
    gathered = ColumnParallelLinear(4, 10, comm=comm, gather_output=True)
    assert gathered.traced_shape(torch.empty(length, 4)) == [length, 10]
    row = RowParallelLinear(10, 4, comm=comm)
    assert row.traced_shape(torch.empty(length, hi - lo)) == [length, 4]
    sp = RowParallelLinear(10, 4, comm=comm, sequence_parallel=True)
    s_lo, s_hi = slice_bounds(length, 2, rank)  # the sequence's uneven parts
    assert sp.traced_shape(torch.empty(length, 3, hi - lo)) == [s_hi - s_lo, 3, 4]
    # a column layer's gathered sequence is every rank's parts: not one rank's to say
    assert not ColumnParallelLinear(4, 10, comm=comm, sequence_parallel=True)._traceable()
    assert col._traceable() and sp._traceable()


def test_a_copied_or_unpickled_layer_is_named_apart_from_its_original():
    layer = RowParallelLinear(4, 4, comm=one_rank_comm())
    twin = copy.deepcopy(layer)
    names = {layer._op_name, twin._op_name}
    assert len(names) == 2
    assert traceable._LAYERS[layer._op_name] is layer and traceable._LAYERS[twin._op_name] is twin
    back = pickle.loads(pickle.dumps(layer))
    assert back._op_name not in names and traceable._LAYERS[back._op_name] is back
    gone = back._op_name
    del back
    import gc

    gc.collect()
    assert gone not in traceable._LAYERS  # the registry keeps no layer alive
