"""The shell commands the README and the documentation show a user, as the tests run them.

A ```` ```bash ```` block whose lines are each a command (``python ...``, ``coconet ...``) is one
command per line; any other block (background jobs, variables) is one script; each runs as
written by ``bash -e`` in the repository root. A block preceded by ``<!-- not-run: REASON -->``
is not run (installs, the suite itself, two machines), and says why. A table row whose first
cell is a command on an example in backticks (``python examples/...``, ``coconet ...
examples/...``) is one command too. The same command shown twice is run once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The pages whose commands a user is told to run: the README, getting started, the examples
# and every tutorial. (Concept and guide pages show commands too; the ones worth running are
# the same as these, at a size a 2-core machine runs in seconds.)
PAGES = ("README.md", "docs/getting-started.md", "docs/examples.md", "docs/tutorials/*.md")

_FENCE = re.compile(r"(?:<!--\s*not-run:\s*(?P<why>[^>]*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```",
                    re.S)  # fmt: skip
_ROW = re.compile(r"^\|\s*`(?P<cmd>(?:python|coconet) [^`]*examples/[^`]+)`\s*\|", re.M)


@dataclass(frozen=True)
class Command:
    page: str  # where it is shown, relative to the repository root
    script: str  # what runs (bash)
    skip: str | None = None  # why it is not run

    @property
    def id(self) -> str:
        first = self.script.strip().splitlines()[0]
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", first)[:90]


def pages() -> list[Path]:
    out: list[Path] = []
    for pattern in PAGES:
        out += sorted(ROOT.glob(pattern))
    return out


def commands() -> list[Command]:
    """Every command shown on the pages, in order, each once."""
    seen: set[str] = set()
    out: list[Command] = []
    for path in pages():
        text = path.read_text()
        page = str(path.relative_to(ROOT))
        found = [(m.start(), m.group("body"), m.group("why")) for m in _FENCE.finditer(text)]
        found += [(m.start(), m.group("cmd") + "\n", None) for m in _ROW.finditer(text)]
        for _, body, why in sorted(found, key=lambda f: f[0]):
            lines = [ln for ln in body.splitlines()
                     if ln.strip() and not ln.lstrip().startswith("#")]  # fmt: skip
            simple = all(ln.startswith(("python ", "coconet ")) and not ln.rstrip().endswith("&")
                         for ln in lines)  # fmt: skip
            for script in ([ln + "\n" for ln in lines] if simple and why is None else [body]):
                key = " ".join(script.split())
                if key in seen:
                    continue
                seen.add(key)
                out.append(Command(page, script, why))
    return out
