"""What a newcomer meets at the ``coconet`` command (issue 50): a message, never a traceback; help
that says what each command does; progress that is plain lines in a log.

In-process (``coconet.cli.main``) and without ranks: cheap.
"""

from __future__ import annotations

import io

import pytest

from coconet import cli
from coconet.progress import phase
from coconet.tune import tuner


def _main(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse and the usage errors
        code = e.code if isinstance(e.code, int) else (print(e.code) or 1)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_bare_coconet_is_an_error_with_the_commands(capsys):
    code, out = _main(capsys)
    assert code == 2
    assert "give a command" in out and "tune" in out and "Traceback" not in out


def test_a_missing_file_is_a_message(capsys):
    code, out = _main(capsys, "show", "missing.py:program")
    assert code == 1
    assert "no such file: missing.py" in out and "Traceback" not in out


def test_run_refuses_a_missing_script_before_starting_anything(capsys):
    code, out = _main(capsys, "run", "--nproc", "2", "nothere.py")
    assert code == 1
    assert "no such file: nothere.py (nothing was started)" in out


def test_run_refuses_a_missing_module(capsys):
    code, out = _main(capsys, "run", "-m", "no_such_module_here")
    assert code == 1 and "no module named 'no_such_module_here'" in out


def test_an_unknown_schedule_lists_schedules_not_primitives(capsys):
    code, out = _main(capsys, "show", "examples/adam.py:program", "--schedule", "BOGUS")
    assert code == 1
    assert "fuse_RS_C_AG" in out and "ol_MM_fuse_RS_C_AG" in out
    for internal in ("Handle", "Primitive", "Step", "apply_split", "check_fuse"):
        assert internal not in out, internal


def test_a_module_that_fails_to_load_is_one_line_at_its_line(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import coconet\nx = 1 / 0\n")
    code, out = _main(capsys, "print", f"{bad}:program")
    assert code == 1
    assert f"ZeroDivisionError: division by zero at {bad}:2" in out and "Traceback" not in out


def test_a_program_that_does_not_build_is_its_coconet_error(capsys, tmp_path):
    bad = tmp_path / "empty.py"
    bad.write_text("import coconet as cc\nprogram = cc.Program('p', [], [])\n")
    code, out = _main(capsys, "print", f"{bad}:program")
    assert code == 1
    assert "DSLError" in out and "has no outputs" in out and f"{bad}:2" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("command", ["print", "show", "run", "calibrate", "tune", "plan"])
def test_every_command_says_what_it_does(capsys, command):
    code, out = _main(capsys, command, "--help")
    assert code == 0
    description = out.split("\n\n")[1]  # after the usage: the description
    assert len(description.split()) >= 12, out


def test_the_help_names_the_cache_folder_in_use(capsys):
    from coconet.cache import keyed_cache_dir

    _, out = _main(capsys, "calibrate", "--help")
    assert str(keyed_cache_dir(None)) in " ".join(out.split()).replace("- ", "-")


def test_tune_says_what_retune_and_recalibrate_do(capsys):
    _, out = _main(capsys, "tune", "--help")
    flat = " ".join(out.split())
    assert "--recalibrate" in flat and "calibrate the cost model again" in flat
    assert "measure the candidates again" in flat


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_a_long_phase_keeps_talking_plain_lines_in_a_log(tty):
    stream = _Stream(tty)
    with phase("compiling", every=0.05, file=stream):
        import time

        time.sleep(0.3)
    text = stream.getvalue()
    assert text.startswith("compiling...\n")
    assert "... compiling:" in text and "done in" in text
    assert ("\r" in text) is tty  # \r frames on a terminal only


def test_a_cached_calibration_says_when_and_under_what_load():
    quiet = {"at": 0.0, "load1": 0.2, "cpus": 2}
    busy = {"at": 0.0, "load1": 2.5, "cpus": 2}
    assert "--recalibrate" in tuner._cached_calibration(quiet)
    assert "busy" not in tuner._cached_calibration(quiet)
    said = tuner._cached_calibration(busy)
    assert "busy machine" in said and "load average 2.5 on 2 cores" in said
    assert "not recorded" in tuner._cached_calibration(None)
    assert tuner._busy(busy) and not tuner._busy(quiet) and not tuner._busy(None)


def test_train_gpt_refuses_plot_without_matplotlib_before_running(monkeypatch, capsys):
    """``--plot`` without matplotlib: exit 2 at once, not after the whole run with status 0."""
    from support.examples_loader import load_example

    train_gpt = load_example("train_gpt")
    monkeypatch.setattr(train_gpt, "has_matplotlib", lambda: False)
    monkeypatch.setattr(train_gpt, "model", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as e:
        train_gpt.main(["--plot", "losses.png"])
    assert e.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err
