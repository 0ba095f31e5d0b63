"""Errors of coconet.nn layers point at the user's line (not at torch's module call machinery or
torch.compiler.disable's wrapper around a layer's call) and say their op once; a layer
unpickled without its group says to attach one. Layers built over a one-rank communicator,
whose steps never run here."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
from support.one_rank import one_rank_comm
from torch import nn

from coconet.errors import ConfigError, SourceLoc
from coconet.nn import ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def test_a_bad_input_to_a_layer_points_at_the_call():
    layer = RowParallelLinear(4, 3, comm=one_rank_comm())
    with pytest.raises(ConfigError) as info:
        line = _next_line()
        layer(torch.randn(2, 5))
    e = info.value
    assert e.loc == SourceLoc(__file__, line), e.loc
    assert str(e).startswith("RowParallelLinear: the input's last dim must be 4, got (2, 5)\n")


def test_a_bad_input_inside_a_users_model_points_at_the_users_line():
    # the user's forward, called by nn.Module's machinery and by a Sequential's loop
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = ColumnParallelLinear(4, 6, comm=one_rank_comm())

        def forward(self, x):
            return self.fc(x[..., :3])  # the user's own bug

    line = Model.forward.__code__.co_firstlineno + 1
    model = nn.Sequential(Model())
    with pytest.raises(ConfigError) as info:
        model(torch.randn(2, 4))
    assert info.value.loc == SourceLoc(__file__, line), info.value.loc


def test_attention_errors_name_their_op_once_and_the_users_line():
    comm = one_rank_comm()
    with pytest.raises(ConfigError) as info:
        line = _next_line()
        ParallelSelfAttention(8, 3, comm=comm)
    assert str(info.value).startswith("ParallelSelfAttention: 3 heads of a 8-wide model")
    assert info.value.loc == SourceLoc(__file__, line)
    attn = ParallelSelfAttention(8, 2, comm=comm)
    with pytest.raises(ConfigError) as info:
        line = _next_line()
        attn(torch.randn(2, 3, 5))
    assert str(info.value).startswith("ParallelSelfAttention: the input must be [batch, tokens, "
                                      "8], got (2, 3, 5)\n")  # fmt: skip
    assert info.value.loc == SourceLoc(__file__, line)
    for bad in ({"attn_dropout": 1.0}, {"resid_dropout": -0.1}):
        with pytest.raises(ConfigError) as info:
            ParallelSelfAttention(8, 2, comm=comm, **bad)
        name = next(iter(bad))
        assert str(info.value).startswith(f"ParallelSelfAttention: {name} must be a probability")


def test_an_unpickled_layer_says_to_attach_a_group():
    attn = ParallelSelfAttention(8, 2, comm=one_rank_comm(), attn_dropout=0.1, resid_dropout=0.2,
                                 seed=4, schedule="MM_AR_C")  # fmt: skip
    loaded = pickle.loads(pickle.dumps(attn))
    assert loaded.qkv.comm is None and loaded.proj.schedule is attn.proj.schedule
    assert (loaded.attn_p, loaded.proj.p, loaded.attn_seed, loaded.proj.seed) == (
        0.1, 0.2, attn.attn_seed, attn.proj.seed)  # fmt: skip
    assert torch.equal(loaded.qkv.weight, attn.qkv.weight)
    with pytest.raises(ConfigError) as info:
        line = _next_line()
        loaded(torch.randn(2, 3, 8))
    assert "coconet.nn.attach(model, comm)" in str(info.value)
    assert info.value.loc == SourceLoc(__file__, line)


def test_a_deepcopy_shares_the_group_and_copies_the_values():
    comm = one_rank_comm()
    attn = ParallelSelfAttention(8, 2, comm=comm)
    twin = copy.deepcopy(attn)
    assert twin.qkv.comm is comm and twin.proj.comm is comm
    assert twin.qkv.weight is not attn.qkv.weight
    assert torch.equal(twin.qkv.weight, attn.qkv.weight)
    with torch.no_grad():
        twin.qkv.weight.add_(1.0)
    assert not torch.equal(twin.qkv.weight, attn.qkv.weight)
