"""Where coconet keeps what it writes to disk, keyed by what changes the compiled result.

Everything coconet caches depends on the machine that produced it: Inductor's kernels are C++
built with ``-march=native`` for the ATen vector width in force (``ATEN_CPU_CAPABILITY``), the
measured collective algorithms are timings of one machine, and generated modules depend on the
torch that runs them. Nodes that share a home directory but differ in CPU (an AVX-512 and an AVX2
node of one cluster), or one machine run with ``ATEN_CPU_CAPABILITY=default``, must never load
each other's entries. So every cache lives under a directory named by the **build key**::

    <cache_dir>/<build key>/generated/        generated per-rank modules
    <cache_dir>/<build key>/algorithms.json   measured collective algorithm choices
    <cache_dir>/<build key>/inductor/         Inductor's cache (TORCHINDUCTOR_CACHE_DIR), see below
    <cache_dir>/<build key>/kernels/          fused kernels built ahead of time (codegen.aot)

The generated modules are bounded (``prune``): at most ``GENERATED_MAX_FILES`` files and
``GENERATED_MAX_BYTES`` bytes, the least recently used going first (a module is "used" when it is
written or compiled again), so a sweep over many programs does not fill the disk.

with ``<cache_dir>`` from ``CompileOptions.cache_dir`` / ``CommOptions.cache_dir``, else
``$XDG_CACHE_HOME/coconet``, else ``~/.cache/coconet``, and the build key
``torch-<version>-<capability>-<cpu digest>`` (the CPU digest hashes the processor's model name
and feature flags, so ``-march=native`` code is never shared across CPU models).

Inductor's own cache is not keyed by the CPU capability (its FX-graph cache hands vectorized C++
to a process that compiles without vector flags: ``error: 'at::vec' has not been declared``).
Before compiling fused kernels, coconet points ``TORCHINDUCTOR_CACHE_DIR`` at the keyed directory
above. A value the user set explicitly is respected (whoever sets it owns its keying); the value
torch itself writes back (its default under the temp directory) and a value coconet set for
another build key are replaced.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

__all__ = [
    "GENERATED_MAX_BYTES",
    "GENERATED_MAX_FILES",
    "build_key",
    "default_cache_dir",
    "keyed_cache_dir",
    "prune",
    "source_digest",
    "use_inductor_cache",
]

# The bound on ``<build key>/generated``: a generated module is a few to a few hundred KiB, so
# this keeps a few hundred programs (a tuning sweep's worth) and never more than 64 MiB.
GENERATED_MAX_FILES = 256
GENERATED_MAX_BYTES = 64 << 20

_INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
# What coconet last wrote into TORCHINDUCTOR_CACHE_DIR: a child process inherits both, and a value
# equal to this marker is coconet's own (replaced when the child's build key differs).
_MARKER_ENV = "COCONET_SET_TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/coconet``, else ``~/.cache/coconet``: the base of every coconet cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "coconet"


@functools.cache
def _cpu_digest() -> str:
    """A short hash of what ``-march=native`` compiles for: the CPU's model and feature flags."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU part"):
                    ident.append(line.strip())
                elif not line.strip() and len(ident) > 2:
                    break  # the first processor's block is enough
    except OSError:
        pass  # not Linux: machine + processor name is the best evidence there is
    return hashlib.sha256("\n".join(ident).encode()).hexdigest()[:10]


def build_key() -> str:
    """``torch-<version>-<capability>-<cpu digest>``: what a cached artifact must match.

    The capability is the one in force (``torch.backends.cpu.get_cpu_capability()``, which honours
    ``ATEN_CPU_CAPABILITY``), so one machine run with another kernel family gets other caches.
    """
    version = torch.__version__.replace("+", "_")
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"torch-{version}-{capability}-{_cpu_digest()}"


@functools.cache
def source_digest() -> str:
    """A short hash of coconet's own source (every ``.py`` file of the package): part of the key
    of what is compiled from generated code, whose helpers' meaning lives in that source."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def keyed_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir or default_cache_dir()>/<build_key()>``: where this build's caches live."""
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    return base / build_key()


def use_inductor_cache(cache_dir: str | Path | None = None) -> Path:
    """Point Inductor at ``keyed_cache_dir(cache_dir)/inductor`` (unless the user chose one).

    Returns the directory Inductor will use. Called before coconet compiles fused kernels; it
    changes this process's environment (inherited by the ranks it spawns), which is the only
    switch Inductor offers.
    """
    current = os.environ.get(_INDUCTOR_ENV)
    ours = os.environ.get(_MARKER_ENV)
    if current and current != ours and current != _torch_default_inductor_dir():
        return Path(current)  # the user's explicit choice
    target = os.path.abspath(keyed_cache_dir(cache_dir) / "inductor")
    os.environ[_INDUCTOR_ENV] = target
    os.environ[_MARKER_ENV] = target
    return Path(target)


def _torch_default_inductor_dir() -> str:
    """Inductor's default cache directory (``<tmp>/torchinductor_<user>``), which torch writes
    back into TORCHINDUCTOR_CACHE_DIR the first time it compiles anything."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    return os.path.abspath(inductor_default())


def prune(
    directory: str | Path,
    *,
    max_files: int | None = None,
    max_bytes: int | None = None,
    suffix: str = ".py",
) -> list[Path]:
    """Delete the least recently used ``*suffix`` files of ``directory`` until at most
    ``max_files`` files (default ``GENERATED_MAX_FILES``) of at most ``max_bytes`` bytes in all
    (``GENERATED_MAX_BYTES``) remain; the paths deleted.

    Safe with several processes at once (ranks of one job, two jobs): a file that vanished
    meanwhile is skipped, and a module already imported does not need its file. The newest file
    is never deleted, so what a process has just written is there for it to import."""
    max_files = GENERATED_MAX_FILES if max_files is None else max_files
    max_bytes = GENERATED_MAX_BYTES if max_bytes is None else max_bytes
    entries = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.endswith(suffix) and not e.name.startswith("."):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    entries.append((st.st_mtime, st.st_size, Path(e.path)))
    except OSError:
        return []
    entries.sort(reverse=True)  # newest first
    kept_bytes = 0
    removed = []
    for i, (_, size, path) in enumerate(entries):
        kept_bytes += size
        if i == 0 or (i < max_files and kept_bytes <= max_bytes):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass  # gone already, or not ours to delete
    return removed
