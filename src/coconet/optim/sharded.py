"""Fully sharded parameters: the optimizer's side of ``coconet.fsdp``.

A model sharded by ``coconet.fsdp.fully_shard`` stores each block's parameters as flat
segments, one slice per rank (``coconet.fsdp.blocks``). An optimizer built over its parameters
takes each segment as one of its steps: the segments are laid out again so that each holds one
param group's parameters of one dtype (``Block.layout``), and each gets a ``SegmentStep``: the
optimizer's program scheduled ``fuse_RS_C`` (the reduce_scatter of the gradient with the update
of this rank's slice of the parameters and of the state, one fused collective, no all_gather:
the next forward gathers), its state slices and its step count. The model's backward hands each
segment's gradient to ``SegmentStep.step`` as soon as its block's backward is done.

The state in torch's format (``state_dict``/``load_state_dict``) is gathered from and sliced
into the segments' state, keyed by the parameters' indices as torch numbers them, so a state
dict moves between this optimizer at any world size, the same one unsharded, and
``torch.optim``'s.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from coconet import schedule as schedules
from coconet.compiler import compile as coconet_compile
from coconet.errors import CoconetError, ConfigError
from coconet.fsdp import dcp
from coconet.fsdp.blocks import Block, Segment, Unsharded
from coconet.fsdp.model import FullyShardedModel, sharded_model_of
from coconet.ir.ops import COMMUNICATION, Op, ReduceOp
from coconet.ir.program import Program
from coconet.ir.types import DType, Sliced
from coconet.optim.programs import MASTER, MASTER_STATE_KEY, Clip, Precision
from coconet.options import ParamStorage, Rounding
from coconet.runtime.shards import placement_of
from coconet.schedule import Schedule
from coconet.schedule.graph import new_node, rewrite

__all__ = ["DCP_FORMAT", "SegmentStep", "ShardedSteps", "is_fully_sharded", "on_slices"]

# a sharded_state_dict() of fully sharded parameters (torch's distributed checkpoint's tensors)
DCP_FORMAT = "coconet.fsdp.sharded/1"


def is_fully_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a fully sharded parameter (``coconet.fsdp``)."""
    return any(sharded_model_of(p) is not None for p in params)


