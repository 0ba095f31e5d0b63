"""The tuner's warm-up (``coconet.tune.measure._warm_up``): past the asked-for steps, it goes on
until a step no longer page-faults (a large step's heap settles over a few steps, and timing the
steps it grows in would put a one-time cost in the median), bounded by a step count and the
candidate's budget."""

from __future__ import annotations

import pytest

from coconet.tune import measure


class One:
    world = 1  # _max_over_world: nothing to agree with


class Faulting:
    """A step whose k-th call faults ``pages[k]`` pages (the last value from then on)."""

    def __init__(self, monkeypatch, pages: list[int], seconds: float = 0.0) -> None:
        self.pages, self.calls, self.count = pages, 0, 0
        self.clock = 0.0
        self.seconds = seconds
        monkeypatch.setattr(measure, "_minor_faults", lambda: self.count)
        monkeypatch.setattr(measure.time, "perf_counter", lambda: self.clock)

    def __call__(self) -> None:
        self.count += self.pages[min(self.calls, len(self.pages) - 1)]
        self.calls += 1
        self.clock += self.seconds


@pytest.mark.parametrize(
    ("pages", "warmup", "runs"),
    [
        ([0], 2, 2),  # settled at once: the asked-for steps only
        ([300_000, 65_536, 0], 2, 3),  # the heap grows for two steps, then settles
        ([300_000, 0, 65_536, 0], 2, 2),  # the second step settled: no more looking
        ([65_536], 2, measure._MAX_WARMUP),  # never settles: bounded
        ([65_536, 0], 5, 5),  # settled before the asked-for steps ended
    ],
)
def test_the_warm_up_runs_until_a_step_faults_no_more(monkeypatch, pages, warmup, runs):
    step = Faulting(monkeypatch, pages)
    warmed, _ = measure._warm_up(step, One(), warmup, budget_s=60.0)
    assert warmed == runs == step.calls


def test_the_warm_up_stops_when_the_budget_is_spent(monkeypatch):
    step = Faulting(monkeypatch, [65_536], seconds=10.0)
    warmed, spent = measure._warm_up(step, One(), 2, budget_s=25.0)
    assert (warmed, spent) == (3, 30.0)  # the first check past 25 s ends it
