"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

- The committed benchmark results (``benchmarks/results/*``: tables, JSON, plots) are published
  with the site under ``benchmarks/results/``, so the benchmark pages show the plots and link
  the files the numbers come from, without copies under ``docs/``.
- ``<!-- coconet-help: COMMAND -->`` in a page becomes ``coconet COMMAND --help`` as the
  installed command prints it (``<!-- coconet-help: -->`` for ``coconet --help``; ``trace
  merge`` for an action of a command), so the
  command reference cannot drift from the command.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_HELP = re.compile(r"<!-- coconet-help: ?([a-z ]*?) ?-->")


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in {".png", ".txt", ".json"}:
            files.append(File.generated(config, f"benchmarks/results/{path.name}",
                                        abs_src_path=str(path)))  # fmt: skip
    return files


def _help(command: str) -> str:
    from coconet.cli import _parser

    parser = _parser()
    for word in command.split():  # (a command's action too: "trace merge")
        parser = next(a for a in parser._subparsers._group_actions
                      if hasattr(a, "choices"))._name_parser_map[word]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        os.environ["COLUMNS"] = "100"
        parser.print_help()
    return "```text\n" + out.getvalue().rstrip() + "\n```"


def on_page_markdown(markdown, page, config, files):
    return _HELP.sub(lambda m: _help(m.group(1)), markdown)
