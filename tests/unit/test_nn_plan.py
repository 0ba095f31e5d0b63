"""coconet.nn.parallelize refuses a plan it cannot follow before it touches the model."""

from __future__ import annotations

import pytest
from support.nanogpt import GPT, GPTConfig

from coconet.errors import ConfigError
from coconet.nn import parallelize


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
