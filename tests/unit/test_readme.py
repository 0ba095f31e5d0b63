"""The README's Python examples run as written (with its sample tensors defined)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def blocks(heading: str) -> str:
    text = README.read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


def test_the_dsl_and_schedule_examples_run_and_agree():
    g0, g1, p0, m0 = (torch.randn(7) for _ in range(4))
    scope = {"g0": g0, "g1": g1, "p0": p0, "m0": m0}
    exec(blocks("The DSL in one example"), scope)  # noqa: S102 - the README's own code
    exec(blocks("Schedules"), scope)  # noqa: S102
    s, program = scope["s"], scope["program"]
    inputs = {"g": [g0, g1], "p": p0, "m": m0, "lr": 0.1, "beta": 0.9}
    want = scope["cc"].simulate(program, inputs, world=2)
    got = scope["cc"].simulate(s.program, inputs, world=2)
    assert torch.equal(want.updated("p"), got.updated("p"))
    assert torch.equal(want.updated("m"), got.updated("m"))
    assert str(s).splitlines()[1:] == [
        "  split(g_sum)",
        "  reorder(computations(g_sum), g_sum)",
        "  as_slice([m])",
        "  fuse([g_sum_rs, mul_1_slice, m_new_slice, mul_2_slice, p_new_slice, p_new])",
    ]
