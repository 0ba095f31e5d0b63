"""``coconet.compile``: a program or schedule -> a ``CompiledStep`` that runs one step per call.

::

    comm = coconet.runtime.init()                       # reads torchrun's environment
    step = coconet.compile(schedule)                    # or compile(program), fused_kernels=False
    outputs = step(g=grad, p=param, m=m, v=v, lr=1e-3)  # updates p, m, v in place on success

Compilation lowers the scheduled program to per-rank steps, writes them as a readable Python
module (``step.source``; ``coconet show`` prints it), loads it, and wraps its fused groups as
``torch.compile`` kernels. Generated modules are cached by a hash of (program, schedule, mesh,
device, coconet version, build key): compiling the same thing twice in one process reuses the
module, and the source is kept under ``<cache_dir>/<build key>/generated`` (``coconet.cache``).

Everything that changes what is generated is in ``CompileOptions``; nothing is read from the
environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coconet.cache import build_key, keyed_cache_dir
from coconet.codegen import emit, load_module, lower
from coconet.errors import CodegenError, CompileOptionError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import Op
from coconet.ir.program import Program

__all__ = ["CompileOptions", "compile", "resolve_target"]

# Bump when the generated code changes shape, so cached modules of older coconets are not reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class CompileOptions:
    """What ``coconet.compile`` does.

    - ``fused_kernels``: compile each fused group with torch.compile (False: run it eagerly, op by
      op, for debugging; the results are the same up to floating-point contraction);
    - ``device``: ``"cpu"`` or ``"cuda"``; None takes the communicator's (cpu on gloo);
    - ``cache_dir``: the base of coconet's caches (generated modules, measured collective
      choices, Inductor's kernels), each under a subdirectory keyed by torch version and CPU
      (``coconet.cache``); None is ``$XDG_CACHE_HOME/coconet`` or ``~/.cache/coconet``;
    - ``check_every_step``: exchange the program hash and input shapes at every step (one tiny
      all_reduce), not only at the first; with False, shapes must not change between steps;
    - ``commit_vote``: before committing updates, all ranks confirm that the step succeeded
      everywhere (one tiny all_reduce), so that no rank commits a step that failed elsewhere;
    - ``donate``: names of inputs the step may overwrite, as DDP does with gradients: a donated
      input read only by a collective is reduced in place instead of on a copy. Its content is
      undefined after the step, even after a failed one (the other inputs stay untouched).

    Every field is checked when the options are made (a ``CompileOptionError``); the donated
    names are checked against the program's inputs by ``compile``.
    """

    fused_kernels: bool = True
    device: str | None = None
    cache_dir: str | Path | None = None
    check_every_step: bool = True
    commit_vote: bool = True
    donate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for flag in ("fused_kernels", "check_every_step", "commit_vote"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise CompileOptionError(
                    f"{flag} must be True or False, got {value!r}",
                    op="CompileOptions",
                    hint=f"CompileOptions({flag}=False)",
                )
        if self.device not in _DEVICES:
            raise CompileOptionError(
                f"unknown device {self.device!r}",
                op="CompileOptions",
                hint='device="cpu" or "cuda"; None takes the communicator\'s',
            )
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise CompileOptionError(
                f"cache_dir must be a path or None, got {self.cache_dir!r}",
                op="CompileOptions",
                hint="CompileOptions(cache_dir='~/.cache/coconet'); None is the default place",
            )
        donate = self.donate
        listed = isinstance(donate, Iterable) and not isinstance(donate, str)
        names = tuple(donate) if listed else ()
        if not listed or not all(isinstance(n, str) for n in names):
            raise CompileOptionError(
                f"donate takes a tuple of input names, got {self.donate!r}",
                op="CompileOptions",
                hint='donate=("g",)',
            )
        # Stored as a tuple: a list (or a generator, read once) would make the options unhashable.
        object.__setattr__(self, "donate", names)


_DEVICES = (None, "cpu", "cuda")


# Generated modules of this process, by key: compiling the same thing twice reuses the module.
_MODULES: dict[str, types.ModuleType] = {}


def resolve_target(target: Any) -> tuple[Program, str]:
    """(program, schedule description) of a Program or a Schedule (anything with ``.program``)."""
    if isinstance(target, Program):
        return target, ""
    program = getattr(target, "program", None)
    if isinstance(program, Program):
        return program, str(target)
    raise CompileOptionError(
        f"compile takes a Program or a Schedule, got {type(target).__name__} {target!r}",
        op="compile",
        hint="pass the program built with the DSL, or a coconet.schedule.Schedule of it",
    )


def compile(  # noqa: A001 - coconet.compile, like torch.compile
    target: Any,
    *,
    world: int | Mesh | None = None,
    comm: Any = None,
    options: CompileOptions | None = None,
    **overrides: Any,
):
    """Compile ``target`` (a Program or Schedule) into a ``CompiledStep``.

    The mesh comes from ``comm`` (a ``coconet.runtime.Communicator``), else from ``world`` (an int
    or a Mesh; enough to generate and show code), else from the communicator
    ``coconet.runtime.init()`` made. ``overrides`` set ``CompileOptions`` fields by name, e.g.
    ``compile(p, fused_kernels=False)``.
    """
    from coconet import __version__
    from coconet.runtime.launch import current
    from coconet.runtime.step import CompiledStep

    program, schedule = resolve_target(target)
    options = _options(options, overrides)
    if comm is None and world is None:
        comm = current()
        if comm is None:
            raise CompileOptionError(
                "compile needs to know the ranks: no world= was given and "
                "coconet.runtime.init() has not been called",
                op="compile",
                hint="call coconet.runtime.init() first, or pass world=N (or a Mesh) to only "
                "generate the code",
            )
    mesh = _mesh(program, world, comm)
    device = options.device or (comm.device.type if comm is not None else "cpu")
    donate = _donated(program, options.donate)
    key = _key(program, schedule + f"|donate={sorted(donate)}", mesh, device, __version__)
    module = _MODULES.get(key)
    source = None
    if module is None:
        plan = lower(program, donate)
        header = [
            f"program:  {program.name}  (digest {program.digest()})",
            "schedule: " + _schedule_line(schedule),
            f"mesh:     {mesh}    device: {device}",
            f"key:      {key}    coconet {__version__}",
            "",
            "step() runs one step on the calling rank and returns (outputs, updates); the",
            "runtime commits the updates into the caller's tensors once every rank succeeded.",
            "Collectives start as soon as their inputs are ready and are waited for just",
            "before their first use.",
        ]
        source = emit(plan, header)
        generated = keyed_cache_dir(options.cache_dir) / "generated"
        module = load_module(source, f"{program.name}_{key}", generated)
        module.__coconet_source__ = source
        _MODULES[key] = module
    return CompiledStep(
        program=program,
        schedule=schedule,
        mesh=mesh,
        options=options,
        module=module,
        source=module.__coconet_source__,
        key=key,
        comm=comm,
        device=device,
    )


def _schedule_line(schedule: str) -> str:
    """``schedule X of P: split(g); reorder(...)`` on one line (wrapped by the emitter)."""
    lines = [s.strip() for s in schedule.splitlines() if s.strip()]
    if not lines:
        return "(none)"
    return " ".join([lines[0], "; ".join(lines[1:])])


def _options(options: CompileOptions | None, overrides: dict[str, Any]) -> CompileOptions:
    if options is not None and not isinstance(options, CompileOptions):
        raise CompileOptionError(
            f"options must be CompileOptions, got {type(options).__name__} {options!r}",
            op="compile",
            hint="compile(p, options=CompileOptions(fused_kernels=False)), or the fields by "
            "name: compile(p, fused_kernels=False)",
        )
    options = options or CompileOptions()
    known = {f.name for f in dataclasses.fields(CompileOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise CompileOptionError(
            f"unknown compile option(s) {unknown}",
            op="compile",
            hint=f"CompileOptions has {sorted(known)}",
        )
    return dataclasses.replace(options, **overrides)


def _donated(program: Program, names: Any) -> frozenset[str]:
    # CompileOptions checked that names is a collection of strings.
    inputs = {n.name for n in program.inputs}
    unknown = sorted(set(names) - inputs)
    if unknown:
        raise CompileOptionError(
            f"donate names {unknown}, which are not inputs of program {program.name}",
            op="compile",
            hint=f"its inputs are {sorted(inputs)}",
        )
    return frozenset(names)


def _mesh(program: Program, world: int | Mesh | None, comm: Any) -> Mesh:
    if comm is not None:
        mesh = comm.mesh
        if world is not None and _as_mesh(world) != mesh:
            raise CompileOptionError(
                f"world={world} but the communicator's mesh is {mesh}",
                op="compile",
                hint="pass only one of world= and comm=",
            )
    else:
        mesh = _as_mesh(world)
    missing = program.mesh_axes - set(mesh.names)
    if missing:
        raise CodegenError(
            f"program {program.name} uses mesh axes {sorted(missing)} that {mesh} does not have",
            hint="build the communicator (coconet.runtime.init(mesh=...)) with a mesh that has "
            + ", ".join(sorted(program.mesh_axes)),
        )
    for n in program.nodes:
        if n.op in (Op.BROADCAST, Op.REDUCE) and n.attr("root") >= mesh.axis_size(n.attr("axis")):
            raise CodegenError(
                f"root={n.attr('root')} but the group along axis {n.attr('axis')!r} of {mesh} "
                f"has {mesh.axis_size(n.attr('axis'))} ranks",
                op=str(n.op),
                loc=n.loc,
            )
    return mesh


def _as_mesh(world: int | Mesh | None) -> Mesh:
    if isinstance(world, Mesh):
        return world
    if isinstance(world, int) and not isinstance(world, bool) and world >= 1:
        return Mesh.world(world)
    raise CompileOptionError(
        f"world must be a positive int or a Mesh, got {world!r}",
        op="compile",
        hint="world=2 generates the code for 2 ranks; world=Mesh(dp=2, tp=2) for a mesh",
    )


def _key(
    program: Program,
    schedule: str,
    mesh: Mesh,
    device: str,
    version: str,
) -> str:
    parts = [
        program.structural_key(),
        schedule,
        str(mesh),
        device,
        version,
        str(GENERATOR_VERSION),
        build_key(),  # torch version and CPU: never reuse another build's module
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
