"""The paper's schedules of Adam, side by side: what they print, cost and compute.

For each of AR_C, RS_C_AG and fuse_RS_C_AG this prints the schedule (a few primitives), the bytes
each rank keeps and sends per step, and the largest difference from the unscheduled program over
three simulated steps on 4 virtual ranks with a size that does not divide by 4. Exits non-zero if
a schedule changes any result.

Run: ``python examples/schedules_demo.py`` (add ``--program`` to print the transformed programs).
"""

from __future__ import annotations

import pathlib
import sys

import torch

import coconet as cc
from coconet.accounting import account
from coconet.schedule import AR_C, RS_C_AG, fuse_RS_C_AG
from coconet.sim.exactness import reassociations

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import adam  # noqa: E402 - the example next to this file
from _harness import simulate_steps  # noqa: E402

WORLD = 4
SIZE = 1001  # not divisible by 4: the slices differ by one element


def run(program: cc.Program, steps: int = 3) -> dict[str, torch.Tensor]:
    """Adam's parameters and moments after ``steps`` simulated steps of ``program`` from step 1."""
    state = simulate_steps(program, adam.make_inputs(WORLD, SIZE, seed=1), WORLD, steps)
    return {name: state[name] for name in ("p", "m", "v")}


def main() -> int:
    program = adam.program()
    show_programs = "--program" in sys.argv
    print(program if show_programs else f"program {program.name}: {len(program.nodes)} values")
    want = run(program)
    ok = True
    for make in (AR_C, lambda p: RS_C_AG(p, ("m", "v")), lambda p: fuse_RS_C_AG(p, ("m", "v"))):
        sched = make(program)
        print()
        print(sched)
        if show_programs:
            print(sched.program)
        cost = account(sched.program, WORLD, {"N": SIZE})
        got = run(sched.program)
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        # Bitwise equal unless the schedule re-associates a sum (coconet.sim.exactness): Adam's
        # schedules only move data and run the same elementwise maths on slices.
        reasons = reassociations(program, sched.program)
        scale = max(w.abs().max().item() for w in want.values())
        same = diff == 0.0 if not reasons else diff <= 1e-5 * scale
        ok &= same
        verdict = ("identical" if diff == 0.0 else "within rounding") if same else "MISMATCH"
        print(
            f"  per rank: keeps {cost.max_persistent_bytes} B of parameters and state, sends "
            f"{cost.max_sent_bytes} B per step; max difference from the program over 3 steps: "
            f"{diff:.1e} ({verdict})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
