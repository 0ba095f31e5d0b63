"""``parallelize(model, comm, plan)``: swap a model's named ``nn.Linear``s for coconet's layers.

The plan maps module-name patterns (``fnmatch``: ``"transformer.h.*.mlp.c_fc"``) to a style,
named as torch's ``parallelize_module`` and Hugging Face ``tp_plan``s name them:

- ``"colwise"``: ``ColumnParallelLinear``, its output this rank's part of the features;
- ``"colwise_rep"``: the same, its output all_gathered (every rank the whole output);
- ``"rowwise"``: ``RowParallelLinear`` taking this rank's part of the features (what a
  ``"colwise"`` layer before it gives) and all_reducing its output;
- ``"rowwise_rep"``: the same, taking the whole input (its part is used);
- ``"attention"`` (coconet's own, for a whole module): a GPT-2/nanoGPT attention module (one
  with ``c_attn``, ``c_proj`` and ``n_head``) becomes a ``ParallelSelfAttention`` with
  ``n_head / tp`` heads per rank — torch's styles swap linears only, which leaves such a
  module's own head arithmetic wrong.

Everything else in the model is kept as it is. The model must be the same on every rank (build
it after the same seed, or load the same weights). A pair ``colwise`` -> elementwise ops ->
``rowwise`` (an MLP) needs nothing else from the model.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from coconet.errors import ConfigError
from coconet.nn.attention import ParallelSelfAttention
from coconet.nn.layers import ColumnParallelLinear, RowParallelLinear
from coconet.runtime.comm import Communicator

__all__ = ["Style", "parallelize"]


class Style(enum.Enum):
    COLWISE = "colwise"
    COLWISE_REP = "colwise_rep"
    ROWWISE = "rowwise"
    ROWWISE_REP = "rowwise_rep"
    ATTENTION = "attention"


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
    attentions = {name: m for name, m in model.named_modules() if _is_attention(m)}
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, style in styles.items():
        pool = attentions if style is Style.ATTENTION else linears
        hits = [name for name in pool if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            what = "attention module (c_attn, c_proj, n_head)" if style is Style.ATTENTION \
                else "nn.Linear"  # fmt: skip
            raise ConfigError(
                f"parallelize: the pattern {pattern!r} matches no {what} of the model",
                op="parallelize",
                details=[f"its candidates: {', '.join(sorted(pool)[:20]) or 'none'}"],
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
    inside = [(a, n) for a in chosen if chosen[a][1] is Style.ATTENTION for n in chosen
              if n.startswith(a + ".")]  # fmt: skip
    if inside:
        raise ConfigError(
            f"parallelize: {inside[0][1]!r} is inside the attention module {inside[0][0]!r}, "
            "which is swapped whole",
            op="parallelize",
            hint="leave the attention's own linears out of the plan",
        )
    options = {"fused_kernels": fused_kernels}
    for name, (_, style) in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if style is Style.ATTENTION:
            m = attentions[name]
            new = ParallelSelfAttention.from_modules(m.c_attn, m.c_proj, m.n_head, comm=comm,
                                                     axis=axis, **options)  # fmt: skip
        else:
            new = _convert(linears[name], style, comm, axis, options)
        setattr(parent, child, new)
    return model


def _is_attention(m: nn.Module) -> bool:
    return (
        isinstance(getattr(m, "c_attn", None), nn.Linear)
        and isinstance(getattr(m, "c_proj", None), nn.Linear)
        and isinstance(getattr(m, "n_head", None), int)
    )
