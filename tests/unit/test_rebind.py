"""A compiled step called like its last good call skips its local checks (``CompiledStep._rebind``:
the same tensors by everything the checks read, the same numbers): proven against a twin step that
always checks, over random call sequences on a world of one. Each call's outputs, error and update
must be the same; the calls mix the same tensor, a new one at another address, another shape, a
length that does not fit the other input's, dtype or stride, a tensor that needs grad, a number
that changes (0.0 and -0.0, NaN, an int for a float), a bad input, and inference mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet import runtime
from coconet.options import CommOptions

N = cc.Dim("N")


def _program(updates: bool = True) -> cc.Program:
    """``y = x * s``, and with ``updates`` ``p -= x`` (a step that writes an input: the checks
    read the tensors' addresses; without, a new tensor of the same shape is the same call)."""
    x = cc.Tensor("x", cc.float32, [N], cc.Replicated)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    s = cc.Scalar("s", cc.float32)
    y = (x * s).named("y")
    if not updates:
        return cc.Program("rebind_read", [x, p, s], [y, (p + x).named("z")])
    return cc.Program("rebind", [x, p, s], [y, cc.update(p, (p - x).named("p_new"))])


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


_X = st.sampled_from(["same", "new", "longer", "float64", "strided", "grad", "missing",
                      "mismatched"])
_S = st.sampled_from([0.5, 0.5, 2.0, 0.0, -0.0, float("nan"), 3, "bad"])


def _x(kind: str, last: torch.Tensor, gen: torch.Generator):
    if kind == "same":
        return last
    if kind == "missing":
        return None
    n = 6 if kind == "longer" else 5 if kind == "mismatched" else 4
    t = torch.randn(2 * n if kind == "strided" else n, generator=gen)
    if kind == "strided":
        return t[::2]
    if kind == "float64":
        return t.double()
    return t.requires_grad_() if kind == "grad" else t


def _call(step, inputs):
    try:
        out = step(**inputs)
    except cc.CoconetError as exc:
        return None, (type(exc).__name__, exc.message)
    return out["y"], None


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(_X, _S, st.booleans()), min_size=2, max_size=12),
       updates=st.booleans())
def test_a_call_like_the_last_good_one_matches_a_step_that_always_checks(comm, calls, updates):
    fast = cc.compile(_program(updates), comm=comm)
    slow = cc.compile(_program(updates), comm=comm)
    slow._rebind = lambda given: None  # the full checks at every call
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, generator=gen)
    ps = {"fast": torch.zeros(4), "slow": torch.zeros(4)}
    replayed = 0
    for kind, s, inference in calls:
        x_now = _x(kind, x, gen)
        if x_now is not None and kind not in ("float64", "mismatched"):
            x = x_now  # (a mismatched x: another length than p's, refused)
        if ps["fast"].shape != x.shape and x_now is not None:
            ps = {k: torch.zeros(x.shape) for k in ps}  # (a longer x: a p of its length)
        seen = {}
        for name, step in (("fast", fast), ("slow", slow)):
            inputs = {"p": ps[name], "s": s}
            if x_now is not None:
                inputs["x"] = x_now
            before = step._bound
            with torch.inference_mode(inference):
                seen[name] = _call(step, inputs)
            if name == "fast" and before is not None and step._bound is before and \
                    seen[name][1] is None:  # fmt: skip
                replayed += 1
        (y_fast, err_fast), (y_slow, err_slow) = seen["fast"], seen["slow"]
        assert err_fast == err_slow
        if err_fast is None:
            assert torch.equal(y_fast.isnan(), y_slow.isnan())
            assert torch.equal(torch.nan_to_num(y_fast), torch.nan_to_num(y_slow))
            assert str(y_fast.sum().item()) == str(y_slow.sum().item())  # (the sign of a zero)
        assert torch.equal(ps["fast"], ps["slow"])
    event(f"calls replayed: {min(replayed, 3)}{'+' if replayed >= 3 else ''}")


def test_a_repeated_call_is_replayed_and_a_changed_number_is_not(comm):
    step = cc.compile(_program(), comm=comm)
    x, p = torch.ones(3), torch.zeros(3)
    step(x=x, p=p, s=2.0)
    bound = step._bound
    assert bound is not None
    assert step._rebind({"x": x, "p": p, "s": 2.0}) is not None
    assert step._rebind({"x": x, "p": p, "s": 3.0}) is None
    assert step._rebind({"x": x, "p": p, "s": 2}) is None  # an int is another input
    assert step._rebind({"x": x.clone(), "p": p, "s": 2.0}) is None  # another address
    assert step._rebind({"x": x, "p": p, "s": 2.0, "z": 1}) is None
    with torch.inference_mode():
        assert step._rebind({"x": x, "p": p, "s": 2.0}) is None
    zero = step(x=x, p=p, s=0.0)["y"]
    negative = step(x=x, p=p, s=-0.0)["y"]
    assert str(zero[0].item()) == "0.0" and str(negative[0].item()) == "-0.0"


def test_a_step_that_writes_nothing_replays_a_new_tensor_of_any_length(comm):
    """Locally, a read-only step at a new length is the same call (its own shapes reported);
    whether the lengths fit the program is the agreement's to say, and it says so."""
    step = cc.compile(_program(updates=False), comm=comm)
    x, p = torch.ones(3), torch.zeros(3)
    step(x=x, p=p, s=2.0)
    assert step._rebind({"x": torch.full((3,), 5.0), "p": p, "s": 2.0}) is not None
    longer = step._rebind({"x": torch.ones(4), "p": p, "s": 2.0})
    assert longer is not None and longer[1] == {"x": (4,), "p": (3,), "s": ()}
    assert step._rebind({"x": torch.ones(2, 2), "p": p, "s": 2.0}) is None  # another rank
    assert step._rebind({"x": x.double(), "p": p, "s": 2.0}) is None
    assert step._rebind({"x": x.requires_grad_(), "p": p, "s": 2.0}) is None
    with pytest.raises(cc.CoconetError, match="size N is"):
        step(x=torch.ones(4), p=p, s=2.0)  # replayed locally, refused by the sizes' check
    out = step(x=torch.full((4,), 5.0), p=torch.zeros(4), s=2.0)
    assert torch.equal(out["y"], torch.full((4,), 10.0)) and torch.equal(out["z"], out["y"] / 2)
