"""``coconet.compile``: a program or schedule -> a ``CompiledStep`` that runs one step per call.

::

    comm = coconet.runtime.init()                       # reads torchrun's environment
    step = coconet.compile(schedule, comm=comm)         # or a program; fused_kernels=False
    outputs = step(g=grad, p=param, m=m, v=v, lr=1e-3)  # updates p, m, v in place on success

Compilation lowers the scheduled program to per-rank steps, writes them as a readable Python
module (``step.source``; ``coconet show`` prints it), loads it, and wraps its fused groups as
``torch.compile`` kernels. Generated modules are cached by a hash of (program, schedule digest,
mesh, device, coconet version, build key): compiling the same thing twice in one process reuses the
module, and the source is kept under ``<cache_dir>/<build key>/generated`` (``coconet.cache``).

Everything that changes what is generated is in ``CompileOptions``; nothing is read from the
environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
from typing import Any

import torch

from coconet.cache import build_key, keyed_cache_dir, prune
from coconet.codegen import emit, forms, load_module, lower
from coconet.errors import CodegenError, CompileOptionError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.options import CompileOptions, TransportKind
from coconet.runtime.comm import Communicator
from coconet.runtime.step import CompiledStep
from coconet.schedule import Schedule
from coconet.version import __version__

__all__ = ["CompileOptions", "compile", "resolve_target"]

# Bump when the generated code changes shape, so cached modules of older coconets are not reused.
GENERATOR_VERSION = 2


# Generated modules of this process, by key: compiling the same thing twice reuses the module.
_MODULES: dict[str, types.ModuleType] = {}


def resolve_target(target: Any) -> tuple[Program, str, str]:
    """(program, schedule text, schedule digest) of a Program or a Schedule (anything with
    ``.program``); the text and digest are empty for a bare Program.

    The text is for people (the generated module's header, messages); the digest is the
    schedule's identity (the cache key, the handshake): the text elides long lists of names, so
    two different schedules can print alike.
    """
    if isinstance(target, Program):
        return target, "", ""
    program = getattr(target, "program", None)
    if isinstance(program, Program):
        text = str(target)
        if isinstance(target, Schedule):
            return program, text, target.digest
        # Something schedule-like but not a Schedule: its text is all there is to identify it.
        return program, text, hashlib.sha256(text.encode()).hexdigest()[:16]
    raise CompileOptionError(
        f"compile takes a Program or a Schedule, got {type(target).__name__} {target!r}",
        op="compile",
        hint="pass the program built with the DSL, or a coconet.schedule.Schedule of it",
    )


def _transport(transport: TransportKind | str | None, comm: Communicator | None) -> TransportKind:
    if transport is None:
        return TransportKind.TORCH_DISTRIBUTED
    if comm is not None:
        raise CompileOptionError(
            f"compile got transport={transport!r} and comm=: the communicator decides what runs "
            "each group's collectives",
            op="compile",
            hint="drop transport=, or choose it with CommOptions(transport=...) for the "
            "communicator",
        )
    try:
        return TransportKind(transport)
    except ValueError:
        raise CompileOptionError(
            f"unknown transport {transport!r}",
            op="compile",
            hint=f"one of {', '.join(repr(t.value) for t in TransportKind)}",
        ) from None


def compile(  # noqa: A001 - coconet.compile, like torch.compile
    target: Any,
    *,
    world: int | Mesh | None = None,
    comm: Communicator | None = None,
    options: CompileOptions | None = None,
    transport: TransportKind | str | None = None,
    **overrides: Any,
) -> CompiledStep:
    """Compile ``target`` (a Program or Schedule) into a ``CompiledStep``.

    The mesh comes from ``comm`` (the ``coconet.runtime.Communicator`` that
    ``coconet.runtime.init()`` returned: needed to run steps), else from ``world`` (an int or a
    Mesh: enough to generate and show code). Nothing is taken from global state.
    ``transport`` (with ``world=`` only) says what runs the collectives in the generated code:
    ``"torch.distributed"`` (the default) or ``"shared memory"``; with ``comm=`` the communicator
    decides, group by group.
    ``overrides`` set ``CompileOptions`` fields by name, e.g.
    ``compile(p, fused_kernels=False)``.
    """
    program, schedule, schedule_digest = resolve_target(target)
    options = _options(options, overrides)
    if comm is None and world is None:
        raise CompileOptionError(
            "compile needs to know the ranks: no comm= and no world= was given; pass comm= (the "
            "communicator coconet.runtime.init() returned) to run steps, or world=N (or a Mesh) "
            "to only generate the code",
            op="compile",
            hint="comm = coconet.runtime.init(); step = coconet.compile(program, comm=comm)",
        )
    mesh = _mesh(program, world, comm)
    device = _device(options.device, comm)
    donate = _donated(program, options.donate)
    # What runs each axis's collectives (said in the generated code; part of the key).
    chosen = _transport(transport, comm)
    transports = {
        axis: (comm.transport_of(axis) if comm is not None else chosen)
        for axis in (None, *mesh.names)
    }
    routes = ",".join(f"{a}={t.value}" for a, t in transports.items())
    key = _key(
        program,
        schedule_digest + f"|donate={sorted(donate)}|{routes}",
        mesh,
        device,
        __version__,
    )
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
        source = emit(plan, header, forms(plan, transports))
        generated = keyed_cache_dir(options.cache_dir) / "generated"
        module = load_module(source, f"{program.name}_{key}", generated)
        prune(generated)  # bounded: the least recently used modules go (coconet.cache)
        module.__coconet_source__ = source
        _MODULES[key] = module
    return CompiledStep(
        program=program,
        schedule=schedule,
        schedule_digest=schedule_digest,
        mesh=mesh,
        options=options,
        module=module,
        source=module.__coconet_source__,
        key=key,
        comm=comm,
        device=device,
        transports=routes,
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


def _device(asked: str | None, comm: Communicator | None) -> str:
    """The device the step computes on: the communicator's, which an explicit option must match
    (a step runs where its communicator's collectives run; another device would be ignored)."""
    have = comm.device.type if comm is not None else None
    if asked == "cuda" and not torch.cuda.is_available():
        raise CompileOptionError(
            'device="cuda" but this torch sees no GPU',
            op="compile",
            hint="leave device=None to take the communicator's device (cpu here)",
        )
    if asked is not None and have is not None and asked != have:
        raise CompileOptionError(
            f"device={asked!r} but the communicator computes on {have!r}",
            op="compile",
            hint="leave device=None to take the communicator's device",
        )
    return asked or have or "cpu"


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
    schedule_digest: str,
    mesh: Mesh,
    device: str,
    version: str,
) -> str:
    parts = [
        program.structural_key(),
        schedule_digest,
        str(mesh),
        device,
        version,
        str(GENERATOR_VERSION),
        build_key(),  # torch version and CPU: never reuse another build's module
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
