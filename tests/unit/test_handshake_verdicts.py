"""``handshake.Verdicts``: shapes seen before, or alike on every rank, skip the exchange, and a
verdict that stands without one is always the one the exchange would have reached.

The ranks are simulated in one process: each keeps its own ``Verdicts`` and follows the step's
rule (``CompiledStep._agree``): shapes unchanged, propose the current verdict; changed, propose
a kept or a worked-out one, or ask for the exchange. The words are equal on every rank only
where every rank proposed the same verdict; then each adopts it, else the exchange's reports
decide (``verdict``), as on the real transports."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.codegen.geometry import geometry
from coconet.errors import RuntimeFault
from coconet.runtime import handshake

WORLD = 2
MESH = cc.Mesh(world=WORLD)


def program() -> cc.Program:
    """x: the same on every rank (an activation); w: each rank's tensor_split part."""
    n, m = cc.Dim("N"), cc.Dim("M")
    x = cc.Tensor("x", cc.float32, [n], cc.Local)
    w = cc.Tensor("w", cc.float32, [m], cc.Sliced(0))
    return cc.Program("p", [x, w], {"y": cc.all_reduce((x * 2.0).named("t"), name="y")})


@dataclass
class FakeComm:
    rank: int
    world: int = WORLD
    alike_verdicts: dict = field(default_factory=dict)


def _report(rank: int, shapes: dict, verdict: int) -> handshake.RankReport:
    return handshake.RankReport(rank, (("p", "1"),), shapes, {k: "float32" for k in shapes},
                                verdict=verdict)  # fmt: skip


def _call(prog, kept: list[handshake.Verdicts], last: list, shapes: list[dict]) -> tuple:
    """One call on every rank: (exchanged?, the sizes each rank runs with, or the refusal)."""
    proposals = []
    for r in range(WORLD):
        if last[r] == shapes[r]:
            proposals.append((kept[r].current, None))
            continue
        p = kept[r].propose(shapes[r], {k: "float32" for k in shapes[r]}, prog, MESH,
                            FakeComm(r)) if last[r] is not None else None  # fmt: skip
        proposals.append((p[0], p) if p is not None else (0, "exchange"))
    words = {w for w, _ in proposals}
    if len(words) == 1 and all(p != "exchange" for _, p in proposals) and 0 not in words:
        got = []
        for r, (_, p) in enumerate(proposals):
            if p is not None:
                _, every, geo = p
                kept[r].remember(every, r, geo, p[0])
            last[r] = shapes[r]
            got.append(kept[r]._values[kept[r].current][2].sizes)
        return False, got
    reports = [_report(r, shapes[r], 0) for r in range(WORLD)]
    try:
        sizes = handshake.verdict(reports, prog, MESH)
    except RuntimeFault:
        return True, None  # refused on every rank: nothing kept, nothing changed
    got = []
    for r in range(WORLD):
        geo = geometry(prog, MESH, r, sizes)
        kept[r].remember_reports(reports, r, geo)
        last[r] = shapes[r]
        got.append(geo.sizes)
    return True, got


def _parts(total: int) -> list[int]:
    """torch.tensor_split's part sizes of ``total`` over the ranks."""
    q, extra = divmod(total, WORLD)
    return [q + (r < extra) for r in range(WORLD)]


calls = st.lists(
    st.tuples(st.integers(1, 6), st.integers(2, 9), st.booleans(), st.integers(0, 2)),
    min_size=1, max_size=30,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(calls)
def test_a_verdict_without_an_exchange_is_the_exchanges(seq):
    """Per call: N, M, whether every rank passes the same N (else rank 1 passes N + bump + 1),
    and a bump. Whatever the sequence, a call agreed without an exchange runs every rank with
    the sizes an exchange of the same reports gives, and a call whose shapes do not fit is
    refused (never run with a kept verdict)."""
    prog = program()
    kept = [handshake.Verdicts() for _ in range(WORLD)]
    last: list = [None] * WORLD
    was_uniform = False  # the last agreed call's shapes were the same on every rank
    for k, (n, m, alike, bump) in enumerate(seq):
        xs = [n, n if alike else n + bump + 1]
        shapes = [{"x": (xs[r],), "w": (_parts(m)[r],)} for r in range(WORLD)]
        exchanged, got = _call(prog, kept, last, shapes)
        reports = [_report(r, shapes[r], 0) for r in range(WORLD)]
        try:
            want = handshake.verdict(reports, prog, MESH)
        except RuntimeFault:
            assert got is None, (shapes, got)
            continue
        assert got == [want] * WORLD, (shapes, got, want)
        uniform = alike and m % WORLD == 0
        if uniform and was_uniform:
            # the same shapes on every rank, as at the call before: no exchange (a rank whose
            # shapes did not change keeps proposing the verdict it runs under)
            assert not exchanged, (k, shapes)
        was_uniform = uniform


def test_shapes_seen_before_and_new_shapes_alike_skip_the_exchange():
    prog = program()
    kept = [handshake.Verdicts() for _ in range(WORLD)]
    last: list = [None] * WORLD

    def run(n: int, m: int) -> bool:
        shapes = [{"x": (n,), "w": (_parts(m)[r],)} for r in range(WORLD)]
        return _call(prog, kept, last, shapes)[0]

    assert run(8, 6)  # the first call: exchanged
    assert not run(9, 6)  # new, alike on every rank: worked out by each
    assert not run(8, 6)  # seen
    # w split 3 + 2: the ranks' shapes differ, so the verdict each works out (every rank with
    # its own shapes) is not every rank's: an exchange for each new one; then kept
    assert run(8, 5)
    assert run(9, 5)
    assert not run(8, 5)
    assert not run(9, 5)
    # a switch between the two kinds costs an exchange (which kind a rank proposes follows
    # the verdict it runs under); staying with one does not
    assert run(9, 6)
    assert not run(10, 6)