class SegmentStep:
    """One segment's step: the compiled fused step, the state slices and the step count."""

    def __init__(self, room: ShardedSteps, group: int, seg: Segment) -> None:
        opt = room.opt
        self.room, self.group = room, group
        dtype = DType.from_torch(seg.dtype)
        reduce = None if opt.reduce_dtype is None else DType.from_torch(opt.reduce_dtype)
        precision = Precision.of(dtype, reduce)
        names = dict(opt.state_names(opt.param_groups[group]))
        if precision.master:
            names[MASTER] = MASTER_STATE_KEY
        self.names = names
        extra: dict[str, Any] = {} if reduce is None else {"reduce": reduce}
        program = opt.program(opt.param_groups[group], dtype, **extra)
        # the parameters are sliced like the state: the update ends the step, the all_gather
        # moves to the block's next forward
        target = schedules.fuse_RS_C(program, state=("p", *names))
        self.step_fn = coconet_compile(target, comm=opt.comm, options=opt.recipes.options)
        n = seg.bounds[1] - seg.bounds[0]
        self.state = {name: torch.zeros(n, dtype=precision.math.torch, device=opt.comm.device)
                      for name in names}  # fmt: skip
        if precision.master:
            self.state[MASTER].copy_(seg.shard.float())
        self.steps = 0
        # max_grad_norm= (the global norm needs every block's gradient before any update) or
        # update_in_backward=False (gradients accumulated over several backwards): the
        # backward only reduce_scatters (into ``grad_sum``, this rank's slice of the
        # gradients' sum) and ``opt.step()`` updates each slice on its own rank, clipped
        self.grad_sum: torch.Tensor | None = None
        self.update_fn = None
        if room.deferred:
            local = on_slices(opt.program(opt.param_groups[group], dtype, clip=Clip.GIVEN,
                                             averaged=True, **extra))  # fmt: skip
            self.update_fn = coconet_compile(local, comm=opt.comm, options=opt.recipes.options)

    def took_values(self, seg: Segment) -> None:
        """The segment's slice was written (``gathered(writeback=True)``): a float32 master
        copy starts again from it."""
        if MASTER in self.state:
            self.state[MASTER].copy_(seg.shard.float())

    def gradient_buffer(self, seg: Segment) -> torch.Tensor:
        """Where the segment's gradient is accumulated: a buffer the step's collective reads in
        place, one per size and dtype (blocks of one shape share it: one steps at a time)."""
        return self.room.buffer(self.step_fn, seg.size, seg.dtype)

    def step(self, seg: Segment) -> None:
        """The fused reduce_scatter and update of this rank's slice (collective); with
        clipping, the reduce_scatter alone, summed into ``grad_sum``."""
        opt = self.room.opt
        if self.update_fn is not None:
            work = opt.comm.reduce_scatter_start(
                seg.grad, ReduceOp.SUM, dim=0, axis=None, donate=False,
                label="coconet.fsdp reduce_scatter of a block's gradient")  # fmt: skip
            part = opt.comm.wait(work)
            if self.grad_sum is None:
                self.grad_sum = part.clone() if part.data_ptr() == seg.grad.data_ptr() else part
            else:
                self.grad_sum += part
            return
        scalars = opt.scalars(opt.param_groups[self.group], self.steps + 1)
        self.step_fn.run({"g": seg.grad, "p": seg.shard, **self.state, **scalars})
        self.steps += 1

    def squares(self) -> torch.Tensor:
        """The sum of squares of this rank's slice of the averaged gradient (float64)."""
        opt = self.room.opt
        scale = opt.scalars(opt.param_groups[self.group], self.steps + 1)["grad_scale"]
        if self.grad_sum is None:
            return torch.zeros((), dtype=torch.float64)
        return (self.grad_sum.double() * scale).square().sum()

    def update(self, seg: Segment, coef: torch.Tensor) -> None:
        """This rank's slice updated from ``grad_sum``, clipped by ``coef`` (no communication)."""
        opt = self.room.opt
        scalars = opt.scalars(opt.param_groups[self.group], self.steps + 1)
        grad = self.grad_sum if self.grad_sum is not None else torch.zeros_like(seg.shard)
        self.update_fn.run({"g": grad, "p": seg.shard, **self.state, **scalars,
                            "clip_coef": coef})  # fmt: skip
        self.grad_sum = None
        self.steps += 1


