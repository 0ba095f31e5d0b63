"""The calibration procedure on a fake transport with known costs recovers them.

A fake communicator (no processes) charges every collective ``alpha + beta * bytes`` on a fake
clock that ``coconet.tune.calibrate`` reads; the calibrated model must recover each (transport,
op, algorithm)'s alpha and beta, key them as the cost model looks them up, and predict those
costs at sizes it never measured.
"""

from __future__ import annotations

import pytest
import torch

from coconet.ir.ops import Op
from coconet.options import Algorithm, TransportKind
from coconet.tune import calibrate as cal

SHM, TD = TransportKind.SHARED_MEMORY, TransportKind.TORCH_DISTRIBUTED
# (alpha seconds, beta seconds per byte) of each fake collective
COSTS = {
    (SHM, None): (40e-6, 1 / 6e9),
    (SHM, "in place"): (30e-6, 1 / 9e9),
    (TD, Algorithm.NATIVE): (900e-6, 1 / 1.1e9),
    (TD, Algorithm.ALL_TO_ALL): (300e-6, 1 / 1.6e9),
}
CONTROL = {SHM: 50e-6, TD: 400e-6}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-9  # local work (the memory probes) takes next to nothing here
        return self.now


class FakeTorch:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def algorithms(self, op: Op):
        return (Algorithm.NATIVE, Algorithm.ALL_TO_ALL)

    def run_for_measurement(self, op, algorithm, group, numel, device) -> None:
        alpha, beta = COSTS[(TD, algorithm)]
        self.clock.now += alpha + beta * numel * 4


class FakeComm:
    world, rank, backend = 2, 0, "gloo"
    device = torch.device("cpu")

    def __init__(self, transport: TransportKind, clock: Clock) -> None:
        self.transport, self.clock = transport, clock
        self.torch = FakeTorch(clock)

    def barrier(self, label: str = "") -> None:
        pass

    def aligned_start(self, label: str) -> None:
        pass

    def transport_of(self, axis) -> TransportKind:
        return self.transport

    def group(self, axis):
        return None

    def symmetric_tensor(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def start(self, op, x, *, label, axis, **args):
        nbytes = x.numel() * 4 * (self.world if op is Op.ALL_GATHER else 1)
        kind = "in place" if args.get("donate") else None
        return COSTS[(SHM, kind)], nbytes

    def wait(self, work) -> None:
        (alpha, beta), nbytes = work
        self.clock.now += alpha + beta * nbytes

    def agree_max(self, values, label):
        self.clock.now += CONTROL[self.transport]
        return list(values)

    def max_over_world(self, values, label):
        return list(values)


STEPS_ON: list[TransportKind] = []  # the transports the fake tiny step ran on


def _fake_step(comm) -> float:
    """The tiny step: three of its transport's rounds and 100 us of Python."""
    STEPS_ON.append(comm.transport)
    return 3 * CONTROL[comm.transport] + 1e-4


@pytest.fixture
def model(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cal, "time", clock)  # calibrate reads time.perf_counter()
    monkeypatch.setattr(cal, "MEMORY_ELEMENTS", (1024, 4096))
    monkeypatch.setattr(cal, "_step_seconds", _fake_step)
    comms = {t: FakeComm(t, clock) for t in (SHM, TD)}
    return cal.calibrate(comms)


def test_the_calibrated_curves_recover_the_fake_alpha_and_beta(model):
    for op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER):
        for (transport, kind), (alpha, beta) in COSTS.items():
            if kind == "in place" and op is not Op.ALL_REDUCE:
                continue
            key = (transport, op, kind if isinstance(kind, Algorithm) else None, kind == "in place")
            curve = model.collectives[key]
            assert curve.alpha == pytest.approx(alpha, rel=1e-3), key
            assert curve.beta == pytest.approx(beta, rel=1e-3), key


def test_the_model_predicts_unmeasured_sizes_and_picks_the_faster_algorithm(model):
    nbytes = 3 * 2**20  # between the calibrated sizes
    seconds, algorithm = model.collective(Op.ALL_REDUCE, TD, nbytes, 2)
    alpha, beta = COSTS[(TD, Algorithm.ALL_TO_ALL)]
    assert algorithm is Algorithm.ALL_TO_ALL
    assert seconds == pytest.approx(alpha + beta * nbytes, rel=1e-6)
    big = 256 * 2**20  # past the largest calibrated size: the fitted per-byte cost
    seconds, _ = model.collective(Op.ALL_GATHER, SHM, big, 2)
    alpha, beta = COSTS[(SHM, None)]
    assert seconds == pytest.approx(alpha + beta * big, rel=1e-3)
    in_place, _ = model.collective(Op.ALL_REDUCE, SHM, big, 2, in_place=True)
    assert in_place < seconds


