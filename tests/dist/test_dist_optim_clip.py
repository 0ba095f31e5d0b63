"""``max_grad_norm=`` on real ranks: coconet.optim clips the averaged gradient by its global
norm inside its step, and equals what a DDP user writes (DDP's average,
``torch.nn.utils.clip_grad_norm_(params, max_norm)``, the torch optimizer) to <= 1e-6 relative,
with the clip active in some steps and not in others; the norm it keeps
(``last_grad_norm``) is torch's.

One param group is one bucket: its fused step is speculative (the update unclipped, the norm
computed alongside, committed where the factor is 1; declined and run again with the factor
where it is not; after a step that clipped the norm comes first). Two param groups are two
buckets: the larger speculates, the norm pass running over the other's gradient first (over
both after a step that clipped). LAMB's
``pre_norm=True`` (``pytorch_optimizer.Lamb``'s global scaling, its ``max_grad_norm`` and
``eps``) is compared with Lamb on the averaged gradient.
"""

from __future__ import annotations

import pytest
from support import clip_workers

from coconet.runtime import CommOptions, spawn

OPTIONS = CommOptions(timeout=60)
TOL = 1e-6

CASES = {
    # name: (optimizer, its settings, the second param group's (None: one group))
    "AdamW-2-groups": ("AdamW", {"lr": 1e-2, "betas": (0.8, 0.99)}, {"weight_decay": 0.0}),
    "AdamW-1-group": ("AdamW", {"lr": 1e-2}, None),
    "Adam-l2-2-groups": ("Adam", {"lr": 1e-2, "weight_decay": 1e-2}, {"lr": 3e-2}),
    "SGD-momentum-1-group": ("SGD", {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-3}, None),
    "SGD-2-groups": ("SGD", {"lr": 5e-2}, {"lr": 0.1, "maximize": True}),
    # pytorch_optimizer.Lamb(pre_norm=True, max_grad_norm=1.0): its own global scaling
    "LAMB-pre-norm-2-groups": ("LAMB", {"lr": 1e-2, "weight_decay": 1e-2},
                               {"weight_decay": 0.0}),
}


def _all_cases(comm, steps):
    return {label: clip_workers.against_torch(comm, name, kwargs, second, steps)
            for label, (name, kwargs, second) in CASES.items()}


def _speculative_runs(clipped: list[bool], lead: bool = False) -> dict[str, int]:
    """The calls of a speculative bucket's steps when its steps clip as ``clipped`` says: a
    step after one that did not clip is speculative (and runs again with the factor, "given",
    when it clips), a step after one that clipped computes the norm first ("in-step"; the
    ``lead`` of several buckets takes the factor of the norm pass over every bucket instead,
    "given")."""
    runs = {"speculative": 0, "given": 0, "in-step": 0}
    last = False
    for c in clipped:
        if last:
            runs["given" if lead else "in-step"] += 1
        else:
            runs["speculative"] += 1
            runs["given"] += c
        last = c
    return {k: v for k, v in runs.items() if v or k == "speculative"}


def _check(label, r):
    assert r["rel"] <= TOL, (label, r)
    assert r["norm_rel"] <= TOL, (label, r)
    assert r["same_on_every_rank"], (label, r)
    assert any(r["clipped"]) and not all(r["clipped"]), (label, r["clipped"])  # both kinds


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("nproc", "transport"), [(1, "auto"), (2, "auto"), (2, "torch.distributed")]
)
def test_max_grad_norm_matches_ddp_average_then_clip_grad_norm_then_torch(nproc, transport):
    options = CommOptions(timeout=60, transport=transport)
    for out in spawn(_all_cases, nproc, 12, options=options, timeout=220):
        for label, r in out.items():
            _check(label, r)
        two = out["AdamW-2-groups"]
        assert two["buckets"] == 2
        # the larger bucket speculates; the norm pass runs over the other alone after a step
        # that did not clip (and over both after one that clipped)
        lead = two["sizes"].index(max(two["sizes"]))
        assert two["clip"][lead] == "speculative" and two["clip"][1 - lead] == "given", two
        if nproc > 1:
            runs = {k: v for k, v in two["lead_runs"].items() if v or k == "speculative"}
            assert runs == _speculative_runs(two["clipped"], lead=True), two
            after_clip = sum(two["clipped"][:-1])
            assert sorted(two["norm_passes"]) == sorted(
                [n for n in (len(two["clipped"]) - after_clip, after_clip) if n]), two
        one = out["AdamW-1-group"]
        assert one["clip"] == ["speculative"]  # the norm alongside the unclipped update
        assert one["runs"] == _speculative_runs(one["clipped"])


