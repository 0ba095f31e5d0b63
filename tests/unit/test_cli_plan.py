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


@pytest.mark.parametrize("transport", ["hierarchical", "torch.distributed"])
def test_the_all_reduce_follows_its_transports_ring_formula(transport):
    """Two levels: a ring inside each node, then the node's 1/G across; flat: rings over every
    rank, each pass bounded by the slower of the node's links (cluster.py's docstring)."""
    from coconet.ir.ops import Op
    from coconet.options import TransportKind

    d = {"ranks_per_node": 4, "intra_node": {"bandwidth_GBps": 100, "latency_us": 0},
         "inter_node": {"bandwidth_GBps": 10, "latency_us": 0},
         "memory_bandwidth_GBps": 1e9, "peak_tflops": 1}
    model = cluster_model(d, 16)
    kind = TransportKind(transport)
    s = 4e9
    t, _ = model.collective(Op.ALL_REDUCE, kind, s, 16)
    if kind is TransportKind.HIERARCHICAL:
        want = 2 * (3 / 4) * s / 100e9 + 2 * (3 / 4) * (s / 4) / 10e9 + s / 1e18
    else:  # the node's network (4 x 10 GB/s) is slower than a rank's 100 GB/s inside
        want = 2 * (15 / 16) * s / 40e9 + s / 1e18
    assert t == pytest.approx(want, rel=1e-9)
    rs, _ = model.collective(Op.REDUCE_SCATTER, kind, s, 16)
    ag, _ = model.collective(Op.ALL_GATHER, kind, s, 16)
    assert rs + ag == pytest.approx(t, rel=1e-6)
    # inside one node both are the one ring there
    one, _ = model.collective(Op.ALL_REDUCE, kind, s, 4)
    assert one == pytest.approx(2 * (3 / 4) * s / 100e9 + s / 1e18, rel=1e-9)


def test_plan_on_cpu_hosts_predicts_flat_and_two_levels_and_two_levels_win_across_a_slow_link(
    tmp_path, capsys
):
    """2 ranks per host over 1 Gbit/s (as benchmarks/multi_host.py's link): the fused step in
    two levels moves half the tensor across where a flat ring over 4 ranks moves 3/4: ~1.5x."""
    desc = tmp_path / "hosts.json"
    desc.write_text(json.dumps({
        "name": "2 ranks per host, 1 Gbit/s", "ranks_per_node": 2, "device": "cpu",
        "intra_node": {"bandwidth_GBps": 6.5, "latency_us": 40},
        "inter_node": {"bandwidth_GBps": 0.0625, "latency_us": 60},
        "memory_bandwidth_GBps": 16, "peak_tflops": 0.05}))
    out = tmp_path / "plan.json"
    assert main(["plan", ADAM, "--size", "N=16777216", "--world", "4", "--cluster", str(desc),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "[hierarchical]" in text and "[torch.distributed]" in text
    doc = json.loads(out.read_text())
    ms = {c["schedule"].split(":")[0]: c["predicted_ms"]["4"] for c in doc["candidates"]}
    flat = ms["fuse_RS_C_AG [torch.distributed]"]
    levels = ms["fuse_RS_C_AG [hierarchical]"]
    assert 1.3 < flat / levels < 1.6, (flat, levels)
    assert doc["best"]["4"].split(":")[0].endswith("[hierarchical]")
    # a GPU cluster's description: NCCL's own rings only
    capsys.readouterr()
    assert main(["plan", ADAM, "--size", "N=1000", "--world", "16"]) == 0
    assert "[hierarchical]" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["-0.1", "nan", "inf"])
def test_tune_refuses_a_bad_rematch_fraction_before_starting_ranks(bad):
    with pytest.raises(SystemExit, match="--rematch-within takes a fraction"):
        main(["tune", ADAM, "--size", "N=64", "--rematch-within", bad])
