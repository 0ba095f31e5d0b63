"""The suite's own settings, for every tier and every process it starts (they inherit them).

Fused kernels run under torch.compile here, not from packages built ahead of time
(``COCONET_KERNEL_PACKAGES=0``; ``coconet.codegen.aot``): the suite compiles the kernels of
hundreds of programs and shapes once each, on an empty cache in CI, where a package costs ~10 s
per kernel and shape and torch.compile's recompiles a fraction of that (measured: the optimizer
files 182 s with torch.compile, 252 s with packages). The packages are the default a user runs;
``tests/dist/test_dist_kernel_packages.py`` and ``tests/dist/test_dist_compiled.py`` ask for
them explicitly (``kernel_packages=True``), the latter on every one-pass form. A value already in
the environment is kept (``COCONET_KERNEL_PACKAGES=1 pytest`` runs the suite on packages).

The flight recorder's dumps go to one temporary folder of the run (``COCONET_FLIGHT_DIR``).
"""

import os

os.environ.setdefault("COCONET_KERNEL_PACKAGES", "0")

# The flight recorder's dumps of the jobs the suite fails on purpose (coconet.runtime.flight):
# into one folder of this run, not a folder per job under /tmp. A value already set is kept.
if "COCONET_FLIGHT_DIR" not in os.environ:
    import tempfile

    os.environ["COCONET_FLIGHT_DIR"] = tempfile.mkdtemp(prefix="coconet-test-flight-")
