"""Check that the API reference covers every public name: ``python tools/check_api_reference.py
SITE`` after ``mkdocs build -d SITE``.

The built site's object inventory (``objects.inv``, written by mkdocstrings) must hold every name
of the ``__all__`` of the modules below, under the name users write (``coconet.nn.KVCache``) or
where it is defined (``coconet.nn.parallelize.parallelize``, whose module has its name). Exits 1
naming each missing one (document it: a docstring, and the module's page under docs/reference).
"""

from __future__ import annotations

import importlib
import sys
import zlib
from pathlib import Path

MODULES = ("coconet", "coconet.optim", "coconet.fsdp", "coconet.nn", "coconet.pipeline",
           "coconet.runtime", "coconet.schedule", "coconet.errors", "coconet.options",
           "coconet.tune", "coconet.testing", "coconet.trace", "coconet.tracing",
           "coconet.runtime.flight")  # fmt: skip


def inventory(site: Path) -> set[str]:
    """The object names of a built site's ``objects.inv`` (Sphinx's format, version 2)."""
    raw = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):  # four lines of header, then the zlib stream
        header_end = raw.index(b"\n", header_end) + 1
    body = zlib.decompress(raw[header_end:]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def missing(site: Path, modules: tuple[str, ...] = MODULES) -> list[str]:
    names = inventory(site)
    out = []
    for mod in modules:
        module = importlib.import_module(mod)
        for name in module.__all__:
            obj = getattr(module, name)
            where = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', name)}"
            if f"{mod}.{name}" not in names and where not in names:
                out.append(f"{mod}.{name}")
    return out


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "site")
    if not (site / "objects.inv").is_file():
        print(f"no {site / 'objects.inv'}: build the site first (mkdocs build --site-dir {site})")
        return 2
    gone = missing(site)
    for name in gone:
        print(f"missing from the API reference: {name}")
    if not gone:
        print(f"the API reference covers every public name of {', '.join(MODULES)}")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
