"""The compiled path: fused groups as Inductor C++ kernels (packages built ahead of time,
``coconet.codegen.aot``), on 2 ranks (over shared memory, so the one-pass forms of fuse_RS_C_AG,
AR_C, LAMB's halves and the overlapped layer are compiled too).

This is the one compile-heavy test of the tier: Inductor's first compile costs ~30 s when both
ranks compile at once on an empty cache (~5 s with a warm one, see docs in coconet.codegen).
Compiled kernels may contract floating-point ops differently from eager torch, so results are
checked to 1e-6 relative against the simulator (in practice they come out identical).
"""

from __future__ import annotations

import pytest
from support import dist_workers
from support.tolerances import schedule_rtol

from coconet.runtime import CommOptions, spawn


@pytest.mark.timeout(240)
def test_fused_kernels_compile_and_match(tmp_path):
    results = spawn(
        dist_workers.run_compiled,
        2,
        str(tmp_path),
        options=CommOptions(timeout=120, algorithms="exact"),
        timeout=230,
    )
    for out in results:
        assert out["compiled"]
        assert out["packaged"] == (1, {}), out["packaged"]  # loaded or built, no fallback
        assert out["adam"]["kernels"] == 1  # fuse(RS, update, AG): one kernel between them
        assert out["fused_mix"]["kernels"] == 3
        for label in ("adam", "fused_mix"):
            assert out[label]["rel"] <= 1e-6, out
        first, second = out["adam_again_seconds"]
        assert second < 5.0  # the kernel is compiled once, then reused
        for case, r in out["one_pass"].items():
            name, schedule = case.split("/")
            assert r["form"] and r["compiled"], case  # over shared memory: the one-pass form
            # every kernel from a package (those that only write into the peers' slots too),
            # but the overlapped layer's, whose dropout geometry is Python numbers: under
            # torch.compile, said so
            count, why_not = r["packaged"]
            if name == "tensor_parallel":
                assert set(why_not.values()) == {"an argument is not a tensor"}, why_not
            else:
                assert count >= 1 and not why_not, (case, r["packaged"])
            mod = dist_workers.load_example(name)
            program = mod.program()
            rtol = schedule_rtol(program, mod.SCHEDULES[schedule](program).program, "float32")
            assert r["rel"] <= max(1e-6, rtol), (case, r)
