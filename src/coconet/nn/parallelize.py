"""``parallelize(model, comm, plan)``: swap a model's named ``nn.Linear``s for coconet's layers.

The plan maps module-name patterns (``fnmatch``: ``"transformer.h.*.mlp.c_fc"``) to a style,
named as torch's ``parallelize_module`` and Hugging Face ``tp_plan``s name them:

- ``"colwise"``: ``ColumnParallelLinear``, its output this rank's part of the features;
- ``"colwise_rep"``: the same, its output all_gathered (every rank the whole output);
- ``"rowwise"``: ``RowParallelLinear`` taking this rank's part of the features (what a
  ``"colwise"`` layer before it gives) and all_reducing its output;
- ``"rowwise_rep"``: the same, taking the whole input (its part is used).

Everything else in the model is kept as it is. The model must be the same on every rank (build
it after the same seed, or load the same weights). A pair ``colwise`` -> elementwise ops ->
``rowwise`` (an MLP) needs nothing else from the model; attention whose heads are split needs the
model's own head count per rank (``n_head / tp``) and a ``c_attn`` whose output features are
ordered by head — not done here (see the README's "not yet").
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from coconet.errors import ConfigError
from coconet.nn.layers import ColumnParallelLinear, RowParallelLinear
from coconet.runtime.comm import Communicator

__all__ = ["Style", "parallelize"]


class Style(enum.Enum):
    COLWISE = "colwise"
    COLWISE_REP = "colwise_rep"
    ROWWISE = "rowwise"
    ROWWISE_REP = "rowwise_rep"


def _convert(linear: nn.Linear, style: Style, comm: Communicator, axis: str | None,
             options: dict[str, Any]) -> nn.Module:  # fmt: skip
    if style in (Style.COLWISE, Style.COLWISE_REP):
        return ColumnParallelLinear.from_linear(
            linear, comm=comm, axis=axis, gather_output=style is Style.COLWISE_REP, **options
        )
    return RowParallelLinear.from_linear(
        linear, comm=comm, axis=axis, input_is_parallel=style is Style.ROWWISE, **options
    )


def parallelize(
    model: nn.Module,
    comm: Communicator,
    plan: Mapping[str, str | Style],
    *,
    axis: str | None = None,
    fused_kernels: bool = False,
) -> nn.Module:
    """Swap, in place, every ``nn.Linear`` of ``model`` whose name matches a pattern of ``plan``
    for its tensor-parallel layer over mesh ``axis`` (the whole world for None); returns the
    model. A pattern that matches no ``nn.Linear`` is an error (a typo would leave a layer
    whole), as is a name two patterns with different styles match."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"parallelize takes an nn.Module, got {type(model).__name__}",
            op="parallelize",
            hint="parallelize(model, comm, {'*.mlp.c_fc': 'colwise', '*.mlp.c_proj': 'rowwise'})",
        )
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(
            f"parallelize's plan maps module-name patterns to styles, got {plan!r}",
            op="parallelize",
            hint="{'*.mlp.c_fc': 'colwise', '*.mlp.c_proj': 'rowwise'}",
        )
    styles: dict[str, Style] = {}
    for pattern, style in plan.items():
        try:
            styles[pattern] = Style(style.value if isinstance(style, Style) else style)
        except ValueError:
            raise ConfigError(
                f"parallelize: {pattern!r} has the style {style!r}",
                op="parallelize",
                hint="a style is one of " + ", ".join(repr(s.value) for s in Style),
            ) from None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, style in styles.items():
        hits = [name for name in linears if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ConfigError(
                f"parallelize: the pattern {pattern!r} matches no nn.Linear of the model",
                op="parallelize",
                details=[f"its nn.Linears: {', '.join(sorted(linears)[:20]) or 'none'}"],
                hint="patterns are fnmatch patterns over model.named_modules() names",
            )
        for name in hits:
            if name in chosen and chosen[name][1] is not style:
                raise ConfigError(
                    f"parallelize: {name!r} is {chosen[name][1].value} by {chosen[name][0]!r} and "
                    f"{style.value} by {pattern!r}",
                    op="parallelize",
                    hint="make the patterns disjoint",
                )
            chosen[name] = (pattern, style)
    options = {"fused_kernels": fused_kernels}
    for name, (_, style) in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _convert(linears[name], style, comm, axis, options))
    return model
