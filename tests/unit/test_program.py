"""Program construction edge cases: output naming and inputs listed twice."""

import pytest
import torch

import coconet as cc


def test_an_input_returned_under_another_name_is_refused_not_renamed():
    n = cc.Dim("N")
    w = cc.Tensor("w", cc.float32, [n], cc.Replicated)
    with pytest.raises(cc.DSLError, match="output 'old_w' is the input 'w'") as info:
        cc.Program("p", [w], {"old_w": w, "wu": cc.update(w, w + 1.0)})
    assert info.value.hint == "use the key 'w', or return a computed copy"
    prog = cc.Program("p", [w], {"w": w, "wu": cc.update(w, w + 1.0)})
    assert [i.name for i in prog.inputs] == ["w"]
    result = cc.simulate(prog, {"w": torch.zeros(3)}, 2)
    assert torch.equal(result.output("w"), torch.zeros(3))
    assert torch.equal(result.updated("w"), torch.ones(3))


def test_one_value_under_two_output_names_is_refused_not_dropped():
    """One value has one name: the first key used to vanish from the outputs, silently."""
    n = cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [n], cc.Replicated)
    y = x * 2.0
    with pytest.raises(cc.DSLError, match="outputs 'a' and 'b' are the same value") as info:
        cc.Program("p", [x], {"a": y, "b": y})
    assert "a computed copy under 'b'" in info.value.hint


def test_an_input_listed_twice_says_so():
    n = cc.Dim("N")
    p = cc.Tensor("p", cc.float32, [n], cc.Replicated)
    with pytest.raises(cc.DSLError, match="'p' is listed twice among the inputs"):
        cc.Program("a", [p, p], [p + 1])
    other = cc.Tensor("p", cc.float32, [n], cc.Replicated)
    with pytest.raises(cc.DSLError, match="two different values are named 'p'"):
        cc.Program("a", [p, other], [p + other])


def test_a_sliced_update_value_must_not_broadcast():
    k, n = cc.Dim("K"), cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [k, n], cc.Sliced(0))
    v = cc.Tensor("v", cc.float32, [n], cc.Sliced(0))
    with pytest.raises(cc.ShapeError, match="the new value of x has shape") as info:
        cc.update(x, v)
    assert (
        info.value.hint
        == "a Sliced new value must have the tensor's shape: slices do not broadcast"
    )