class ShardedSteps:
    """An optimizer's steps of fully sharded parameters (see the module docstring); ``opt``:
    the optimizer, through its public surface."""

    def __init__(self, opt: Any, model: FullyShardedModel) -> None:
        self.opt, self.model = opt, model
        if model.comm is not opt.comm and (model.comm.world, model.comm.rank) != (
                opt.comm.world, opt.comm.rank):  # fmt: skip
            raise ConfigError(
                f"the model is sharded over {model.comm.world} ranks and the optimizer's "
                f"communicator has {opt.comm.world}",
                op=f"coconet.optim.{type(opt).__name__}",
                hint="give the optimizer the communicator the model was sharded with (comm=)",
            )
        self.group_of: dict[int, int] = {}  # id(parameter) -> its param group
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.clipped = opt.clipper.max_norm is not None
        self.deferred = self.clipped or not model.update_in_backward

    @staticmethod
    def take_group(opt: Any, index: int, group: dict[str, Any]) -> None:
        """``opt.add_param_group`` of a group of fully sharded parameters (``coconet.fsdp``),
        after torch's checks: what this optimizer cannot do over them is refused, the room is
        made at the first group, the group's parameters taken (collective). A refusal removes
        the group again."""
        name = f"coconet.optim.{type(opt).__name__}"
        try:
            unsupported = [what for what, on in (
                ("ddp=", opt.ddp is not None),
                ("param_storage='host_shared'", opt.storage is ParamStorage.HOST_SHARED),
                ("max_grad_norm= with reduce_dtype=", opt.clipper.max_norm is not None
                 and opt.reduce_dtype is not None),
                (f"{type(opt).__name__} (its norms are each whole tensor's)",
                 opt.bucket_per_parameter),
                ("rounding='stochastic'", opt.rounding is Rounding.STOCHASTIC),
                ("parameters packed before (a group of plain parameters)", len(opt.buckets) > 0),
            ) if on]  # fmt: skip
            if unsupported:
                raise ConfigError(
                    f"fully sharded parameters (coconet.fsdp) do not take {unsupported[0]} yet",
                    op=name,
                    hint="leave it out; these are not built yet for fully sharded parameters",
                )
            opt.check_group(group, f"param group {index}")
            trainable = [p for p in group["params"] if p.requires_grad]
            if opt.sharded is None:
                model = sharded_model_of(group["params"][0]) if group["params"] else None
                if model is None:
                    raise ConfigError(
                        "a param group mixes fully sharded parameters with others",
                        op=name,
                        hint="fully_shard the whole model and build the optimizer over "
                        "model.parameters()",
                    )
                opt.sharded = ShardedSteps(opt, model)
            opt.sharded.add_group(index, trainable)
        except BaseException:
            opt.param_groups.pop()  # as if never added
            raise

    # -- taking parameters -----------------------------------------------------------------------

    def add_group(self, index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Take group ``index``'s trainable parameters: lay out again the blocks they are in,
        so that each segment is one group's of one dtype (collective)."""
        opt = self.opt
        for p in params:
            if sharded_model_of(p) is not self.model:
                raise ConfigError(
                    "a param group mixes fully sharded parameters with others (or with another "
                    "sharded model's)",
                    op=f"coconet.optim.{type(opt).__name__}",
                    hint="fully_shard the whole model (its leftover parameters form the root "
                    "block) and build the optimizer over model.parameters()",
                )
            if id(p) in self.group_of:
                raise ConfigError(
                    "a parameter appears in more than one param group",
                    op=f"coconet.optim.{type(opt).__name__}",
                    hint="give each parameter to one group",
                )
        _agree_on_shapes(opt, index, params)
        for p in params:
            self.group_of[id(p)] = index
        touched = [b for b in self.model.blocks if any(id(q) in self.group_of for q in b.params)]
        for b in touched:
            self._relayout(b)

    def _relayout(self, b: Block) -> None:
        # (parts of tensors split over a tp group apart from whole tensors: their squares count
        # over that group too in the global norm)
        keys = [(self.group_of.get(id(p)), p.dtype, _parts_key(p)) for p in b.params]
        kept = {(seg.key, tuple(id(b.params[i]) for i in seg.members)): seg.owner
                for seg in b.segments}  # fmt: skip
        if [seg.key for seg in b.segments] != list(dict.fromkeys(map(tuple, keys))):
            was_freed = b.state is not Unsharded.WHOLE
            b.finish_gather()
            values = [v.clone() for v in b.values()]
            b.layout(keys, values)
            if was_freed:
                b.free()
        for seg in b.segments:
            group = seg.key[0] if len(seg.key) == 3 else None
            owner = kept.get((seg.key, tuple(id(b.params[i]) for i in seg.members)))
            if owner is None and group is not None:
                owner = SegmentStep(self, group, seg)
            seg.owner = owner

    def buffer(self, step_fn: Any, size: int, dtype: torch.dtype) -> torch.Tensor:
        key = (size, dtype)
        if key not in self._buffers:
            if step_fn.collective_reads("g"):
                self._buffers[key] = step_fn.input_buffer("g", (size,))
            else:  # cast before it is sent (reduce_dtype=): an ordinary tensor
                self._buffers[key] = torch.empty(size, dtype=dtype, device=self.opt.comm.device)
        return self._buffers[key]

    def step(self, grad_scaler: Any = None) -> None:
        """``opt.step()``: with ``max_grad_norm=``, the global norm of the averaged gradient
        (every segment's slice, summed over the ranks: one scalar all_reduce) and each slice's
        update clipped by torch's factor; with ``update_in_backward=False`` alone, each
        slice's update of the gradients accumulated since the last step; otherwise nothing
        (each block stepped in the backward)."""
        if grad_scaler is not None:
            raise ConfigError(
                "a GradScaler over fully sharded parameters (coconet.fsdp) is not built yet",
                op=f"coconet.optim.{type(self.opt).__name__}.step",
                hint="train in bfloat16 or float32 without a scaler",
            )
        if not self.deferred:
            return
        opt = self.opt
        pending = [(b, seg) for b, seg in self.segments() if seg.owner.grad_sum is not None]
        if not pending:
            return  # no backward since the last step: torch's optimizer steps nothing either
        if not self.clipped:  # (clip_coef 1: ``grad * 1.0`` is ``grad``, bit for bit)
            for _, seg in self.segments():
                seg.owner.update(seg, torch.ones((), device=opt.comm.device))
            return
        whole = torch.zeros((), dtype=torch.float64)
        parts: dict[tuple, tuple[Any, torch.Tensor]] = {}
        for b, seg in self.segments():
            placement = placement_of(b.params[seg.members[0]])
            if placement is None:
                whole = whole + seg.owner.squares()
            else:  # (one tp group per rank: the parts' squares summed over it first)
                comm, sq = parts.get(placement.key, (placement.comm, 0.0))
                parts[placement.key] = (comm, sq + seg.owner.squares())
        for comm, sq in parts.values():
            work = comm.all_reduce_start(sq.reshape(1), ReduceOp.SUM, axis=None, donate=True,
                                         label="coconet.fsdp gradient norm (parts)")  # fmt: skip
            whole = whole + comm.wait(work).reshape(())
        work = opt.comm.all_reduce_start(whole.reshape(1), ReduceOp.SUM, axis=None,
                                         donate=True, label="coconet.fsdp gradient norm")
        norm = opt.comm.wait(work).reshape(()).sqrt().float()
        coef = opt.clip_factor(norm)
        for _, seg in self.segments():
            seg.owner.update(seg, coef)
        opt.clipper.last_grad_norm, opt.clipper.last_clip_coef = norm, coef

    def segments(self) -> list[tuple[Block, Segment]]:
        """Every stepped segment, in the blocks' order (the same on every rank)."""
        return [(b, seg) for b in self.model.blocks for seg in b.segments
                if seg.owner is not None]  # fmt: skip

    # -- torch's state dict ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format, whole tensors gathered from the slices (collective)."""
        from coconet.optim.state import packed_groups

        opt = self.opt
        groups, index = packed_groups(opt.param_groups)
        out: dict[int, dict[str, Any]] = {}
        for b, seg in self.segments():
            owner = seg.owner
            if not owner.steps:
                continue
            whole = {name: self._gather(seg, x) for name, x in owner.state.items()}
            for j, i in enumerate(seg.members):
                p = b.params[i]
                a, z = seg.span(j)
                entry: dict[str, Any] = dict(opt.step_state(owner.steps))
                for name, key in owner.names.items():
                    entry[key] = whole[name][a:z].view(b.shapes[i]).clone()
                out[index[id(p)]] = entry
        return {"state": out, "param_groups": groups}

    def _gather(self, seg: Segment, x: torch.Tensor) -> torch.Tensor:
        comm = self.opt.comm
        work = comm.all_gather_start(x, dim=0, parts=seg.parts, axis=None,
                                     label="coconet.fsdp state gather")  # fmt: skip
        return comm.wait(work)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's state slices as torch's distributed checkpoint takes them (no
        communication; ``coconet.fsdp.dcp``): per parameter (torch's index), each state
        tensor a flat ``ShardedTensor`` whose local part is a view of this rank's slice, and
        its step count. ``dcp.load`` into this optimizer's ``sharded_state_dict()`` (at any
        world size) and pass the result to ``load_state_dict``."""
        from coconet.optim.state import packed_groups

        opt = self.opt
        dcp.whole_world(opt.comm, f"{type(opt).__name__}.sharded_state_dict")
        rank = dist.get_rank()
        groups, index = packed_groups(opt.param_groups)
        out: dict[str, Any] = {}
        for b, seg in self.segments():
            owner = seg.owner
            for i, part_seg, offset, at in dcp.flat_parts(b):
                if part_seg is not seg:
                    continue
                j = seg.members.index(i)
                a, z = seg.span(j)
                size = min(z, seg.bounds[1]) - (a + offset) if at >= 0 else 0
                entry: dict[str, Any] = {"step": torch.tensor(float(owner.steps))}
                for name, key in owner.names.items():
                    local = owner.state[name][at : at + size] if at >= 0 else None
                    entry[key] = dcp.sharded(local, offset, z - a, rank)
                out[str(index[id(b.params[i])])] = entry
        # (the groups' settings as one string: torch's checkpoint flattens nested lists when
        # it saves and may not when it loads)
        settings = json.dumps([{k: v for k, v in g.items() if k != "params"} for g in groups])
        return {"format": DCP_FORMAT, "state": out, "param_groups": settings}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format, checked on every rank before the ranks agree (all load or none)."""
        from coconet.optim.agreement import CallKind

        checked, refusal = None, None
        try:
            if state_dict.get("format") == DCP_FORMAT:
                checked = ("dcp", self.check_dcp(state_dict))
            else:
                checked = self.check_load(state_dict)
        except CoconetError as e:
            refusal = e
        # (each rank loads its own slices: the verdicts alone are compared)
        self.opt.agree_call(CallKind.LOAD_STATE_DICT, "fully sharded", refusal)
        self.apply_load(checked)
        self.opt.after_load()

    def check_load(self, state_dict: dict[str, Any]) -> Any:
        """torch's format (from this optimizer at any world size, unsharded, or torch's),
        checked whole before anything changes (a ``ConfigError``): what ``apply_load`` loads,
        each rank its slices (no communication)."""
        from coconet.optim.state import packed_groups

        opt = self.opt
        groups, index = packed_groups(opt.param_groups)
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        name = f"coconet.optim.{type(opt).__name__}.load_state_dict"
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ConfigError("not a state dict in torch's format ('state', 'param_groups')",
                              op=name, hint="pass what state_dict() returned")  # fmt: skip
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
            raise ConfigError(
                f"the state dict has param groups of "
                f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
                f"{[len(g['params']) for g in groups]}",
                op=name, hint="load a state dict of the same model's optimizer")  # fmt: skip
        plan = []
        for b, seg in self.segments():
            owner = seg.owner
            entries = [saved_state.get(index[id(b.params[i])]) for i in seg.members]
            have = [e for e in entries if e is not None]
            if not have:
                plan.append((seg, None, 0))
                continue
            steps = {opt.step_of(e) for e in have}
            if len(have) != len(entries) or len(steps) != 1:
                raise ConfigError(
                    f"block {b.name}: its parameters' saved states differ in step count or "
                    "presence, and a fully sharded segment steps its parameters together",
                    op=name, hint="load a state dict of a model trained with every parameter "
                    "stepped at every step")  # fmt: skip
            values = {}
            for prog, key in owner.names.items():
                parts = []
                for j, (i, e) in enumerate(zip(seg.members, entries, strict=True)):
                    if key not in e and prog == MASTER:
                        parts.append(b.params[i].detach().float().reshape(-1)
                                     if b.state is Unsharded.WHOLE else None)
                        continue
                    t = e.get(key)
                    if not isinstance(t, torch.Tensor) or t.numel() != seg.numels[j]:
                        raise ConfigError(
                            f"state {key!r} of {b.names[i]!r}: expected {seg.numels[j]} values, "
                            f"got {getattr(t, 'shape', t)}",
                            op=name, hint="load a state dict of the same model's optimizer")
                    parts.append(t.detach().reshape(-1).to(owner.state[prog].dtype))
                values[prog] = parts
            plan.append((seg, values, steps.pop()))
        return saved_groups, plan

    def check_dcp(self, state_dict: dict[str, Any]) -> list:
        """A ``sharded_state_dict()`` that ``dcp.load`` filled: each segment's step count and
        each state tensor's local part, checked (what ``apply_load`` copies)."""
        from coconet.optim.state import packed_groups

        opt = self.opt
        name = f"coconet.optim.{type(opt).__name__}.load_state_dict"
        _, index = packed_groups(opt.param_groups)
        saved = state_dict["state"]
        plan = []
        for b, seg in self.segments():
            keys = [str(index[id(b.params[i])]) for i in seg.members]
            missing = [b.names[i] for i, k in zip(seg.members, keys, strict=True)
                       if k not in saved]  # fmt: skip
            if missing:
                raise ConfigError(f"the sharded state dict has no state of {missing[0]!r}",
                                  op=name, hint="dcp.load into this optimizer's "
                                  "sharded_state_dict(), then pass it")  # fmt: skip
            steps = {int(saved[k]["step"]) for k in keys}
            if len(steps) != 1:
                raise ConfigError(f"block {b.name}: its parameters' step counts differ "
                                  f"({sorted(steps)})", op=name,
                                  hint="load a checkpoint of this model's optimizer")  # fmt: skip
            parts = []
            for i, part_seg, _, at in dcp.flat_parts(b):
                if part_seg is not seg or at < 0:
                    continue
                entry = saved[str(index[id(b.params[i])])]
                for prog, key in seg.owner.names.items():
                    local = dcp.local_of(entry[key])
                    if local is not None:
                        parts.append((seg.owner.state[prog], at, local))
            plan.append((seg, steps.pop(), parts))
        groups = state_dict.get("param_groups")
        groups = json.loads(groups) if isinstance(groups, str) else groups
        if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
            raise ConfigError("the sharded state dict's param groups differ from this "
                              "optimizer's", op=name,
                              hint="load a checkpoint of this model's optimizer")  # fmt: skip
        return [groups, plan]

    def apply_load(self, checked: Any) -> None:
        """Load what ``check_load`` (or ``check_dcp``) checked."""
        if checked[0] == "dcp":
            saved_groups, plan = checked[1]
            _set_hyperparameters(self.opt.param_groups, saved_groups)
            for seg, steps, parts in plan:
                seg.owner.steps = steps
                for x, at, local in parts:
                    here = x[at : at + local.numel()]
                    if here.data_ptr() != local.data_ptr():
                        here.copy_(local)
            return
        saved_groups, plan = checked
        _set_hyperparameters(self.opt.param_groups, saved_groups)
        for seg, values, steps in plan:
            owner = seg.owner
            owner.steps = steps
            lo, hi = seg.bounds
            for prog, x in owner.state.items():
                if values is None:
                    x.zero_()
                    if prog == MASTER:
                        x.copy_(seg.shard.float())
                    continue
                if any(v is None for v in values[prog]):
                    x.copy_(seg.shard.float())
                    continue
                x.copy_(torch.cat(values[prog])[lo:hi])


def _parts_key(p: torch.Tensor) -> tuple:
    placement = placement_of(p)
    return () if placement is None else placement.key


def _set_hyperparameters(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    for g, s in zip(groups, saved, strict=True):
        for k, v in s.items():
            if k != "params":  # (a tuple that came back a list: JSON's, betas)
                v = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
                g[k] = copy.deepcopy(v)


def on_slices(program: Program) -> Schedule:
    """A program that communicates nothing (an optimizer's step of gradients averaged
    before it) run on slices: its tensor inputs Sliced along dim 0 instead of Replicated (each
    rank passes its slice of each, the program's own slicing), its computations one fused
    kernel. Elementwise, so the arithmetic is the same, element by element."""
    if any(n.op in COMMUNICATION for n in program.nodes):
        raise ConfigError(f"{program.name} communicates: it cannot run on one rank alone",
                          op="coconet.optim.sharded")  # fmt: skip
    mapping = {}
    for t in program.inputs:
        if t.type.rank > 0:
            attrs = {"dtype": t.type.dtype, "shape": t.type.shape, "layout": Sliced(0, None)}
            mapping[t.name] = new_node("on_slices", Op.INPUT, (), attrs, name=t.name, like=t)
    local = rewrite("on_slices", program, mapping)
    s = Schedule(local, "C")
    computed = [n.name for n in local.nodes
                if n.op not in (Op.INPUT, Op.UPDATE) and n.type.rank > 0]  # fmt: skip
    if computed:
        s.fuse(computed)
    return s


def _agree_on_shapes(opt: Any, index: int, params: Sequence[torch.nn.Parameter]) -> None:
    """Every rank takes the same shapes in the same order, else all of them fail."""
    text = f"{index}|" + ";".join(f"{p.dtype}{tuple(p.shape)}" for p in params)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    low, high = opt.comm.agree_max([digest, -digest], "fully sharded parameters")
    if low != digest or -high != digest:
        raise ConfigError(
            f"param group {index}: the ranks hold different fully sharded parameters",
            op=f"coconet.optim.{type(opt).__name__}",
            hint="build the same model on every rank, fully_shard it alike, and pass its "
            "parameters in the same order",
        )
