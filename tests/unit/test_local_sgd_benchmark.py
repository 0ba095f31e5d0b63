"""benchmarks/local_sgd.py's targets and table from a run's rows: the names the Local-SGD issue
gives, each ratio of this run's medians, and "at most" against "at least" the right way round
(the run itself needs namespace hosts: ``multi_host.py --local-sgd``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import local_sgd  # noqa: E402

ROWS = [("local step", 100.0), ("coconet OverlapLocalSGD (k=8)", 105.0),
        ("coconet LocalSGD (k=8)", 150.0), ("torch post-local-sgd (k=8)", 130.0),
        ("sync hierarchical (coconet.optim.Adam)", 400.0)]  # fmt: skip


def _run() -> dict:
    return {"rate": "1gbit", "period": 8, "link_ms": 536.9, "explain": "OverlapLocalSGD ...",
            "local_sgd_models_equal_after_sync": True,
            "rows": [{"name": n, "median_ms": ms, "min_ms": ms, "max_ms": ms,
                      "sync_step_ms": ms * 3} for n, ms in ROWS]}  # fmt: skip


def test_the_targets_are_the_issues_ratios():
    got = {t["name"]: (t["value"], t["met"]) for t in local_sgd.targets(_run())}
    assert got == {
        "2 x 2, 1gbit: overlap local-sgd (k=8) step over local step": (1.05, True),
        "2 x 2, 1gbit: overlap local-sgd (k=8) speedup over sync hierarchical": (3.81, True),
        "2 x 2, 1gbit: overlap local-sgd speedup over torch post-local-sgd (k=8)": (1.238, False),
    }


def test_the_table_says_each_target_and_the_bound():
    doc = {"config": {"params": 16 << 20, "period": 8, "periods": 5, "warmup": 2, "batch": 64},
           "run": _run(), "machine": {"cpu_model": "cpu", "cpus": 2}}
    doc["targets"] = local_sgd.targets(doc["run"])
    text = local_sgd.table(doc)
    assert "67.1 ms per step at k = 8" in text
    assert "(<= 1.1: met)" in text and "(>= 1.3: MISSED)" in text
    assert "forward + backward of 64 rows" in text