def test_control_and_the_step_calls_fixed_cost(model):
    for t in (SHM, TD):
        assert model.control[t] == pytest.approx(CONTROL[t], rel=1e-3)
        assert model.step_overhead[t] == pytest.approx(1e-4 - model.op_overhead, abs=1e-6)


def test_the_fixed_cost_is_measured_once_where_rounds_are_cheapest(monkeypatch):
    """Shared memory when there is one (a gloo round's wake-up noise must not become every
    step's fixed cost); torch.distributed alone otherwise."""
    clock = Clock()
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal, "MEMORY_ELEMENTS", (1024, 4096))
    monkeypatch.setattr(cal, "_step_seconds", _fake_step)
    for transports, measured_on in (((TD, SHM), [SHM]), ((TD,), [TD])):
        STEPS_ON.clear()
        got = cal.calibrate({t: FakeComm(t, clock) for t in transports})
        assert STEPS_ON == measured_on
        for t in transports:
            assert got.step_overhead[t] == pytest.approx(1e-4 - got.op_overhead, abs=1e-6)


# -- extending the calibration to the sizes a tune needs ----------------------------------------

KNEE = 1 << 20  # past this many bytes the fake torch.distributed collectives get 3x slower


class SlowPastTheKnee(FakeTorch):
    def run_for_measurement(self, op, algorithm, group, numel, device) -> None:
        alpha, beta = COSTS[(TD, algorithm)]
        nbytes = numel * 4
        self.clock.now += alpha + beta * min(nbytes, KNEE) + 3 * beta * max(0, nbytes - KNEE)


@pytest.fixture
def small(monkeypatch):
    """A model calibrated up to KNEE only, and the communicators that made it."""
    clock = Clock()
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal, "MEMORY_ELEMENTS", (1024, 4096))
    monkeypatch.setattr(cal, "COLLECTIVE_BYTES", (64 << 10, 256 << 10, KNEE))
    monkeypatch.setattr(cal, "_step_seconds", _fake_step)
    # the memory probes at the extension's sizes would allocate for real: a known line instead
    monkeypatch.setattr(
        cal, "_memory", lambda comm, elements=(1024, 4096): [(16.0 * n, 1e-6 * n) for n in elements]
    )
    monkeypatch.setattr(
        cal, "_eager", lambda comm, elements=(1024, 4096): [(20.0 * n, 2e-6 * n) for n in elements]
    )
    comms = {t: FakeComm(t, clock) for t in (SHM, TD)}
    for c in comms.values():
        c.torch = SlowPastTheKnee(clock)
    return cal.calibrate(comms), comms


def test_extension_sizes_leave_nothing_more_than_2x_past_a_measured_size():
    assert cal.extension_sizes(64 << 20, 64 << 20) == []
    assert cal.extension_sizes(64 << 20, 128 << 20) == []  # 2x: close enough
    assert cal.extension_sizes(64 << 20, 200 << 20) == [200 << 20]
    assert cal.extension_sizes(64 << 20, 1 << 30) == [256 << 20, 1 << 30]
    assert cal.extension_sizes(float("inf"), 1 << 40) == []  # a cluster's formulas
    for measured, needed in ((1 << 16, 3 << 27), (5 << 20, 7 << 30)):
        sizes = cal.extension_sizes(measured, needed)
        assert sizes[-1] == needed and sizes == sorted(sizes)
        for a, b in zip([measured, *sizes], sizes, strict=False):
            assert b <= 4 * a


