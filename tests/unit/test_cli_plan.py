"""``coconet plan``: predicted step times from a cluster description; ``coconet tune``'s argument
checks (no processes)."""

import json
import pathlib

import pytest

from coconet.cli import main
from coconet.errors import ConfigError
from coconet.tune.cluster import SHIPPED, cluster_model, load_description

ADAM = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "adam.py") + ":program"


def test_plan_prints_every_candidate_at_every_world_and_marks_the_best(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", ADAM, "--size", "N=334000000", "--world", "8", "--world", "256",
                 "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "fuse_RS_C_AG" in text and "unscheduled" in text and "AR_C" in text
    assert text.count("*") >= 2  # one best per world size
    doc = json.loads(out.read_text())
    assert doc["worlds"] == [8, 256]
    assert set(doc["best"]) == {"8", "256"}
    by_name = {c["schedule"].split(" [")[0]: c["predicted_ms"] for c in doc["candidates"]}
    # The paper's point at scale: slicing the update beats updating everything on every rank.
    assert by_name["fuse_RS_C_AG"]["256"] < by_name["AR_C"]["256"] < by_name["unscheduled"]["256"]
    # more ranks, more of the step is the inter-node all_reduce
    assert by_name["AR_C"]["256"] > by_name["AR_C"]["8"]


def test_plan_needs_sizes():
    with pytest.raises(SystemExit, match="give the sizes"):
        main(["plan", ADAM])


@pytest.mark.parametrize("bad", ["N", "N=x", "=5"])
def test_a_bad_size_is_refused(bad):
    with pytest.raises(SystemExit, match="--size takes DIM=N"):
        main(["plan", ADAM, "--size", bad])


def test_shipped_descriptions_load_and_a_broken_one_is_a_clear_error(tmp_path):
    for name in SHIPPED:
        d = load_description(name)
        model = cluster_model(d, 64)
        assert model.world == 64 and model.flops > 0
    broken = tmp_path / "c.json"
    broken.write_text(json.dumps({"ranks_per_node": 8, "intra_node": {}}))
    with pytest.raises(ConfigError, match="inter_node"):
        load_description(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_description(tmp_path / "missing.json")


def test_the_hierarchical_all_reduce_follows_the_ring_formula():
    from coconet.ir.ops import Op
    from coconet.options import TransportKind

    d = {"ranks_per_node": 4, "intra_node": {"bandwidth_GBps": 100, "latency_us": 0},
         "inter_node": {"bandwidth_GBps": 10, "latency_us": 0},
         "memory_bandwidth_GBps": 1e9, "peak_tflops": 1}
    model = cluster_model(d, 16)
    s = 4e9
    t, _ = model.collective(Op.ALL_REDUCE, TransportKind.TORCH_DISTRIBUTED, s, 16)
    want = 2 * (3 / 4) * s / 100e9 + 2 * (3 / 4) * (s / 4) / 10e9 + s / 1e18
    assert t == pytest.approx(want, rel=1e-9)
    rs, _ = model.collective(Op.REDUCE_SCATTER, TransportKind.TORCH_DISTRIBUTED, s, 16)
    ag, _ = model.collective(Op.ALL_GATHER, TransportKind.TORCH_DISTRIBUTED, s, 16)
    assert rs + ag == pytest.approx(t, rel=1e-6)


@pytest.mark.parametrize("bad", ["-0.1", "nan", "inf"])
def test_tune_refuses_a_bad_rematch_fraction_before_starting_ranks(bad):
    with pytest.raises(SystemExit, match="--rematch-within takes a fraction"):
        main(["tune", ADAM, "--size", "N=64", "--rematch-within", bad])
