"""The flight recorder on 2 ranks (issue 48): a rank that stalls past the timeout, or is killed,
before a bare all_reduce; the other's error names it and the call it had not reached, with the
user's line; each failing rank dumps its ring; ``coconet trace why`` reads the dumps and says who
stopped where. (The layers, the pipeline and the optimizer: ``test_dist_fault_trials.py``'s
survivors must name the victim and the call too.)"""

from __future__ import annotations

import json

import pytest
from support import flight_workers

from coconet.cli import main
from coconet.runtime import RankFailure, spawn
from coconet.runtime.flight import verdict


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["stall", "kill"])
def test_a_stalled_or_killed_rank_is_named_with_the_call(tmp_path, how, capsys):
    results = spawn(flight_workers.stall_or_kill, 2, how, str(tmp_path), timeout=60,
                    failures="return")  # fmt: skip
    survivor = results[0]
    assert survivor["status"] == "fault", survivor
    message = survivor["message"]
    calls = survivor["calls"]
    # the survivor's own position (the call it failed in, the user's line) and the peer's
    assert f"call #{calls} of this communicator (all_reduce: late)" in message, message
    assert "flight_workers.py" in message, message  # the user's line, not coconet's
    if how == "kill":  # its process is gone: not waited for
        assert f"rank 1: dead: its process is gone: it had not reached call #{calls}" in message
        assert survivor["seconds"] < 1.0, survivor
    else:  # waited for a twentieth of the timeout (at least 0.25 s)
        assert f"rank 1: no answer within 0.25 s: it had not reached call #{calls}" in message
    dump = json.loads((tmp_path / "rank0.flight.json").read_text())
    (comm,) = [c for c in dump["communicators"] if c["calls"] == calls]
    assert [(e["seq"], e["label"], e["state"]) for e in comm["entries"][-2:]] == [
        (calls - 1, "x2", "completed"), (calls, "late", "failed")]  # fmt: skip
    text = verdict(tmp_path)
    if how == "kill":
        assert isinstance(results[1], RankFailure)
        assert "no dump from rank(s) [1]" in text, text
        assert f"rank(s) [1] left no dump while rank(s) [0] stopped in call #{calls} " \
               "(all_reduce: late)" in text, text
    else:
        # the stalled rank failed too once it woke (its peer had given up): it dumped, and it
        # came to the call last, past the timeout
        assert results[1]["status"] == "fault", results[1]
        assert (tmp_path / "rank1.flight.json").exists()
        assert f"every rank reached call #{calls} (all_reduce: late)" in text, text
        late = float(text.split("rank 1 reached it last, ")[1].split(" s")[0])
        assert late >= flight_workers.TIMEOUT, text
    assert main(["trace", "why", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == text