def test_extend_measures_past_the_calibrated_range_and_predicts_what_it_measured(small):
    model, comms = small
    assert cal.calibrated_bytes(model) == KNEE
    needed = 16 * KNEE
    alpha, beta = COSTS[(TD, Algorithm.NATIVE)]
    truth = alpha + beta * KNEE + 3 * beta * (needed - KNEE)
    guessed, _ = model.collective(Op.ALL_GATHER, TD, needed, 2, Algorithm.NATIVE)
    assert guessed < 0.5 * truth  # the line fitted below the knee misses it
    bigger = cal.extend(model, comms, needed)
    assert cal.calibrated_bytes(bigger) == needed
    for key, curve in bigger.collectives.items():
        assert [b for b, _ in curve.points] == [64 << 10, 256 << 10, KNEE, 4 * KNEE, needed], key
        assert curve.points[:3] == model.collectives[key].points[:3]  # the old points are kept
    got, _ = bigger.collective(Op.ALL_GATHER, TD, needed, 2, Algorithm.NATIVE)
    assert got == pytest.approx(truth, rel=1e-6)
    # shared memory stays linear: the extension agrees with the old line there
    shm, _ = bigger.collective(Op.ALL_REDUCE, SHM, needed, 2)
    a, b = COSTS[(SHM, None)]
    assert shm == pytest.approx(a + b * needed, rel=1e-3)
    assert [p[0] for p in bigger.memory.points][-1] == 16.0 * (needed // 4)
    assert cal.extend(bigger, comms, needed) is bigger  # nothing left to measure


# -- the memory probes run with their operands out of cache -------------------------------------


def test_the_eviction_before_each_repetition_is_not_timed(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cal, "time", clock)
    calls = {"run": 0, "before": 0}

    def run() -> None:
        calls["run"] += 1
        clock.now += 1e-3

    def before() -> None:
        calls["before"] += 1
        clock.now += 1.0  # far longer than the probe: it must not show

    seconds = cal._timed(FakeComm(SHM, clock), run, 5, before)
    assert calls == {"run": 6, "before": 5}  # one untimed run, then each repetition after it
    assert seconds == pytest.approx(1e-3, rel=1e-3)


def test_the_evictor_passes_over_more_than_the_last_level_cache():
    llc = cal.last_level_cache_bytes()
    assert llc >= 1 << 20
    evict = cal._evictor(FakeComm(SHM, Clock()))
    junk = evict.__closure__[0].cell_contents
    assert junk.numel() * junk.element_size() >= 2 * llc
    evict()
    assert bool((junk == 1.0).all())


# -- a probe that hit a slow spell is timed again -----------------------------------------------

BIG = 64 << 20  # the largest calibrated size


class SlowSpell(FakeTorch):
    """The native all_gather at BIG bytes runs 1 s slower for its first ``spell`` calls (the
    whole first probe: one untimed run and its repetitions), then at its true cost."""

    def __init__(self, clock: Clock, spell: int) -> None:
        super().__init__(clock)
        self.spell = spell

    def run_for_measurement(self, op, algorithm, group, numel, device) -> None:
        super().run_for_measurement(op, algorithm, group, numel, device)
        if (op is Op.ALL_GATHER and algorithm is Algorithm.NATIVE and numel * 4 == BIG
                and self.spell > 0):
            self.spell -= 1
            self.clock.now += 1.0


def _calibrated_with(monkeypatch, spell: int):
    clock = Clock()
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal, "MEMORY_ELEMENTS", (1024, 4096))
    monkeypatch.setattr(cal, "_step_seconds", _fake_step)
    comms = {t: FakeComm(t, clock) for t in (SHM, TD)}
    comms[TD].torch = SlowSpell(clock, spell)
    return cal.calibrate(comms), comms[TD].torch


def test_a_slow_spell_during_one_probe_does_not_become_the_curve(monkeypatch):
    reps = cal._reps(BIG)
    model, fake = _calibrated_with(monkeypatch, spell=1 + reps)
    assert fake.spell == 0  # the whole first probe was slow ...
    alpha, beta = COSTS[(TD, Algorithm.NATIVE)]
    curve = model.collectives[(TD, Op.ALL_GATHER, Algorithm.NATIVE, False)]
    # ... and the point was timed again at its true cost
    assert curve.points[-1][1] == pytest.approx(alpha + beta * BIG, rel=1e-3)
    assert curve.beta == pytest.approx(beta, rel=1e-3)


def test_a_point_that_stays_slow_when_timed_again_is_kept(monkeypatch):
    model, _ = _calibrated_with(monkeypatch, spell=10**6)  # slow however often it is timed
    curve = model.collectives[(TD, Op.ALL_GATHER, Algorithm.NATIVE, False)]
    alpha, beta = COSTS[(TD, Algorithm.NATIVE)]
    assert curve.points[-1][1] == pytest.approx(alpha + beta * BIG + 1.0, rel=1e-3)
    # the other curves were not timed again (nothing jumped there)
    other = model.collectives[(TD, Op.ALL_REDUCE, Algorithm.NATIVE, False)]
    assert other.points[-1][1] == pytest.approx(alpha + beta * BIG, rel=1e-3)
