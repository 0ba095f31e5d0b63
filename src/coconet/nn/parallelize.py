"""``parallelize(model, comm, plan)``: swap a model's named ``nn.Linear``s for coconet's layers.

The plan maps module-name patterns (``fnmatch``: ``"transformer.h.*.mlp.c_fc"``) to a style,
named as torch's ``parallelize_module`` and Hugging Face ``tp_plan``s name them:

- ``"colwise"``: ``ColumnParallelLinear``, its output this rank's part of the features;
- ``"colwise_rep"``: the same, its output all_gathered (every rank the whole output);
- ``"rowwise"``: ``RowParallelLinear`` taking this rank's part of the features (what a
  ``"colwise"`` layer before it gives) and all_reducing its output;
- ``"rowwise_rep"``: the same, taking the whole input (its part is used);
- ``"colwise_gather_output"`` and ``"rowwise_split_input"``: Hugging Face's names of
  ``"colwise_rep"`` and ``"rowwise_rep"``;
- ``"attention"`` (coconet's own, for a whole module): a GPT-2/nanoGPT attention module (one
  with ``c_attn``, ``c_proj`` and ``n_head``) becomes a ``ParallelSelfAttention`` with
  ``n_head / tp`` heads per rank — torch's styles swap linears only, which leaves such a
  module's own head arithmetic wrong.

Everything else in the model is kept as it is. The model must be the same on every rank (build
it after the same seed, or load the same weights).

Hugging Face models. Without a plan, a ``transformers`` model's own plan is taken
(``model.tp_plan``: its config's ``base_model_tp_plan`` under the base model's prefix, with the
head's, e.g. Llama's ``lm_head: colwise_gather_output``): its linears are swapped as it says, and
the model's attention, which computes its heads from its projections' widths, runs with this
rank's heads. Entries that shard something other than a linear are left whole and said so in
``model.coconet_plan_left_whole`` (``embedding_rowwise``: a vocabulary-parallel embedding; the
embedding stays whole on every rank: the same values, more memory); a style that changes what a
module computes (packed, expert, sequence-parallel ones) is refused. The attention heads and the
key/value heads must divide over the group. A pair ``colwise`` -> elementwise ops ->
``rowwise`` (an MLP) needs nothing else from the model.

Dropout. An attention module's own dropouts are carried over, never dropped: nanoGPT's and
GPT-2's ``attn_dropout`` / ``resid_dropout`` (``nn.Dropout``s) and nanoGPT's float ``dropout``
(the probability its ``scaled_dot_product_attention`` path uses) become the layer's
``attn_dropout`` / ``resid_dropout``, drawn with coconet's counter-based masks (the same on
every rank). A dropout in it that this cannot place (another ``nn.Dropout`` with p > 0, a
``*drop*`` probability of another name, a submodule it does not know) is refused. Each
converted layer draws from a seed of its own, derived from ``seed`` and its module name.

The model's other dropouts (nanoGPT's ``mlp.dropout`` after ``c_proj``, ``transformer.drop``)
stay the model's ``nn.Dropout``s, drawing from torch's generator on each rank. They act on
values that are the same on every rank of the group, so every rank must draw the same masks,
or the ranks train different replicas of the weights they should share: seed torch alike on
every rank of the group (``torch.manual_seed(seed)``, not ``seed + rank``) and keep its
generator in step (draw per-rank randomness, such as data sampling, from a ``torch.Generator``
of its own). ``parallelize`` checks that the generators are the same when it converts a model
that has such dropouts, and refuses otherwise; it cannot see them drift apart later.

Saving: ``copy.deepcopy(model)`` shares the group and copies the values; ``torch.save(model)``
saves each rank's parts without the group, and ``attach(torch.load(...), comm)`` gives a loaded
model its group back.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from coconet.errors import ConfigError
from coconet.nn.attention import ParallelSelfAttention
from coconet.nn.layers import ColumnParallelLinear, RowParallelLinear, _ParallelLinear, layer_group
from coconet.nn.replicas import ReplicaCheck
from coconet.random import derive_seed
from coconet.runtime.comm import Communicator
from coconet.runtime.shards import placement_of

__all__ = ["Style", "attach", "parallelize"]


class Style(enum.Enum):
    COLWISE = "colwise"
    COLWISE_REP = "colwise_rep"
    ROWWISE = "rowwise"
    ROWWISE_REP = "rowwise_rep"
    ATTENTION = "attention"
    # Hugging Face's names of the two above (transformers' ALL_PARALLEL_STYLES)
    COLWISE_GATHER_OUTPUT = "colwise_gather_output"
    ROWWISE_SPLIT_INPUT = "rowwise_split_input"


# the same layer by another name
_SAME = {Style.COLWISE_GATHER_OUTPUT: Style.COLWISE_REP,
         Style.ROWWISE_SPLIT_INPUT: Style.ROWWISE_REP}  # fmt: skip
# Hugging Face styles whose module keeps its values whole here (nothing else changes)
_WHOLE = {"embedding_rowwise", "embedding_colwise", "replicate", "replicated_with_grad_allreduce"}


def _convert(linear: nn.Linear, style: Style, comm: Communicator, axis: str | None,
             options: dict[str, Any], seed: int) -> nn.Module:  # fmt: skip
    if style in (Style.COLWISE, Style.COLWISE_REP):
        return ColumnParallelLinear.from_linear(
            linear, comm=comm, axis=axis, gather_output=style is Style.COLWISE_REP, **options
        )
    return RowParallelLinear.from_linear(
        linear, comm=comm, axis=axis, input_is_parallel=style is Style.ROWWISE, seed=seed,
        **options,
    )  # fmt: skip


def parallelize(
    model: nn.Module,
    comm: Communicator,
    plan: Mapping[str, str | Style] | None = None,
    *,
    axis: str | None = None,
    fused_kernels: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Swap, in place, every ``nn.Linear`` of ``model`` whose name matches a pattern of ``plan``
    for its tensor-parallel layer over mesh ``axis`` (the whole world for None); returns the
    model. A pattern that matches no ``nn.Linear`` is an error (a typo would leave a layer
    whole), as is a name two patterns with different styles match. ``seed``: the base of the
    converted layers' dropout seeds (each layer's is derived from it and its module name: the
    same on every rank); the module docstring says what the model's own dropouts need.
    ``plan=None``: a Hugging Face model's own plan (the module docstring)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"takes an nn.Module, got {type(model).__name__}",
            op="parallelize",
            hint="parallelize(model, comm, {'*.mlp.c_fc': 'colwise', '*.mlp.c_proj': 'rowwise'})",
        )
    own = plan is None
    if own:
        plan = _hf_plan(model, comm, axis)
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(
            f"the plan maps module-name patterns to styles, got {plan!r}",
            op="parallelize",
            hint="{'*.mlp.c_fc': 'colwise', '*.mlp.c_proj': 'rowwise'}",
        )
    styles: dict[str, Style] = {}
    for pattern, style in plan.items():
        try:
            named = Style(style.value if isinstance(style, Style) else style)
            styles[pattern] = _SAME.get(named, named)
        except ValueError:
            raise ConfigError(
                f"{pattern!r} has the style {style!r}",
                op="parallelize",
                hint="a style is one of " + ", ".join(repr(s.value) for s in Style),
            ) from None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    attentions = {name: m for name, m in model.named_modules() if _is_attention(m)}
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, style in styles.items():
        pool = attentions if style is Style.ATTENTION else linears
        hits = [name for name in pool if fnmatch.fnmatchcase(name, pattern)]
        if not hits and not own:  # (a model's own plan names what some of its variants have)
            what = "attention module (c_attn, c_proj, n_head)" if style is Style.ATTENTION \
                else "nn.Linear"  # fmt: skip
            raise ConfigError(
                f"the pattern {pattern!r} matches no {what} of the model",
                op="parallelize",
                details=[f"its candidates: {', '.join(sorted(pool)[:20]) or 'none'}"],
                hint="patterns are fnmatch patterns over model.named_modules() names",
            )
        for name in hits:
            if name in chosen and chosen[name][1] is not style:
                raise ConfigError(
                    f"{name!r} is {chosen[name][1].value} by {chosen[name][0]!r} and "
                    f"{style.value} by {pattern!r}",
                    op="parallelize",
                    hint="make the patterns disjoint",
                )
            chosen[name] = (pattern, style)
    inside = [(a, n) for a in chosen if chosen[a][1] is Style.ATTENTION for n in chosen
              if n.startswith(a + ".")]  # fmt: skip
    if inside:
        raise ConfigError(
            f"{inside[0][1]!r} is inside the attention module {inside[0][0]!r}, "
            "which is swapped whole",
            op="parallelize",
            hint="leave the attention's own linears out of the plan",
        )
    dropouts = {name: _attention_dropouts(name, attentions[name]) for name in chosen
                if chosen[name][1] is Style.ATTENTION}  # fmt: skip
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}", op="parallelize",
                          hint="the base of the converted layers' dropout seeds")  # fmt: skip
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"comm must be the communicator of the model's ranks, got {comm!r}",
            op="parallelize",
            hint="comm = coconet.runtime.init(); parallelize(model, comm, plan)",
        )
    _check_torch_dropouts(model, set(dropouts), comm, axis)
    options = {"fused_kernels": fused_kernels}
    for name, (_, style) in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        own_seed = derive_seed(seed, name)
        if style is Style.ATTENTION:
            m = attentions[name]
            attn_p, resid_p = dropouts[name]
            new = ParallelSelfAttention.from_modules(
                m.c_attn, m.c_proj, m.n_head, comm=comm, axis=axis, attn_dropout=attn_p,
                resid_dropout=resid_p, seed=own_seed, **options,
            )  # fmt: skip
            new.train(m.training)
        else:
            new = _convert(linears[name], style, comm, axis, options, own_seed)
            new.train(linears[name].training)
        setattr(parent, child, new)
    _watch_replicas(model, layer_group(comm, axis))
    return model


def _hf_plan(model: nn.Module, comm: Communicator, axis: str | None) -> dict[str, str]:
    """A ``transformers`` model's own tensor-parallel plan, as ``parallelize`` takes it: its
    linears' entries; the entries whose module stays whole here recorded on the model
    (``coconet_plan_left_whole``); a refusal for a style that computes something else."""
    config = getattr(model, "config", None)
    full = getattr(model, "tp_plan", None)  # transformers >= 5: the whole model's
    if not isinstance(full, Mapping) and config is not None:  # transformers 4: the base model's
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(config, "base_model_tp_plan", None) or {}
        inner = prefix + "." if prefix and hasattr(model, prefix) else ""
        full = {**{inner + k: v for k, v in base.items()},
                **(getattr(model, "_tp_plan", None) or {})}  # fmt: skip
    if not full:
        raise ConfigError(
            f"no plan given, and {type(model).__name__} has no tensor-parallel plan of its own",
            op="parallelize",
            hint="pass one: parallelize(model, comm, {'*.mlp.c_fc': 'colwise', "
            "'*.mlp.c_proj': 'rowwise'}); a Hugging Face model has its own in model.tp_plan",
        )
    known = {s.value for s in Style} - {Style.ATTENTION.value}
    plan = {k: v for k, v in full.items() if v in known}
    whole = {k: v for k, v in full.items() if v in _WHOLE}
    other = {k: v for k, v in full.items() if k not in plan and k not in whole}
    if other:
        raise ConfigError(
            f"{type(model).__name__}'s own plan has styles coconet.nn does not run: "
            + ", ".join(f"{k}: {v}" for k, v in list(other.items())[:4]),
            op="parallelize",
            details=["coconet.nn runs colwise, rowwise (and their _rep / Hugging Face "
                     "gather_output / split_input forms); embeddings and replicated modules "
                     "stay whole"],
            hint="pass a plan of your own for this model's linears",
        )  # fmt: skip
    parts = layer_group(comm, axis).world
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % parts:
            raise ConfigError(
                f"{field} = {heads} does not divide over the {parts} ranks of the group",
                op="parallelize",
                hint="each rank computes whole heads: a group whose size divides the heads",
            )
    model.coconet_plan_left_whole = whole
    return plan


def _watch_replicas(model: nn.Module, group: Communicator) -> None:
    """Check, at each training forward, that the parameters every rank of ``group`` holds
    whole still agree (``coconet.nn.replicas``): a forward pre-hook arms the check, the first
    layer call carries it in its agreement."""
    if group.world == 1:
        return
    replicated = [(n, p) for n, p in model.named_parameters() if placement_of(p) is None]
    check = ReplicaCheck(group, replicated)
    model.register_forward_pre_hook(check.arm)
    for m in model.modules():
        if isinstance(m, _ParallelLinear):
            m._replicas = check


def attach(model: nn.Module, comm: Communicator) -> nn.Module:
    """Give a model loaded without its group (``torch.load`` of a ``torch.save``d parallelized
    model, an unpickled one) the communicator of this job: every ``coconet.nn`` layer in it, and
    its split parameters' placements, run over ``comm`` (the layer's ``axis`` group of it).
    Each rank loads the file it saved; a layer whose saved part is not this rank's part of the
    group is refused. Returns the model."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"takes an nn.Module, got {type(model).__name__}",
                          op="coconet.nn.attach",
                          hint="model = coconet.nn.attach(torch.load(path, weights_only=False), "
                          "comm)")  # fmt: skip
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"comm must be the communicator of the model's ranks, got {comm!r}",
            op="coconet.nn.attach",
            hint="comm = coconet.runtime.init(); coconet.nn.attach(model, comm)",
        )
    for name, m in model.named_modules():
        if isinstance(m, _ParallelLinear):
            m._attach(comm, name)
    return model


