"""``coconet show`` of a library schedule on a module without SCHEDULES says which optimizer state
it slices, and takes it with ``--state`` (issue 12, item 7): it no longer silently shows code
that is not what the user's ``fuse_RS_C_AG(program, state=...)`` runs."""

from __future__ import annotations

import textwrap

import pytest

from coconet import cli

MODULE = textwrap.dedent(
    """
    import coconet as cc

    def program():
        N = cc.Dim("N")
        g = cc.Tensor("g", cc.float32, [N], cc.Local)
        p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
        m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
        lr, beta = cc.Scalar("lr"), cc.Scalar("beta")
        g_sum = cc.all_reduce(g, name="g_sum")
        m_new = (beta * m + g_sum).named("m_new")
        p_new = (p - lr * m_new).named("p_new")
        return cc.Program("momentum", [g, p, m, lr, beta],
                          [cc.update(p, p_new), cc.update(m, m_new)])
    """
)


def _show(tmp_path, capsys, *extra: str) -> tuple[str, str]:
    path = tmp_path / "momentum.py"
    path.write_text(MODULE)
    args = ["show", f"{path}:program", "--schedule", "fuse_RS_C_AG", "--cache-dir", str(tmp_path)]
    assert cli.main([*args, *extra]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_show_says_a_library_schedule_slices_no_state_unless_told(tmp_path, capsys):
    code, note = _show(tmp_path, capsys)
    assert "applied with no optimizer state stored sliced (state=())" in note
    assert "pass --state" in note
    assert "m_new = comm.wait(" in code  # m is gathered back whole: not what state=("m",) runs
    code, note = _show(tmp_path, capsys, "--state", "m")
    assert note == ""
    assert "m_new = comm.wait(" not in code and "'m': m_new_slice" in code


def test_state_without_a_schedule_that_takes_it_is_refused(tmp_path, capsys):
    path = tmp_path / "momentum.py"
    path.write_text(MODULE)
    with pytest.raises(SystemExit, match="--state is for coconet.schedule's RS_C_AG"):
        cli.main(["show", f"{path}:program", "--schedule", "AR_C", "--state", "m"])
    with pytest.raises(SystemExit, match="--state needs --schedule"):
        cli.main(["show", f"{path}:program", "--state", "m"])