def _schedules(comm):
    return {s: clip_workers.against_torch(comm, "AdamW", {"lr": 1e-2}, None, 10, schedule=s)
            for s in ("AR_C", "RS_C_AG", "auto")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
def test_a_declined_step_writes_nothing_on_any_rank_and_the_next_one_commits(transport):
    # declined by one rank: the commit vote makes every rank decline (what a speculative clip
    # relies on), and over shared memory the published gather's slots are let go
    options = CommOptions(timeout=60, transport=transport)
    for r in spawn(clip_workers.declined_steps, 2, options=options, timeout=100):
        assert r["declined"] == [True, False, True, False], r
        assert r["unchanged"] == [True, True], r
        assert r["same"], r


@pytest.mark.timeout(240)
def test_every_named_schedule_and_the_tuner_compile_the_clipped_step():
    for out in spawn(_schedules, 2, options=OPTIONS, timeout=220):
        for label, r in out.items():
            _check(label, r)


def _host_shared(comm):
    return {f"{n}-group": clip_workers.against_torch(comm, "AdamW", {"lr": 1e-2}, second, 10,
                                                     param_storage="host-shared")
            for n, second in (("1", None), ("2", {"weight_decay": 0.0}))}


@pytest.mark.timeout(200)
def test_host_shared_parameters_clip_alike():
    # one copy of the parameters per host: the clipped step still gathers in one pass (its
    # second group writes the new slices into the spare buffer)
    for out in spawn(_host_shared, 2, options=OPTIONS, timeout=180):
        for label, r in out.items():
            _check(label, r)


@pytest.mark.timeout(200)
def test_three_ranks_over_gloo_agree_on_the_clip_factor():
    # the factor of the norm pass is a Replicated scalar, compared bit for bit: the norm's
    # all_reduce must give every rank the same bits (uneven slices at 3 ranks)
    options = CommOptions(timeout=60, transport="torch.distributed")
    for out in spawn(clip_workers.against_torch, 3, "AdamW", {"lr": 1e-2},
                     {"weight_decay": 0.0}, 10, options=options, timeout=180):
        _check("AdamW-3-ranks", out)


@pytest.mark.timeout(120)
def test_parameters_without_a_gradient_and_a_closure():
    for out in spawn(clip_workers.closure_and_sparse_grads, 2, 10, options=OPTIONS,
                     timeout=100):
        assert out["rel"] <= TOL, out
        assert out["norm_rel"] <= TOL, out


@pytest.mark.timeout(120)
def test_ddp_refuses_max_grad_norm_saying_why_and_what_to_do():
    for text in spawn(clip_workers.ddp_refusal, 2, options=OPTIONS, timeout=100):
        assert "max_grad_norm= cannot be combined with ddp=" in text, text
        assert "global norm" in text and "leave ddp= out" in text, text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", [None, {"weight_decay": 0.0}], ids=["in-step", "norm-pass"])
def test_ranks_with_different_max_grad_norms_fail_together_and_change_nothing(second):
    for text in spawn(clip_workers.differing_max_norm, 2, second, options=OPTIONS, timeout=100):
        assert "max_grad_norm" in text, text
        assert "unchanged=True" in text, text


@pytest.mark.timeout(120)
def test_a_clip_grad_norm_before_step_is_warned_about_once():
    for out in spawn(clip_workers.local_clip_warning, 2, options=OPTIONS, timeout=100):
        assert out["plain"] == [], out
        assert len(out["clipped"]) == 1, out
        message, filename = out["clipped"][0]
        assert "clip_grad_norm_" in message and "max_grad_norm=1.0" in message, message
        assert filename.endswith("clip_workers.py"), filename  # the user's step() line
        assert out["again"] == [], out  # once per optimizer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dies", [False, True], ids=["raises", "dies"])
def test_a_rank_failing_after_the_norm_pass_leaves_every_rank_unchanged(dies):
    from coconet.runtime import RankFailure

    options = CommOptions(timeout=20)  # the survivor must learn it at once, not at this
    results = spawn(clip_workers.victim_after_the_norm_pass, 2, 1, dies, options=options,
                    timeout=100, failures="return")
    survivor, victim = results
    assert survivor["status"] == "RuntimeFault", survivor
    assert survivor["norm_pass_ran"] and survivor["unchanged"], survivor
    assert survivor["seconds"] < 10, survivor
    if dies:
        assert isinstance(victim, RankFailure) and victim.exit_code == -9
    else:
        assert victim["status"] == "RuntimeError" and victim["unchanged"], victim
