"""coconet.nn's layers inside ``torch.compile``: a layer call as one custom op of the graph.

A layer call runs compiled coconet steps (generated code; collectives over torch.distributed or
shared memory) that dynamo cannot trace. Under ``torch.compile`` a call is recorded instead as
the custom op ``coconet::parallel_linear``: one node of the graph, whose output's shape the layer
says (the op's fake implementation), and whose gradient AOTAutograd records as the custom op
``coconet::parallel_linear_backward``. At run time both run the layer's compiled steps exactly
as an eager call does: the same programs, the same bits. So a compiled model around the layers
is one graph (``fullgraph=True`` holds), where it was a graph break at every layer.

Outside ``torch.compile`` nothing changes: an eager call does not go through the dispatcher.

A custom op takes tensors and plain values, not modules: the op names its layer by a string, as
torch's functional collectives name their process group, looked up in a registry of the live
layers (weak references: a layer that is gone is not kept alive by it). A layer is registered
when it is made, copied or unpickled (``register``), so that a traced call only reads its name.
"""

import itertools
import sys
import weakref
from typing import Any

import torch

from coconet.errors import ConfigError

__all__ = ["call", "register"]

# The live layers by name (see the module docstring). One registry per process: a second
# import of this module (a test that imports each module alone, importlib.reload) defines the
# ops again, and the ops' functions then read the registry of the module that sys.modules holds
# (``_registry``), the one every layer was registered in; a reload keeps the one it had.
_LAYERS: "weakref.WeakValueDictionary[str, Any]" = (
    globals().get("_LAYERS") or weakref.WeakValueDictionary())
_NUMBERS = globals().get("_NUMBERS") or itertools.count()


def _registry() -> "weakref.WeakValueDictionary[str, Any]":
    module = sys.modules.get(__name__)
    return getattr(module, "_LAYERS", _LAYERS)


def register(layer: Any) -> str:
    """Give ``layer`` a name of its own in the registry (a copy or an unpickled layer gets a
    new one: the name it carries is its original's)."""
    module = sys.modules.get(__name__)
    name = f"{type(layer).__name__}-{next(getattr(module, '_NUMBERS', _NUMBERS))}"
    _registry()[name] = layer
    layer.__dict__["_op_name"] = name
    return name


def _layer(name: str) -> Any:
    layer = _registry().get(name)
    if layer is None:
        raise ConfigError(
            f"the compiled graph calls layer {name!r}, which no longer exists",
            op="coconet::parallel_linear",
            hint="compile the model again (torch.compile) after replacing its layers",
        )
    return layer


def call(layer: Any, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The layer's call as the custom op (what ``_ParallelLinear._call`` traces under
    ``torch.compile``): its weights and bias passed as the op's tensors, and the names of the
    inputs that need a gradient, as the graph has them."""
    tensors = {"x": x, "w": layer.weight, "b": layer.bias, "r": residual}
    needs = ",".join(k for k, t in tensors.items() if t is not None and t.requires_grad)
    return torch.ops.coconet.parallel_linear(layer._op_name, x, layer.weight, layer.bias,
                                             residual, needs)  # fmt: skip


@torch.library.custom_op(
    "coconet::parallel_linear", mutates_args=(),
    schema="(str layer, Tensor x, Tensor w, Tensor? b, Tensor? r, str needs) -> Tensor",
)  # fmt: skip
def _forward(layer, x, w, b, r, needs):
    return _layer(layer).traced_forward(x, w, b, r, _names(needs))


@_forward.register_fake
def _forward_fake(layer, x, w, b, r, needs):
    return x.new_empty(_layer(layer).traced_shape(x))


@torch.library.custom_op(
    "coconet::parallel_linear_backward", mutates_args=(),
    schema="(str layer, Tensor d_y, Tensor x, Tensor w, Tensor? b, Tensor? r, str needs) "
           "-> Tensor[]",
)  # fmt: skip
def _backward(layer, d_y, x, w, b, r, needs):
    names = _names(needs)
    grads = _layer(layer).traced_backward(d_y, x, w, b, r, names)
    return [grads[f"d_{n}"] for n in names]


@_backward.register_fake
def _backward_fake(layer, d_y, x, w, b, r, needs):
    tensors = {"x": x, "w": w, "b": b, "r": r}
    return [torch.empty_like(tensors[n]) for n in _names(needs)]


def _setup(ctx, inputs, output) -> None:
    layer, x, w, b, r, needs = inputs
    ctx.save_for_backward(x, w, b, r)
    ctx.layer, ctx.needs = layer, needs


def _gradients(ctx, d_y):
    x, w, b, r = ctx.saved_tensors
    names = _names(ctx.needs)
    got = dict(zip(names, torch.ops.coconet.parallel_linear_backward(
        ctx.layer, d_y.contiguous(), x, w, b, r, ctx.needs), strict=True))  # fmt: skip
    return None, got.get("x"), got.get("w"), got.get("b"), got.get("r"), None


_forward.register_autograd(_gradients, setup_context=_setup)


def _names(needs: str) -> tuple[str, ...]:
    return tuple(n for n in needs.split(",") if n)
