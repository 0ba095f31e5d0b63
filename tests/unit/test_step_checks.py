"""The local checks a compiled step makes before any communication (runtime/step.py; its checks
of single values in runtime/step_inputs.py), without processes: overlap of two tensors and of a
tensor with itself (exact, also for strided views, proven against the sets of byte addresses they
cover), scalars that do not fit their dtype, and the checksum ``check_replicated`` compares.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.runtime import step_inputs


def _bytes_of(t: torch.Tensor) -> list[int]:
    """Every byte address (relative to the storage) that ``t``'s elements occupy, with repeats."""
    e = t.element_size()
    index = torch.arange(t.untyped_storage().nbytes() // e, dtype=torch.int64)
    elements = index.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1).tolist()
    return [i * e + b for i in elements for b in range(e)]


@st.composite
def _views(draw, storage: torch.Tensor):
    """A strided view of ``storage`` (positive strides, possibly zero, within bounds)."""
    n = storage.numel()
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    stride = [draw(st.integers(0, 5)) for _ in range(rank)]
    span = sum((s - 1) * d for s, d in zip(shape, stride, strict=True))
    offset = draw(st.integers(0, max(0, n - 1 - span))) if span < n else None
    if offset is None:
        return storage[:1]
    return storage.as_strided(shape, stride, offset)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_overlap_is_exact(data):
    storage = torch.zeros(64, dtype=torch.float32)
    a = data.draw(_views(storage))
    if data.draw(st.booleans()):
        b = data.draw(_views(storage))
    else:  # another dtype over the same memory
        b = data.draw(_views(storage.view(torch.int16)))
    want = bool(set(_bytes_of(a)) & set(_bytes_of(b)))
    assert step_inputs.overlap(a, b) is want
    assert step_inputs.overlap(b, a) is want


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_self_overlap_is_exact(data):
    t = data.draw(_views(torch.zeros(64)))
    addresses = _bytes_of(t)
    assert step_inputs._self_overlapping(t) is (len(addresses) != len(set(addresses)))


def test_tensors_of_different_storages_never_overlap():
    assert not step_inputs.overlap(torch.zeros(4), torch.zeros(4))
    base = torch.zeros(10)
    assert step_inputs.overlap(base[:6], base[5:])
    assert not step_inputs.overlap(base[:5], base[5:])
    assert not step_inputs.overlap(base[0::2], base[1::2])  # interleaved, disjoint


def _node(dtype):
    x = cc.Scalar("s", dtype)
    return cc.Program("p", [x], {"y": x * 2}).inputs[0]


@pytest.mark.parametrize(
    ("dtype", "value", "problem"),
    [
        (cc.int64, float("nan"), "nan is not an integer"),
        (cc.int64, 1.5, "1.5 is not an integer"),
        (cc.int64, 2**63, "is outside [-9223372036854775808, 9223372036854775807]"),
        (cc.int64, -(2**63) - 1, "is outside"),
        (cc.int32, 2**31, "is outside [-2147483648, 2147483647]"),
        (cc.float32, 10**400, "does not fit a float"),
        (cc.float32, 1e39, "1e+39 overflows float32"),
        (cc.float16, 70000.0, "overflows float16"),
        (cc.bfloat16, 10**39, "overflows bfloat16"),
    ],
)
def test_scalars_that_do_not_fit_are_reported(dtype, value, problem):
    t, why = step_inputs.scalar(_node(dtype), value, torch.device("cpu"))
    assert t is None and problem in why, why


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (cc.int64, 2**63 - 1),
        (cc.int64, 3.0),  # an integral float is that integer
        (cc.int32, -(2**31)),
        (cc.float32, float("nan")),  # NaN and inf pass through, as in torch.optim
        (cc.float32, float("-inf")),
        (cc.float32, 10**30),
        (cc.float16, 65504.0),
    ],
)
def test_scalars_that_fit_pass(dtype, value):
    t, why = step_inputs.scalar(_node(dtype), value, torch.device("cpu"))
    assert why is None and t.dtype == dtype.torch
    if not dtype.torch.is_floating_point:
        assert t.item() == int(value)


@settings(max_examples=400, deadline=None)
@given(
    dtype=st.sampled_from([cc.float32, cc.float16, cc.bfloat16, cc.int64]),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=-4e38, max_value=4e38),  # around float32's largest
        st.floats(min_value=-1e-44, max_value=1e-44),  # float32's subnormals
        st.integers(-(2**70), 2**70),
    ),
)
def test_the_float_scalar_fast_path_is_the_slow_path(dtype, value):
    """A step binds a new float scalar (an optimizer's step size) without reading the tensor
    back: where the fast path answers, its tensor and the text the ranks compare are exactly
    what ``_scalar`` and ``_scalar_text`` give (a rank on either path agrees with the other);
    where it declines (another dtype, not finite, does not fit), the slow path words why."""
    node = _node(dtype)
    fast = step_inputs.float_scalar(node, value, torch.device("cpu"))
    slow, why = step_inputs.scalar(node, value, torch.device("cpu"))
    if fast is None:
        declined = dtype is not cc.float32 or why is not None or not (
            math.isfinite(slow.item()))
        assert declined, (dtype, value)
        return
    t, text = fast
    assert why is None
    assert t.dtype == slow.dtype and t.shape == ()
    assert t.reshape(1).view(torch.uint8).tolist() == (
        slow.reshape(1).view(torch.uint8).tolist())
    assert text == step_inputs.scalar_text(slow)


def test_the_checksum_sees_one_changed_element_and_swapped_elements():
    x = torch.randn(1000)
    base = step_inputs.checksum(x)
    assert step_inputs.checksum(x.clone()) == base
    y = x.clone()
    y[500] = torch.nextafter(y[500], torch.tensor(math.inf))  # one ulp
    assert step_inputs.checksum(y) != base
    z = x.clone()
    z[[1, 2]] = z[[2, 1]]  # same elements, other places
    assert step_inputs.checksum(z) != base
    assert step_inputs.checksum(x.to(torch.bfloat16)) != step_inputs.checksum(x.to(torch.float16))


def test_unwritable_state_is_named():
    with torch.inference_mode():
        frozen = torch.zeros(3)
    assert "inference tensor" in step_inputs.unwritable("m", frozen)
    assert "an expand()" in step_inputs.unwritable("m", torch.zeros(1).expand(3))
    assert step_inputs.unwritable("m", torch.zeros(3, requires_grad=True)) is None  # no_grad commit
