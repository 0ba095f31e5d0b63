import subprocess
import sys

import coconet


def test_version_and_help():
    out = subprocess.run(
        [sys.executable, "-m", "coconet.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == f"coconet {coconet.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "coconet.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: coconet" in out.stdout
