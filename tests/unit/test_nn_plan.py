"""coconet.nn.parallelize refuses a plan it cannot follow before it touches the model, carries an
attention module's dropouts over (each to its place, a seed of its own per layer), and refuses a
dropout it cannot place."""

from __future__ import annotations

import pytest
import torch
from support.nanogpt import GPT, GPTConfig
from torch import nn

from coconet.errors import ConfigError
from coconet.nn import ParallelSelfAttention, parallelize
from coconet.random import derive_seed


@pytest.mark.parametrize(
    ("plan", "fragment"),
    [
        ({}, "maps module-name patterns"),
        ({"transformer.h.*.mlp.c_fc": "columnwise"}, "has the style 'columnwise'"),
        ({"transformer.h.*.mlp.fc": "colwise"}, "matches no nn.Linear"),
        ({"*.c_fc": "colwise", "transformer.h.0.*": "rowwise"}, "make the patterns disjoint"),
        ({"*.mlp": "attention"}, "matches no attention module"),
        ({"*.attn": "attention", "*.attn.c_proj": "rowwise"}, "swapped whole"),
    ],
)
def test_bad_plans_are_refused_before_anything_changes(plan, fragment):
    model = GPT(GPTConfig())
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ConfigError) as info:
        parallelize(model, comm=None, plan=plan)
    assert fragment in str(info.value)
    assert [type(m).__name__ for m in model.modules()] == before


def test_not_a_module():
    with pytest.raises(ConfigError, match="takes an nn.Module"):
        parallelize("model", comm=None, plan={"x": "colwise"})


# -- the attention's dropouts: carried over, or refused ------------------------------------------


class _HFStyleAttention(nn.Module):
    """Hugging Face GPT-2's attention as parallelize sees it: its two dropouts as modules of
    different p, no float ``dropout``."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.2)
        self.n_head = 2


@pytest.mark.parametrize("flash", [True, False])
def test_nanogpts_attention_dropouts_are_carried_over(flash):
    from support.one_rank import one_rank_comm

    torch.manual_seed(0)
    model = parallelize(GPT(GPTConfig(dropout=0.25, flash=flash)), one_rank_comm(),
                        {"transformer.h.*.attn": "attention"}, seed=5)  # fmt: skip
    layers = [block.attn for block in model.transformer.h]
    assert all(isinstance(a, ParallelSelfAttention) for a in layers)
    assert [(a.attn_p, a.proj.p) for a in layers] == [(0.25, 0.25)] * 2
    # a seed of its own per layer and per dropout, from the base seed and the module's name
    assert layers[0].seed == derive_seed(5, "transformer.h.0.attn")
    assert layers[0].attn_seed == derive_seed(layers[0].seed, "attn_dropout")
    assert layers[0].proj.seed == derive_seed(layers[0].seed, "resid_dropout")
    seeds = {s for a in layers for s in (a.attn_seed, a.proj.seed)}
    assert len(seeds) == 4


def test_hugging_face_style_dropouts_are_carried_over_each_to_its_place():
    from support.one_rank import one_rank_comm

    model = parallelize(nn.ModuleDict({"attn": _HFStyleAttention()}).eval(), one_rank_comm(),
                        {"attn": "attention"})  # fmt: skip
    assert (model["attn"].attn_p, model["attn"].proj.p) == (0.1, 0.2)
    assert not model["attn"].training  # the module's mode is kept


def _extra_dropout(attn):
    attn.extra = nn.Dropout(0.1)


def _pdrop(attn):
    attn.proj_pdrop = 0.1


def _disagreeing(attn):
    del attn.flash
    attn.dropout = 0.3


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (_extra_dropout, "has 'extra' = Dropout(p=0.1), which ParallelSelfAttention cannot carry"),
        (_pdrop, "has proj_pdrop = 0.1: a dropout that ParallelSelfAttention cannot place"),
        (_disagreeing, "has attn_dropout.p = 0.1 and dropout = 0.3: which of them it applies"),
    ],
)
def test_a_dropout_the_layer_cannot_keep_is_refused(change, fragment):
    model = GPT(GPTConfig(dropout=0.1))
    change(model.transformer.h[1].attn)
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ConfigError) as info:
        parallelize(model, comm=None, plan={"transformer.h.*.attn": "attention"})
    assert fragment in str(info.value)
    assert "'transformer.h.1.attn'" in str(info.value)
    assert [type(m).__name__ for m in model.modules()] == before
