"""``CompiledStep``: one compiled program, called once per step on every rank.

A call, on every rank:

1. checks this rank's inputs locally, without communicating: names, types, dtypes, devices,
   ranks of shapes, scalars that fit their dtype, and everything the commit needs of an updated
   tensor (writable in place: not an inference tensor, no element stored twice, no overlap with
   another updated or donated input);
2. runs the handshake (``handshake.settle``), at every step: the step's identity (program,
   schedule, mesh, the options that change collectives or numerics), which compiled step it is,
   its call count, the Replicated scalars (and, with ``check_replicated``, a checksum of the
   Replicated tensors) and every rank's verdict on step 1 are compared in one tiny all_reduce; a
   difference or a bad input anywhere fails every rank with the same message, before any data
   moves;
3. runs the generated ``step`` into fresh tensors (nothing the caller owns is written); at the
   first call with fused kernels, a rehearsal first (``_rehearse``): kernels compile outside
   the collectives and the ranks agree they are ready;
4. with ``commit_vote``, confirms that every rank got through (one tiny all_reduce);
5. commits: writes each update into the caller's tensor, and returns the outputs. A caller's
   ``commit_if`` (a test of the outputs, ``run``) may decline instead: nothing is written, the
   outputs are returned, and with ``commit_vote`` the ranks decline together when any declines.

A failure at 1 or 2 leaves everything usable. A failure at 3 or 4 (any ``BaseException``,
``KeyboardInterrupt`` included) raises and leaves the caller's tensors as they were; the
communicator is then marked broken, because its collectives may no longer line up across ranks.
Step 5 cannot fail half-way: what could make a write fail was ruled out at 1 (and voted on at
2); an interruption during the commit (Ctrl-C) is held until every update is written, then
raised with a note saying the step was committed; a write that still fails is retried once, and
only a write that fails twice (a bug in the checks of step 1) leaves this rank half-committed,
reported as a ``RuntimeFault`` naming the tensors written and not written.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch

from coconet import tracing
from coconet.cache import keyed_cache_dir, use_inductor_cache
from coconet.codegen.geometry import Geometry, geometry
from coconet.codegen.kernels import KernelSet
from coconet.errors import ConfigError, RuntimeFault, headline
from coconet.ir.mesh import Mesh
from coconet.ir.ops import Op
from coconet.ir.opspec import Prop, spec
from coconet.ir.program import Program
from coconet.options import CommitMode, CompileOptions
from coconet.runtime import handshake, interrupts, step_inputs
from coconet.runtime.binding import InputBinding
from coconet.runtime.comm import Communicator
from coconet.runtime.replica import HostReplica
from coconet.runtime.transport import Published
from coconet.tracing import Category
from coconet.version import __version__

__all__ = ["CompiledStep"]


class CompiledStep(InputBinding):
    """The result of ``coconet.compile``: call it with the program's inputs, by name."""

    def __init__(
        self,
        *,
        program: Program,
        schedule: str,
        schedule_digest: str,
        mesh: Mesh,
        options: CompileOptions,
        module: types.ModuleType,
        source: str,
        key: str,
        comm: Communicator | None,
        device: str,
        transports: str = "",
    ) -> None:
        self.program = program
        self.schedule = schedule  # the schedule's text, for people
        self.schedule_digest = schedule_digest  # its identity ("" for a bare program)
        self.mesh = mesh
        self.options = options
        self.module = module
        self.source = source
        self.key = key
        self.device = device
        self._comm = comm
        self._kernels: KernelSet | None = None
        self._exchanged: dict[str, tuple[int, ...]] | None = None  # shapes at the last exchange
        self._geometry: Geometry | None = None
        # the verdicts reached, by every rank's shapes: shapes seen before need no exchange
        self._verdicts = handshake.Verdicts()
        self._updated = {u.inputs[0].name for u in program.updates}
        self.transports = transports  # what runs each axis's collectives (part of the identity)
        self.calls = 0  # calls of this compiled step that every rank agreed on
        # the first call skipped its rehearsal (every rank preloaded): the second votes on
        # whether to rehearse after all (``_rehearse_again``)
        self._skipped_rehearsal = False
        self.last_declined = False  # whether the last call's commit_if declined its updates
        self._ordinal: int | None = None  # which step of this identity it is, on its communicator
        self._identity: tuple[Any, tuple, int] | None = None  # (options, identity, hash)
        # What the user set that each input is made from, for errors that name an input (a
        # library that derives inputs says: coconet.optim's ``step_size`` comes from ``lr``).
        self.input_sources: dict[str, str] = {}
        # Python-number scalars: the last value of each and its tensor, reused while it stays
        # the same (an optimizer passes ~10 per step, most of them constant): converting and
        # checking a number costs more than a small step's arithmetic.
        self._numbers: dict[str, tuple[type, int | float, torch.Tensor, str]] = {}
        # Per input, what binding it reads at every call: (name, node, whether the handshake
        # compares it: Replicated over the whole world; Replicated over one axis may differ
        # between that axis's groups, and the handshake spans the world).
        self._slots = [
            (n.name, n, n.type.layout.is_replicated and n.type.layout.axis is None)
            for n in program.inputs
        ]
        self._input_names = frozenset(n.name for n in program.inputs)
        # Tensor inputs that passed the local checks, by everything those checks read
        # (``_signature``), and the sets of them whose memory was checked together for
        # aliasing: a step called with the same tensors again (an optimizer's buckets: the
        # same few tensors every step) skips checks that would give the same answer.
        self._checked: set[tuple] = set()
        self._unaliased: set[tuple] = set()
        # A step that writes no input (no update, nothing donated) reads no address: a new
        # activation of the same shape each call (a layer's) passes the same checks.
        self._signature = (step_inputs.signature if self._updated or options.donate
                           else step_inputs.read_signature)  # fmt: skip
        # The last call whose inputs passed every local check (``_rebind``): a call with the
        # same tensors and numbers binds to the same shapes and agreed values with no check
        # worked out again (a layer's step, called once per token with its own weights).
        # Inputs whose agreed text is read from the tensor's value are never replayed.
        self._bound: step_inputs.Bound | None = None
        self._differs: int | None = None  # the input where the last call differed from it
        self._valued = frozenset(name for name, node, compared in self._slots if compared and (
            node.type.rank == 0 or options.check_replicated))
        # How this step's agreement can cost less than a round of its own (handshake): the
        # all_reduce it may ride with (the step's first communication, named by the generated
        # module), or whether the step communicates nothing and updates nothing at all (its calls
        # are then agreed at the communicator's next round).
        self._rides: str | None = getattr(module, "AGREEMENT", None)
        self._local = not program.updates and not any(
            spec(n.op).has(Prop.COMMUNICATES) for n in program.nodes
        )
        # Deferred collectives (coconet.schedule.defer): each -> the inputs it lands in; and the
        # last call's, in flight: (their works, the caller's tensors they land in).
        self._deferred: dict[str, tuple[str, ...]] = getattr(module, "DEFERRED", {})
        self._in_flight: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None

    # -- what it is -----------------------------------------------------------------------------

    @property
    def agrees_at_once(self) -> bool:
        """Whether a call's agreement settles in the call itself (False: a step that moves no
        data and updates nothing, whose calls are agreed at the communicator's next round, so
        a difference is reported by whatever step makes that round)."""
        return not self._local

    @property
    def kernels(self) -> KernelSet:
        """The fused kernels (compiled on their first call unless fused_kernels=False)."""
        if self._kernels is None:
            fused, where = self.options.fused_kernels, self.options.cache_dir
            if fused:
                use_inductor_cache(where)  # keyed by torch and CPU
            quiet = self._comm is not None and self._comm.rank != 0  # rank 0 says what it builds
            self._kernels = KernelSet(
                self.module.KERNELS, fused=fused, label=self.program.name,
                aot_dir=keyed_cache_dir(where) / "kernels" if self.options.kernel_packages
                else None, announce=not quiet,
            )
        return self._kernels

    def identity(self, comm: Communicator) -> tuple[tuple[str, str], ...]:
        """The fields every rank must agree on (compared at the handshake)."""
        return (
            ("program", self.program.name),
            ("program digest", self.program.digest()),
            # The digest tells schedules apart; the text (which elides long lists of names)
            # is there so that a mismatch reads as the schedules' lines.
            ("schedule", " ".join(self.schedule.split()) or "(none)"),
            ("schedule digest", self.schedule_digest or "(none)"),
            ("mesh", str(self.mesh)),
            ("device", self.device),
            ("coconet", __version__),
            ("collective algorithms", repr(comm.options.algorithms)),
            ("transports", self.transports or "(unknown)"),
            # Every option: each changes the collectives a step runs (the votes, the checks),
            # how it commits, or its numerics (fused kernels contract differently than eager
            # ops: "Replicated" parameters drift apart when ranks differ in it).
            *((f"option {f.name}", repr(getattr(self.options, f.name))) for f in _IDENTITY_OPTIONS),
        )

    def _identity_of(self, comm: Communicator) -> tuple[tuple, int]:
        """(identity, its hash), cached while the communicator's options stay the same."""
        cached = self._identity
        if cached is None or cached[0] is not comm.options:
            identity = self.identity(comm)
            cached = (comm.options, identity, handshake.identity_hash(identity))
            self._identity = cached
        return cached[1], cached[2]

    def collective_reads(self, name: str) -> bool:
        """Whether a collective reads input ``name`` as it is passed (so ``input_buffer`` has
        something to gain: not when the input is cast first, a 16-bit reduction of float32
        gradients, or no collective reads it, gradients averaged before the step)."""
        users = self.program.users()[self.program.input(name).name]
        return any(spec(u.op).has(Prop.COMMUNICATES) for u in users)

    def input_buffer(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A tensor to pass as input ``name`` that lives where the step's collective reads it
        (symmetric memory over shared memory), so that nothing is copied in: write the gradient
        into it (``param.grad`` as a view of it) and pass it at every step. Collective: every
        rank calls it at the same point with its own ``shape``. An ordinary tensor passed
        instead is copied in; where the transport has no shared memory this is an ordinary
        tensor too."""
        comm = self._communicator()
        node = self.program.input(name)
        readers = [u for u in self.program.users()[node.name] if spec(u.op).has(Prop.COMMUNICATES)]
        if not readers:
            raise ConfigError(
                f"input {name!r} of {self.program.name} is not read by a collective: it has "
                "nothing to gain from symmetric memory",
                op=f"{self.program.name} input_buffer",
                hint="ask for the buffer of an input that a reduce_scatter or all_reduce reads "
                "(the gradient)",
            )
        if len(shape) != node.type.rank:
            raise ConfigError(
                f"input {name!r} has rank {node.type.rank}, shape {tuple(shape)} has "
                f"{len(shape)} dims",
                op=f"{self.program.name} input_buffer",
                hint=f"pass this rank's shape of {name!r}, e.g. tuple(grad.shape)",
            )
        return comm.symmetric_tensor(
            tuple(int(s) for s in shape), node.type.dtype.torch, axis=readers[0].attr("axis")
        )

    def host_replica(self, name: str, shape: Sequence[int]) -> HostReplica:
        """One physical copy per host of Replicated input ``name`` (``coconet.runtime.replica``):
        pass ``replica.live()`` as ``name`` at every step (after a commit, the tensor passed
        is re-pointed at the new live buffer: pass it again). The step writes each rank's new
        slice into the spare buffer and the commit flips the two, so the all_gather of the
        update and the commit's copy are gone. Collective: every rank calls it at the same
        point. A ``ConfigError`` unless this step's update of ``name`` is a published one-pass
        gather over shared memory (a schedule like ``fuse_RS_C_AG`` on one host)."""
        comm = self._communicator()
        node = self.program.input(name)
        flips = getattr(self.module, "REPLICA_INPUTS", ())
        if name not in flips:
            raise ConfigError(
                f"input {name!r} of {self.program.name} cannot be a host replica: this step "
                "does not commit it from a one-pass gather over shared memory",
                op=f"{self.program.name} host_replica",
                details=[
                    f"inputs this step could flip: {list(flips) or 'none'}",
                    f"transports: {self.transports}",
                ],
                hint="schedule the program so the update is gathered in one pass "
                "(fuse_RS_C_AG) on ranks of one host, or keep per-rank storage",
            )
        return comm.host_replica(
            tuple(int(s) for s in shape), node.type.dtype.torch, axis=self._gather_axis(name)
        )

    def _gather_axis(self, name: str) -> str | None:
        """The axis of the all_gather whose value updates input ``name``."""
        for u in self.program.updates:
            if u.inputs[0].name == name and u.inputs[1].op is Op.ALL_GATHER:
                return u.inputs[1].attr("axis")
        return None

    def show(self) -> str:
        """The generated module's source (what ``coconet show`` prints)."""
        return self.source

    def __repr__(self) -> str:
        return f"CompiledStep({self.program.name}, {self.mesh}, key={self.key})"

    # -- one step -------------------------------------------------------------------------------

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        """Run one step on this rank. Returns the outputs by name; applies the updates in place
        to the caller's tensors once the step succeeded on every rank."""
        return self.run(inputs)

    def run(self, inputs: dict[str, Any], *, agree: dict[str, str] | None = None,
            commit_if: Callable[[dict[str, torch.Tensor]], bool] | None = None,
            vote_with: Communicator | None = None) -> dict[str, torch.Tensor]:
        """``self(**inputs)``, and the caller's own values ``agree`` (name -> text) compared
        across the ranks in the same agreement as the Replicated scalars, at no extra cost: a
        difference fails every rank with the same ``RuntimeFault`` before anything moves
        (its details name the differing key; nothing is counted, the communicator stays
        usable). ``coconet.optim`` passes which parameters have a gradient this way.

        ``commit_if(outputs)``: whether to commit the updates, asked once every rank finished
        the step (a speculative step: ``coconet.optim`` computes the update unclipped with the
        norm alongside and commits it only where clipping would not change it). False: no
        update is written (the caller's tensors stay as they were, the step still counts as a
        call) and the outputs are returned. With ``commit_vote`` the answer is part of the
        vote, so every rank declines when one does; without it the test must give the same
        answer on every rank by construction (a value all-reduced in the step does).

        ``vote_with``: the communicator whose ranks vote on the commit, when it must reach more
        ranks than the step's own (a data-parallel step of a model split over tp: every rank of
        the dp x tp mesh commits or none, not each dp group on its own); it contains the step's
        ranks, and each of its ranks votes at the same point (its own such step).

        Traced (``coconet.runtime.tracing``) as a span named after the program, holding the
        agreement, the rehearsal (first call), the body, the vote and the commit.

        A step with deferred collectives (``coconet.schedule.defer``) first lands the previous
        call's (``wait_deferred``), and starts its own once it has committed."""
        if self._local and self.calls > 1 and agree is None and commit_if is None:
            outputs = self._replay_local(inputs)
            if outputs is not None:
                return outputs
        if self._deferred:
            self.wait_deferred()
            lands = [name for names in self._deferred.values() for name in names]
            targets = {name: inputs[name] for name in lands if name in inputs}
        if tracing.active():
            with tracing.span(self.program.name, Category.STEP):
                outputs = self._run(inputs, agree, commit_if, vote_with, True)
        else:
            outputs = self._run(inputs, agree, commit_if, vote_with, False)
        if self._deferred:
            self._start_deferred(outputs, targets)
        return outputs

    def _replay_local(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """A call of a step that communicates nothing and updates nothing, like its last call
        (``_rebind``'s inputs, the shapes last agreed on), past its second call: what ``_run``
        does for it, without the phases that have nothing to do. Its call goes into the
        communicator's digest of local steps (``handshake.LocalSteps``: the next round of any
        step compares it), the body runs and the outputs are returned as the commit returns
        them (none of them sharing an input's memory). None: any other call, which ``_run``
        takes (new shapes, a first check of the inputs, a traced call: its spans)."""
        comm = self._comm
        if comm is None or comm.world < 2 or self._skipped_rehearsal or tracing.active():
            return None
        bound = self._rebind(inputs)
        if bound is None or bound[1] != self._exchanged:
            return None
        args, replicated = bound[0], bound[3]
        comm.local_steps.add(self.program.name, self._identity_of(comm)[1], self._ordinal,
                             self.calls + 1, replicated)  # fmt: skip
        self.calls += 1
        comm.progress[self.program.name] = comm.progress.get(self.program.name, 0) + 1
        try:
            outputs, _ = self.module.step(comm, self._geometry, self.kernels, *args)
        except BaseException as exc:
            self._failed(comm, exc)
            raise
        self.last_declined = False
        return self._commit(inputs, outputs, {}, comm)

    @property
    def deferred_in_flight(self) -> bool:
        """Whether the last call's deferred collectives are still to land."""
        return self._in_flight is not None

    def wait_deferred(self) -> None:
        """Land the collectives the last call deferred (``coconet.schedule.defer``) now: wait
        for them and write their values into the inputs they update, as the program says.

        The next call does this first by itself; call it to read those inputs between calls
        (to save them, or at the end of training). Nothing in flight: nothing to do. A wait that
        fails raises (the peers are told, as for a failed step) and writes nothing: the
        collective is dropped, never waited for twice."""
        if self._in_flight is None:
            return
        works, targets = self._in_flight
        self._in_flight = None
        comm = self._communicator()
        try:
            landed = self.module.land(comm, self._geometry, self.kernels, works)
        except BaseException as exc:
            self._failed(comm, exc)
            raise
        with torch.no_grad():
            for name, value in landed.items():
                self._write(targets[name], value, swap=False)

    def _start_deferred(self, outputs: dict[str, Any], targets: dict[str, torch.Tensor]) -> None:
        """Start this call's deferred collectives from their snapshots (the step's outputs under
        the collectives' names, taken out of ``outputs`` here), once it committed on every rank.
        A declined step starts none: its update of the landing inputs is declined too."""
        operands = {name: outputs.pop(name) for name in self._deferred}
        if self.last_declined:
            return
        comm = self._communicator()
        try:
            works = self.module.start_deferred(comm, self._geometry, self.kernels, operands)
        except BaseException as exc:
            self._failed(comm, exc)
            raise
        self._in_flight = (works, targets)

    def _run(self, inputs: dict[str, Any], agree: dict[str, str] | None,
             commit_if: Callable[[dict[str, torch.Tensor]], bool] | None,
             vote_with: Communicator | None, traced: bool) -> dict[str, torch.Tensor]:
        comm = self._communicator()
        try:
            args, shapes, reports, ordinal, h, proposed = tracing.within(
                traced, "agreement", Category.AGREEMENT, self._agree, comm, inputs, agree)
        except RuntimeFault as fault:
            if not isinstance(fault, handshake.CallRefused):
                comm.abort(f"rank {comm.rank} failed before its step: {headline(fault)}")
            raise
        except BaseException as exc:
            # The local checks or the agreement failed here (a peer died, stalled or aborted;
            # a Ctrl-C anywhere before or inside the agreement): the control channel may be
            # half used, and the peers must hear of it at once, not at their timeout.
            comm.abort(f"rank {comm.rank} failed before its step: {headline(exc)}")
            raise
        before = (self._geometry, self._exchanged, self._verdicts.current)
        if reports is not None:
            self._settle(comm, reports, shapes)
        elif proposed is not None:
            # agreed (or to be, in the round the step's all_reduce carries): the verdict every
            # rank proposed, which holds this rank's shapes
            name, every, self._geometry = proposed
            self._verdicts.remember(every, comm.rank, self._geometry, name)
            self._exchanged = shapes
        if self._ordinal is None:
            self._ordinal = ordinal
            _steps_seen(comm)[h] = ordinal + 1
        self.calls += 1
        # (what this rank tells its peers when it leaves the job: Communicator.depart)
        comm.progress[self.program.name] = comm.progress.get(self.program.name, 0) + 1
        try:
            try:
                if self.calls == 1 and self._compiles_kernels(comm):
                    with tracing.span("rehearsal", Category.REHEARSAL):
                        self._rehearse(comm, args)
                elif self.calls == 2 and self._skipped_rehearsal:
                    self._skipped_rehearsal = False
                    with tracing.span("rehearsal", Category.REHEARSAL, "again"):
                        self._rehearse_again(comm, args)
                outputs, updates = tracing.within(traced, "body", Category.BODY, self.module.step,
                                                  comm, self._geometry, self.kernels, *args)
                comm.settle_deferred()  # (a step that never reached its all_reduce: a bug)
            except handshake.Disagreement as disagreement:
                # The agreement that rode with the step's first all_reduce found a difference
                # (or a peer's new shapes): that all_reduce's result was dropped, nothing else
                # moved. The verdict as for an agreement before the step: the same RuntimeFault
                # on every rank (this call not counted, the communicator usable), or the new
                # sizes, and the step runs again with its agreement settled.
                self.calls -= 1
                try:
                    self._settle(comm, disagreement.reports, shapes)
                except handshake.CallRefused:
                    # refused on every rank: the step stays under the verdict it had
                    self._geometry, self._exchanged, self._verdicts.current = before
                    raise
                self.calls += 1
                outputs, updates = tracing.within(traced, "body", Category.BODY, self.module.step,
                                                  comm, self._geometry, self.kernels, *args,
                                                  detail="again, agreed")  # fmt: skip
            finally:
                comm.defer_agreement(None)
                if self._kernels is not None:
                    self._kernels.no_builds = False  # (only a first step skips its rehearsal)
        except BaseException as exc:
            self._failed(comm, exc)
            raise
        if not updates:  # nothing to write: nothing to hold a Ctrl-C for
            outputs, declined = self._vote(comm, outputs, updates, commit_if, vote_with)
            if declined:
                return outputs
            return tracing.within(traced, "commit", Category.COMMIT, self._commit, inputs,
                                  outputs, updates, comm)  # fmt: skip
        # Two-phase across the ranks: from this rank's vote to the end of its commit a Ctrl-C
        # is held (coconet.runtime.interrupts), so that it cannot land between a vote every rank
        # counted and this rank's last write: the step is written on every rank or on none.
        outcome = ["the step was not committed on any rank"]
        with interrupts.hold(lambda: f"coconet: {self.program.name}: {outcome[0]}"):
            outputs, declined = self._vote(comm, outputs, updates, commit_if, vote_with)
            if declined:
                outcome[0] = "the step was declined on every rank: nothing was written"
                return outputs
            # Every rank voted to commit: the step ends wholly after on every rank, and the
            # ranks stay in step (an interrupt held back by the commit is raised after it).
            outcome[0] = "the commit was under way on this rank (every rank voted to commit)"
            outputs = tracing.within(traced, "commit", Category.COMMIT, self._commit, inputs,
                                     outputs, updates, comm)  # fmt: skip
            outcome[0] = ("the step was committed on this rank and on every other before this "
                          "was raised: do not repeat it")
            return outputs

    def _failed(self, comm: Communicator, exc: BaseException) -> None:
        """A step failed on this rank before its commit: tell the peers at once (they may be
        inside a collective this rank will never finish), unless the verdict refused the call
        on every rank (nothing moved, the communicator is still usable)."""
        if isinstance(exc, handshake.CallRefused):
            return
        # KeyboardInterrupt and SystemExit too: they leave the step as half done as any error.
        comm.abort(f"rank {comm.rank} failed in a step: {headline(exc)}")

    def _vote(self, comm: Communicator, outputs: dict[str, torch.Tensor],
              updates: dict[str, Any], commit_if: Callable[[dict[str, torch.Tensor]], bool] | None,
              vote_with: Communicator | None = None) -> tuple[dict[str, torch.Tensor], bool]:
        """``commit_if``'s answer and, with ``commit_vote``, every voter's (``vote_with``'s
        ranks, or the step's): (the outputs, whether the updates are declined). Declined: the
        peers' published slices are let go."""
        voters = vote_with if vote_with is not None else comm
        try:
            declined = commit_if is not None and not commit_if(outputs)
            # one rank votes alone; a step that communicates nothing and updates nothing has
            # nothing to vote on (it only computes this rank's outputs)
            if self.options.commit_vote and voters.world > 1 and not self._local:
                declined = bool(voters.agree_max([int(declined)], "every rank finished the step",
                                                 op="commit vote")[0])  # fmt: skip
                if not declined:
                    # a peer that cast its vote and then gave up waiting for this rank's (its
                    # timeout) did not commit: commit only once every peer counted every vote
                    voters.votes_counted("every rank counted the votes")
        except BaseException as exc:
            self._failed(comm, exc)
            if voters is not comm:
                self._failed(voters, exc)
            raise
        self.last_declined = declined
        if declined:
            # nothing written: the peers' published slices are let go, not copied
            for value in updates.values():
                if isinstance(value, Published):
                    value.release()
        return outputs, declined

    def _settle(self, comm: Communicator, reports: list[handshake.RankReport],
                shapes: dict[str, tuple[int, ...]]) -> None:  # fmt: skip
        """The verdict on every rank's report: the same ``CallRefused`` on every rank (the call
        is not counted on any rank, so the ranks stay in step and the communicator usable; it
        carries every rank's report, for a caller that words the difference itself), or the
        sizes, which become this step's geometry."""
        try:
            sizes = handshake.verdict(reports, self.program, self.mesh, self.input_sources)
        except RuntimeFault as fault:
            raise handshake.CallRefused(fault, reports) from None
        self._geometry = geometry(self.program, self.mesh, comm.rank, sizes)
        self._exchanged = shapes
        self._verdicts.remember_reports(reports, comm.rank, self._geometry)

    def agree_call(self, agree: dict[str, str]) -> list[handshake.RankReport] | None:
        """Take part in this step's per-step agreement without running the step: a caller
        that makes another collective call (``coconet.optim``'s ``state_dict``) in the place of
        a step says which call it makes in ``agree``, the same key a step of it passes to
        ``run(agree=)``. The report is this step's next call with only ``agree`` as its
        Replicated values, so it pairs with a peer's step (the vector and the exchange are the
        step's: they cannot mismatch) and with a peer's ``agree_call``. Returns every rank's
        report when they differ (a peer steps, or makes another call), None when every rank
        made this same call; nothing is counted either way. A peer that dies or aborts is a
        ``RuntimeFault``, and this communicator is then aborted (as ``run``'s agreement)."""
        comm = self._communicator()
        if comm.world == 1:
            return None
        try:
            identity, h = self._identity_of(comm)
            ordinal = _steps_seen(comm).get(h, 0) if self._ordinal is None else self._ordinal
            report = handshake.RankReport(
                comm.rank,
                identity,
                dict(self._exchanged or {}),
                {},
                None,
                call=self.calls + 1,
                ordinal=ordinal,
                replicated=dict(agree),
                verdict=self._verdicts.current,
            )
            return handshake.settle(comm, report, False)
        except BaseException as exc:
            comm.abort(f"rank {comm.rank} failed in an agreement: {headline(exc)}")
            raise

    def _agree(
        self, comm: Communicator, inputs: dict[str, Any], agree: dict[str, str] | None = None
    ):
        """This rank's local checks, then the per-step agreement, or what stands for it after
        the first call (``coconet.runtime.handshake``): put off until the step's first
        all_reduce, which it rides with, or, for a step that moves no data, to the
        communicator's next round. Returns (the generated step's arguments, the input shapes,
        every rank's report or None when there was no exchange, this step's ordinal, the
        identity's hash, and for new shapes the verdict this rank proposed in place of an
        exchange, ``Verdicts.propose``'s (its hash, every rank's key, its geometry), or None)."""
        args, shapes, dtypes, replicated, error = self._bind(inputs, comm)
        if agree and comm.world > 1:
            replicated.update(agree)
        identity, h = self._identity_of(comm)
        first = self._exchanged is None
        changed = self._exchanged != shapes
        if changed and not first and not self.options.check_every_step and error is None:
            # Told to every rank through the handshake's flag: they all fail at once.
            change = _shape_change(self._exchanged, shapes)
            error = (
                f"input shapes changed since the first step ({change}); compiled with "
                "check_every_step=False, the shapes must stay"
            )
        proposed = None
        if changed and not first and error is None:
            # shapes this rank had, or every rank with these: no exchange (handshake.Verdicts)
            proposed = self._verdicts.propose(shapes, dtypes, self.program, self.mesh, comm)
        exchange = changed and proposed is None
        ordinal = _steps_seen(comm).get(h, 0) if self._ordinal is None else self._ordinal
        if (self._local and not changed and error is None and self.calls
                and comm.world > 1):  # fmt: skip
            # A step that moves no data, past its first call (coconet.runtime.handshake): its
            # calls are agreed at the communicator's next round (no report of its own); while
            # its shapes stay it takes no round (a rank whose shapes changed has one, proposed
            # or not, which pairs with its peers').
            comm.local_steps.add(self.program.name, h, ordinal, self.calls + 1, replicated)
            return args, shapes, None, ordinal, h, proposed
        report = handshake.RankReport(
            comm.rank,
            identity,
            shapes,
            dtypes,
            error,
            call=self.calls + 1,
            ordinal=ordinal,
            replicated=replicated,
            verdict=self._verdicts.current if proposed is None else proposed[0],
        )
        if comm.world == 1 or not self.calls:
            # nobody to agree with, or the first call: its geometry comes from the exchange
            reports = handshake.settle(comm, report, exchange, h)
            return args, shapes, reports, ordinal, h, proposed
        if self._local and error is not None:
            # its bad inputs fail this rank alone, at once (the peers, which ran the call, learn
            # at the next round)
            raise handshake.CallRefused(RuntimeFault(
                "bad inputs (checked on this rank; the step communicates nothing, so the "
                "peers are not stopped: they learn at their next agreement)",
                op=f"{self.program.name} step",
                details=[f"rank {comm.rank}: {error}"],
                hint="fix the inputs named above; nothing was computed or updated",
            ))
        if not self._local and self._rides is not None and error is None and not exchange:
            # A call like the last one agreed on rides with the step's first all_reduce (or is
            # settled before any other communication of the step): one round instead of two.
            comm.defer_agreement(handshake.Deferred(report, h, self._rides))
            return args, shapes, None, ordinal, h, proposed
        return args, shapes, handshake.settle(comm, report, exchange, h), ordinal, h, proposed

    def _compiles_kernels(self, comm: Communicator) -> bool:
        return self.options.fused_kernels and comm.world > 1 and len(self.kernels) > 0

    def _rehearse(self, comm: Communicator, args: list) -> None:
        """Compile the fused kernels outside the step's collectives (the first call).

        Building a kernel between two collectives would make the peers wait inside one (12-16 s
        on an empty cache). So every rank rehearses the step with its kernels eager (the data
        moves once more, nothing is committed, a donated input is rehearsed on a copy), then
        builds or loads each kernel for the arguments it had, outside any collective, and the
        ranks agree all are ready (``compile_timeout``) before the real step.

        The rehearsal's outcome is kept (``KernelSet.keep_manifest``): a later process whose
        ranks all find the packages their last run of this step used loads them and skips the
        rehearsal (one words round to agree on that; ``KernelSet.preload``)."""
        kernels = self.kernels
        where = f"{self.module.__name__}|{self._identity_of(comm)[1]}|{comm.rank}/{comm.world}"
        kept = kernels.preload(f"{where}|{self._geometry.digest()}")
        if comm.agree_max([0 if kept else 1], f"{self.program.name}: kernels kept")[0] == 0:
            self._skipped_rehearsal = True
            return
        kernels.no_builds = False  # a peer rehearses: so does this rank, and may build
        self._rehearsal(comm, args)

    def _rehearse_again(self, comm: Communicator, args: list) -> None:
        """The second call of a step that skipped its rehearsal: the ranks vote (one words
        round) on whether any of them met a kernel call no kept package fitted
        (``KernelSet.unkept``: it ran eagerly); if one did, every rank rehearses now, and the
        package is built outside the collectives, instead of that kernel staying eager."""
        kernels = self.kernels
        if comm.agree_max([int(kernels.unkept)],
                          f"{self.program.name}: kernels kept at the first call")[0] == 0:
            return  # fmt: skip
        kernels.unkept = False
        self._rehearsal(comm, args)

    def _rehearsal(self, comm: Communicator, args: list) -> None:
        kernels = self.kernels
        donated = {i for i, n in enumerate(self.program.inputs) if n.name in self.options.donate}
        rehearsal = [a.clone() if i in donated else a for i, a in enumerate(args)]
        with kernels.recording():
            outputs, updates = self.module.step(comm, self._geometry, kernels, *rehearsal)
        for value in (*outputs.values(), *updates.values()):
            if isinstance(value, Published):
                value.release()  # the peers may reuse their slots
        del outputs, updates, rehearsal
        # Compiled while this rank watches its peers: one that dies or aborts meanwhile is
        # reported within the communicator's timeout, not after this rank's compile.
        what = f"{self.program.name}'s fused kernels are compiled"
        comm.control.run_watched(kernels.compile_recorded, what, self.options.compile_timeout)
        comm.agree_ready(what, self.options.compile_timeout)
        kernels.keep_manifest()

    def _communicator(self):
        comm = self._comm
        if comm is None:
            raise ConfigError(
                f"{self.program.name}: no communicator: it was compiled without one (world= "
                "only generates code), so it cannot run a step",
                op=f"{self.program.name} step",
                hint="compile with comm=coconet.runtime.init() (the communicator init returns)",
            )
        if comm.mesh is not self.mesh and comm.mesh != self.mesh:
            raise ConfigError(
                f"{self.program.name} was compiled for {self.mesh}, the communicator has "
                f"{comm.mesh}",
                op=f"{self.program.name} step",
                hint="compile with the communicator's mesh",
            )
        return comm

    # -- inputs: coconet.runtime.binding (InputBinding._bind, _rebind) ------------------------

    # -- commit ---------------------------------------------------------------------------------

    def _commit(
        self,
        given: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        updates: dict[str, torch.Tensor],
        comm: Communicator,
    ) -> dict[str, torch.Tensor]:
        # A result may share memory with an input (a broadcast root's own tensor, a scatter's
        # view): copy it before any input is overwritten, so outputs keep the step's values and
        # updates do not read half-committed inputs. A donated input that is not updated is
        # given away: a result in it (an all_reduce in place) stays there, uncopied.
        given_away = set(self.options.donate) - set(updates)
        held = {
            v.untyped_storage().data_ptr()
            for k, v in given.items()
            if isinstance(v, torch.Tensor) and v.numel() and k not in given_away
        }

        def own(t: torch.Tensor | Published) -> torch.Tensor | Published:
            if isinstance(t, Published):  # in the peers' memory, never in an input
                return t
            return t.clone() if t.numel() and t.untyped_storage().data_ptr() in held else t

        outputs = {k: own(v) for k, v in outputs.items()}
        if not updates:
            return outputs  # nothing to write (a step without updates: a few us less per step)
        updates = {k: own(v) for k, v in updates.items()}
        swap = self.options.commit is CommitMode.SWAP
        # Every rank voted to commit: this rank must end wholly after the step, like the others.
        # Whatever interrupts a write (Ctrl-C arrives between two writes, or inside one, whose
        # copy then either happened or not: writing again is harmless) is held until every
        # update is written.
        held_back: BaseException | None = None
        unwritten: list[str] = []
        with torch.no_grad():
            for name, value in updates.items():
                for attempt in (1, 2):
                    try:
                        self._write(given[name], value, swap)
                        break
                    except BaseException as exc:  # noqa: BLE001 - re-raised after the commit
                        held_back = held_back or exc
                        if attempt == 2:
                            unwritten.append(name)
                            if isinstance(value, Published):
                                value.release()  # the peers must not wait for this rank
        if unwritten:
            written = [k for k in updates if k not in unwritten]
            comm.broken = f"rank {comm.rank} could not commit {unwritten}"
            raise RuntimeFault(
                "the commit failed on this rank after every rank voted to commit: this rank "
                "is half-committed",
                op=f"{self.program.name} commit",
                details=[f"written: {written}", f"not written: {unwritten}", repr(held_back)],
                hint="report this (the checks before the step should have refused these "
                "tensors); restore the state from a checkpoint",
            ) from held_back
        if held_back is not None:
            if isinstance(held_back, Exception):
                # A write failed once and then succeeded: the step is whole on every rank.
                warnings.warn(
                    f"{self.program.name}: a commit write failed once and was repeated "
                    f"({held_back!r}); the step is committed",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                held_back.add_note(
                    f"coconet: {self.program.name}'s step was committed on this rank (and on "
                    "every other) before this was raised: do not repeat it"
                )
                raise held_back
        return outputs

    @staticmethod
    def _write(target: torch.Tensor, value: torch.Tensor | Published, swap: bool) -> None:
        """Write one update into the caller's tensor (under no_grad)."""
        if isinstance(value, Published):
            value.copy_into(target)  # the gather lands in the caller's tensor once
        elif swap and step_inputs.swappable(target, value):
            target.set_(value)  # the new values' storage: no copy
        else:
            target.copy_(value)


# The options every rank must share (all of them: each changes the collectives a step runs, how
# it commits or what it computes; cache_dir is only where files go).
_IDENTITY_OPTIONS = tuple(f for f in fields(CompileOptions) if f.name != "cache_dir")

# Per communicator: how many compiled steps of each identity have run their first call, so
# that two compiled steps of one identity (two parameter groups of one shape) are told apart.
_STEPS: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def _steps_seen(comm: Any) -> dict[int, int]:
    return _STEPS.setdefault(comm, {})


def _shape_change(before: dict | None, now: dict) -> str:
    before = before or {}
    return ", ".join(
        f"{k}: {list(before.get(k, ()))} -> {list(v)}" for k, v in now.items() if before.get(k) != v
    )