def _attention_dropouts(name: str, m: nn.Module) -> tuple[float, float]:
    """The dropout probabilities (on the attention's probabilities, after its projection) of
    attention module ``m``, read as nanoGPT and GPT-2 keep them; anything else in the module
    that the parallel layer would not do is refused (it cannot be dropped silently)."""
    found: dict[str, float] = {}
    for child_name, child in m.named_children():
        if child_name in ("c_attn", "c_proj"):
            continue
        if child_name in ("attn_dropout", "resid_dropout") and type(child) is nn.Dropout:
            found[child_name] = float(child.p)
        elif not (isinstance(child, nn.Identity) or (isinstance(child, _DropoutNd) and
                                                      child.p == 0)):  # fmt: skip
            what = f"{type(child).__name__}(p={child.p})" if isinstance(child, _DropoutNd) \
                else type(child).__name__  # fmt: skip
            raise ConfigError(
                f"the attention module {name!r} has {child_name!r} = {what}, which "
                "ParallelSelfAttention cannot carry over",
                op="parallelize",
                details=["what it carries over: c_attn, c_proj, n_head, and dropout as "
                         "nn.Dropout attn_dropout (the probabilities), nn.Dropout resid_dropout "
                         "(after c_proj) or a float dropout (the probabilities)"],
                hint="build the layer yourself (ParallelSelfAttention.from_modules, with its "
                "attn_dropout= and resid_dropout=) and do the rest around it, or leave the "
                "module whole",
            )  # fmt: skip
    fields = {k: v for k, v in vars(m).items() if not k.startswith("_") and "drop" in k.lower()}
    for key, value in fields.items():
        if key != "dropout" and _is_number(value) and value > 0:
            raise ConfigError(
                f"the attention module {name!r} has {key} = {value}: a dropout that "
                "ParallelSelfAttention cannot place",
                op="parallelize",
                hint="give it as attn_dropout= or resid_dropout= of a ParallelSelfAttention "
                "built yourself (from_modules), or leave the module whole",
            )
    module_p = found.get("attn_dropout")
    float_p = float(fields["dropout"]) if _is_number(fields.get("dropout")) else None
    if module_p is None or float_p is None or module_p == float_p:
        attn_p = module_p if float_p is None else float_p
    elif isinstance(getattr(m, "flash", None), bool):
        # nanoGPT: the flash path passes the float to scaled_dot_product_attention, the other
        # path applies the module
        attn_p = float_p if m.flash else module_p
    else:
        raise ConfigError(
            f"the attention module {name!r} has attn_dropout.p = {module_p} and dropout = "
            f"{float_p}: which of them it applies to the probabilities is not known",
            op="parallelize",
            hint="make them equal (nanoGPT sets both from config.dropout)",
        )
    return attn_p or 0.0, found.get("resid_dropout", 0.0)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_torch_dropouts(model: nn.Module, converted: set[str], comm: Communicator,
                          axis: str | None) -> None:  # fmt: skip
    """The model's own dropouts (outside the attention modules converted) draw from torch's
    generator on each rank: refuse when the generators of the group's ranks differ now (their
    masks on values every rank shares would differ, and the ranks' replicas drift apart)."""
    drawing = [n for n, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0
               and not any(n.startswith(a + ".") for a in converted)]  # fmt: skip
    group = layer_group(comm, axis)
    if not drawing or group.world == 1:
        return
    state = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.update(torch.cuda.get_rng_state().numpy().tobytes())
    every = group.exchange(state.hexdigest(), "parallelize: torch's generator")
    differ = [r for r, h in enumerate(every) if h != every[0]]
    if differ:
        raise ConfigError(
            f"the model's own dropouts draw from torch's generator, which differs between the "
            f"ranks of the group: ranks {differ} from rank 0",
            op="parallelize",
            details=[f"dropouts: {', '.join(drawing[:6])}{' ...' if len(drawing) > 6 else ''}",
                     "they act on values every rank of the group shares: different masks "
                     "train different replicas of the weights the ranks share"],
            hint="seed torch alike on every rank of the group (torch.manual_seed(seed), not "
            "seed + rank) and keep it in step: draw per-rank randomness from a "
            "torch.Generator of its own",
        )  # fmt: skip


def _is_attention(m: nn.Module) -> bool:
    return (
        isinstance(getattr(m, "c_attn", None), nn.Linear)
        and isinstance(getattr(m, "c_proj", None), nn.Linear)
        and isinstance(getattr(m, "n_head", None), int)
    )
