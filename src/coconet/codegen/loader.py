"""Loading generated source as a Python module, kept on disk so tracebacks show real lines.

The source goes to ``<directory>/<program>_<key>.py`` (written atomically: several ranks of one job
may compile the same program at once) and is imported from there; a traceback through generated
code then shows the generated line and its DSL comment. Without a directory the source is compiled
from memory and registered with ``linecache`` for the same effect.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys
import tempfile
import types
from pathlib import Path

__all__ = ["load_module"]


def load_module(source: str, name: str, directory: Path | None) -> types.ModuleType:
    """Import ``source`` as module ``coconet_generated_<name>``."""
    module_name = f"coconet_generated_{name}"
    if directory is not None:
        try:
            path = _write(Path(directory), f"{name}.py", source)
        except OSError:
            path = None  # a read-only cache dir must not stop compilation
        if path is not None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            return module
    filename = f"<coconet generated {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    return module


def _write(directory: Path, filename: str, source: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    if path.exists() and path.read_text() == source:
        try:
            os.utime(path)  # just used: the cache evicts the least recently used (coconet.cache)
        except OSError:
            pass  # a read-only cache is never pruned either
        return path
    # A name no other writer can take (mkstemp): a pid is not one, since the ranks of two hosts
    # in their own PID namespaces can share it and the cache directory, and two writers of one
    # temporary file leave a truncated module behind (seen: a step module without its ``step``).
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{filename}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
