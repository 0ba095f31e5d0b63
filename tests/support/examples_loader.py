"""The examples (``examples/*.py``) as modules, for the tests in tests/unit and tests/dist.

The examples are scripts, not a package: each is loaded from its file on first use, as module
``coconet_example_<name>``, and that one module is shared by every test of the process (and by
the ranks that ``coconet.runtime.spawn`` starts, which load it again in their own process).
pytest finds it (package ``support``) through ``pythonpath`` in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as a module, loaded once per process."""
    key = f"coconet_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
