"""``max_grad_norm=``: global-norm gradient clipping inside coconet.optim's step.

In the simulator: each clipped program (``Clip.IN_STEP``: the norm inside the step;
``Clip.GIVEN``: the factor given), under every named schedule, against the unclipped program
stepped on the gradient torch's ``clip_grad_norm_`` clips, the speculative program
(``Clip.SPECULATIVE``) against the unclipped update and torch's norm, and the norm pass against
torch's norm. In a world of one: the optimizers against ``clip_grad_norm_`` + ``torch.optim``
(and which of a speculative bucket's steps ran), the non-finite cases as torch has them, and
the refusals of bad values.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coconet.optim
from coconet import schedule as schedules
from coconet.errors import ConfigError, ConfigValueError
from coconet.ir.types import DType
from coconet.optim import programs
from coconet.optim.programs import Clip
from coconet.options import CompileOptions
from coconet.sim import simulate

EAGER = CompileOptions(fused_kernels=False)
TOL = 1e-6
BUILDERS = {"adam": programs.adam, "sgd": programs.sgd, "sgd_momentum": programs.sgd_momentum}
STATE = {"adam": ("m", "v"), "sgd": (), "sgd_momentum": ("buf",)}
SCALARS = {
    "adam": dict(weight_decay=0.01, beta1=0.9, one_minus_beta1=0.1, beta2=0.999,
                 one_minus_beta2=0.001, eps=1e-8, step_size=0.01, bc2_sqrt=0.05, decay=1.0),
    "sgd": dict(weight_decay=0.01, lr=0.1),
    "sgd_momentum": dict(weight_decay=0.0, buf_momentum=0.9, buf_damp=1.0, a=0.0, b=1.0,
                         lr=0.1),
}
SCHEDULES = {
    "unscheduled": lambda p, state: p,
    "AR_C": lambda p, state: schedules.AR_C(p).program,
    "RS_C_AG": lambda p, state: schedules.RS_C_AG(p, state=state).program,
    "fuse_RS_C_AG": lambda p, state: schedules.fuse_RS_C_AG(p, state=state).program,
}


def _torch_clip(avg: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient clip_grad_norm_ leaves, its norm): torch's own function."""
    grad = avg.clone()
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    norm = torch.nn.utils.clip_grad_norm_([param], max_norm)
    return param.grad, norm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


def test_unclipped_programs_are_the_programs_they_were():
    # Clip.OFF builds the same nodes (same digest: compiled caches and tuned schedules stay)
    for name, build in BUILDERS.items():
        assert build(DType.float32, Clip.OFF).digest() == build().digest()
        assert build().name == name
        assert build(DType.float32, Clip.IN_STEP).name == f"{name}_clip_in_step"
        assert build(DType.float32, Clip.SPECULATIVE).name == f"{name}_clip_speculative"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(BUILDERS)),
    clip=st.sampled_from([Clip.IN_STEP, Clip.GIVEN, Clip.SPECULATIVE]),
    schedule=st.sampled_from(sorted(SCHEDULES)),
    world=st.integers(1, 4),
    n=st.integers(1, 23),
    magnitude=st.sampled_from([1e-3, 0.3, 1.0, 40.0]),
    max_norm=st.sampled_from([0.05, 1.0, 7.5]),
    seed=st.integers(0, 2**16),
)
def test_a_clipped_program_is_the_update_of_torchs_clipped_average(
    name, clip, schedule, world, n, magnitude, max_norm, seed
):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) * magnitude for _ in range(world)]
    p = torch.randn(n, generator=gen)
    state = {s: torch.rand(n, generator=gen) for s in STATE[name]}
    avg = grads[0].clone()
    for g in grads[1:]:
        avg = avg + g
    avg = avg * (1.0 / world)
    clipped, norm = _torch_clip(avg, max_norm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    program = SCHEDULES[schedule](BUILDERS[name](DType.float32, clip), STATE[name])
    extra = {Clip.IN_STEP: {"max_norm": max_norm}, Clip.GIVEN: {"clip_coef": coef},
             Clip.SPECULATIVE: {}}[clip]
    got = simulate(program, {"g": grads, "p": p, **state, "grad_scale": 1.0 / world,
                             **SCALARS[name], **extra}, world)
    # the reference: the unclipped program, in a world of one, on torch's clipped average (the
    # speculative program's update is the unclipped one: the optimizer commits it only where
    # the factor is 1)
    target_grad = avg if clip is Clip.SPECULATIVE else clipped
    want = simulate(BUILDERS[name](), {"g": target_grad, "p": p, **state, "grad_scale": 1.0,
                                       **SCALARS[name]}, 1)
    for target in ("p", *STATE[name]):
        assert _rel(got.updated(target), want.updated(target)) <= TOL, target
    if clip is not Clip.GIVEN:
        for r in range(world):
            assert _rel(got.outputs["grad_norm"][r], norm) <= TOL
            assert torch.equal(got.outputs["grad_norm"][r], got.outputs["grad_norm"][0])


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 17), min_size=1, max_size=4),
    world=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_the_norm_pass_is_torchs_norm_of_the_averaged_buckets(sizes, world, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = {f"g{j}": [torch.randn(n, generator=gen) for _ in range(world)]
             for j, n in enumerate(sizes)}
    program = programs.grad_norm_pass(DType.float32, len(sizes))
    got = simulate(program, {**grads, "grad_scale": 1.0 / world}, world)
    # the schedule the optimizer compiles (each reduce_scatter fused with its sum of squares)
    scheduled = programs.grad_norm_pass_schedule(program).program
    assert len(scheduled.groups) == len(sizes)
    fused = simulate(scheduled, {**grads, "grad_scale": 1.0 / world}, world)
    assert all(torch.equal(a, b) for a, b in zip(fused.outputs["grad_norm"],
                                                  got.outputs["grad_norm"], strict=True))
    params = []
    for per_rank in grads.values():
        param = torch.nn.Parameter(torch.zeros(per_rank[0].shape))
        total = per_rank[0].clone()
        for g in per_rank[1:]:
            total = total + g
        param.grad = total / world
        params.append(param)
    want = torch.nn.utils.get_total_norm([q.grad for q in params])
    for r in range(world):
        assert _rel(got.outputs["grad_norm"][r], want) <= TOL


def test_the_in_step_norm_is_a_partial_sum_and_one_scalar_all_reduce_when_sliced():
    scheduled = schedules.fuse_RS_C_AG(programs.adam(DType.float32, Clip.IN_STEP),
                                       state=("m", "v")).program
    collectives = [(n.op.name, n.type.rank) for n in scheduled.nodes
                   if n.op.name in ("ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER")]
    # the gradient's reduce_scatter, the scalar all_reduce of the partial sums of squares, the
    # all_gather of the parameters: no second pass over the gradient
    assert collectives == [("REDUCE_SCATTER", 1), ("ALL_REDUCE", 0), ("ALL_GATHER", 1)]


def test_the_first_fused_group_holds_only_what_the_norm_reads():
    # fuse_after: beta1 * m, decay * p and the rest of the update wait for the second group
    # (fused with their consumers) instead of being written out before the scalar all_reduce
    # and read back after it; only the gradient's slice crosses from the first group
    scheduled = schedules.fuse_RS_C_AG(programs.adam(DType.float32, Clip.IN_STEP),
                                       state=("m", "v")).program
    first, second = scheduled.groups
    assert set(first.members) == {"g_sum_rs", "grad_slice", "mul_1_slice",
                                  "grad_sumsq_partial"}
    assert "p_new" in second.members and "m_new_slice" in second.members


# -- the optimizers, a world of one -----------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _groups(net, two):
    ps = list(net.parameters())
    if not two:
        return ps
    return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0, "lr": 2e-2}]


OPTIMIZERS = {
    "AdamW": {"lr": 1e-2},
    "Adam": {"lr": 1e-2, "weight_decay": 1e-2},
    "SGD": {"lr": 5e-2, "momentum": 0.9, "nesterov": True},
}


def _train_both(name, two, steps, max_norm, late_group=False):
    net, ref = _model(), _model()
    kwargs = OPTIMIZERS[name]
    if late_group:  # the second group added after construction (one bucket, then two)
        ours = getattr(coconet.optim, name)(list(net.parameters())[:2], options=EAGER,
                                            max_grad_norm=max_norm, **kwargs)
        theirs = getattr(torch.optim, name)(list(ref.parameters())[:2], **kwargs)
        assert [b.clip for b in ours.buckets] == [Clip.SPECULATIVE]
        ours.add_param_group({"params": list(net.parameters())[2:], "lr": 2e-2})
        theirs.add_param_group({"params": list(ref.parameters())[2:], "lr": 2e-2})
    else:
        ours = getattr(coconet.optim, name)(_groups(net, two), options=EAGER,
                                            max_grad_norm=max_norm, **kwargs)
        theirs = getattr(torch.optim, name)(_groups(ref, two), **kwargs)
    clipped, norm_rel = [], 0.0
    for k in range(steps):
        gen = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        scale = (0.02, 3.0, 0.5, 20.0)[k % 4]  # the clip active in some steps only
        for m, o in ((net, ours), (ref, theirs)):
            o.zero_grad()
            (torch.nn.functional.mse_loss(m(x), y) * scale).backward()
        ours.step()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        theirs.step()
        clipped.append(bool(norm > max_norm))
        norm_rel = max(norm_rel, _rel(ours.last_grad_norm, norm))
        assert ours.last_grad_norm.shape == ()
    rel = max(_rel(a, b) for a, b in zip(net.parameters(), ref.parameters(), strict=True))
    return ours, rel, norm_rel, clipped


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("two", [False, True], ids=["one-bucket", "two-buckets"])
def test_a_world_of_one_matches_clip_grad_norm_then_torch(name, two):
    ours, rel, norm_rel, clipped = _train_both(name, two, 12, 1.0)
    assert rel <= TOL and norm_rel <= TOL
    assert any(clipped) and not all(clipped)
    # two buckets: the larger (the first group's 30 elements, against 14) speculates
    assert [b.clip for b in ours.buckets] == ([Clip.SPECULATIVE, Clip.GIVEN] if two
                                               else [Clip.SPECULATIVE])  # fmt: skip
    assert ours.max_grad_norm == 1.0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_speculative_bucket_commits_unclipped_steps_and_steps_again_when_it_clips(name):
    # scales (0.02, 3.0, 0.5, 20.0) repeat: clipped, as torch says, in some steps only. A step
    # after one that did not clip is speculative (declined and run again with the factor when
    # it clips); a step after one that clipped computes the norm first (Clip.IN_STEP)
    ours, rel, norm_rel, clipped = _train_both(name, False, 12, 1.0)
    assert rel <= TOL and norm_rel <= TOL and any(clipped) and not all(clipped)
    (b,) = ours.buckets
    speculative = given_after = in_step = 0
    last = False
    for c in clipped:
        if last:
            in_step += 1
        else:
            speculative += 1
            given_after += c
        last = c
    assert b.step_fn.calls == speculative
    assert b.forms[Clip.GIVEN].calls == given_after > 0
    assert b.forms[Clip.IN_STEP].calls == in_step > 0


def test_a_speculative_bucket_that_never_clips_compiles_nothing_else():
    ours, rel, norm_rel, clipped = _train_both("AdamW", False, 6, 1e6)
    assert rel <= TOL and norm_rel <= TOL and not any(clipped)
    assert set(ours.buckets[0].forms) == {Clip.SPECULATIVE} and ours.buckets[0].step_fn.calls == 6


def test_a_group_added_later_keeps_the_larger_bucket_speculating():
    ours, rel, norm_rel, clipped = _train_both("AdamW", False, 10, 1.0, late_group=True)
    assert [b.clip for b in ours.buckets] == [Clip.SPECULATIVE, Clip.GIVEN]
    assert rel <= TOL and norm_rel <= TOL and any(clipped) and not all(clipped)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_several_buckets_speculate_on_the_largest(name):
    """The lead (the larger bucket) steps first, speculatively, after a norm pass over the
    other bucket; a step after one that clipped runs the norm pass over both and gives every
    bucket the factor. The calls of each compiled step follow from which steps clipped."""
    ours, rel, norm_rel, clipped = _train_both(name, True, 12, 1.0)
    assert rel <= TOL and norm_rel <= TOL and any(clipped) and not all(clipped)
    lead, other = ours.buckets
    after_clip = sum(clipped[:-1])
    speculative = len(clipped) - after_clip
    assert lead.step_fn.calls == speculative
    # given: a speculative step that clipped, run again; and every step after one that clipped
    assert lead.forms[Clip.GIVEN].calls == sum(
        c for k, c in enumerate(clipped) if k == 0 or not clipped[k - 1]) + after_clip
    assert other.step_fn.calls == len(clipped)
    passes = {len(key): s.calls for key, s in ours.clipper.norm_passes.items()}
    assert passes == {1: speculative, 2: after_clip}


def test_the_lead_without_a_gradient_leaves_the_norm_to_the_others():
    """Only the smaller group has gradients: the lead is not stepped, its bucket holds zeros,
    and the others' norm is the whole one (torch's, over the gradients there are)."""
    net, ref = _model(), _model()
    ours = coconet.optim.SGD(_groups(net, True), lr=0.1, options=EAGER, max_grad_norm=0.5)
    theirs = torch.optim.SGD(_groups(ref, True), lr=0.1)
    for m in (net, ref):
        m.zero_grad(set_to_none=True)
        for p in list(m.parameters())[2:]:
            p.grad = torch.full_like(p, 0.3)
    ours.step()
    norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None],
                                          0.5)  # fmt: skip
    theirs.step()
    assert _rel(ours.last_grad_norm, norm) <= TOL
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert _rel(a, b) <= TOL


@pytest.mark.parametrize("two", [False, True], ids=["one-bucket", "two-buckets"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_is_clipped_as_torch_clips_it(two, bad):
    # torch's default (error_if_nonfinite=False): the norm is NaN or inf, the factor NaN or 0,
    # and the gradients are multiplied by it anyway
    net, ref = _model(), _model()
    ours = coconet.optim.AdamW(_groups(net, two), options=EAGER, max_grad_norm=1.0)
    theirs = torch.optim.AdamW(_groups(ref, two))
    for m in (net, ref):
        m.zero_grad()
        torch.nn.functional.mse_loss(m(torch.ones(2, 4)), torch.zeros(2, 2)).backward()
        next(m.parameters()).grad[0, 0] = bad
    ours.step()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    theirs.step()
    assert torch.equal(ours.last_grad_norm.isnan(), norm.isnan())
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=TOL, atol=0)


def test_no_gradient_at_all_is_torchs_zero_norm():
    net = _model()
    opt = coconet.optim.SGD(net.parameters(), lr=0.1, options=EAGER, max_grad_norm=1.0)
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    assert opt.step() is None
    assert float(opt.last_grad_norm) == 0.0
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))


def test_without_max_grad_norm_nothing_changes():
    net = _model()
    opt = coconet.optim.AdamW(net.parameters(), options=EAGER)
    assert opt.max_grad_norm is None and opt.last_grad_norm is None
    assert [b.clip for b in opt.buckets] == [Clip.OFF]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        (-1.0, ConfigValueError, "must be a finite number > 0"),
        (0.0, ConfigValueError, "None turns clipping off"),
        (float("nan"), ConfigValueError, "must be a finite number > 0"),
        (float("inf"), ConfigValueError, "must be a finite number > 0"),
        ("1.0", ConfigError, "is not a number"),
        (True, ConfigError, "is not a number"),
        ([1.0], ConfigError, "is not a number"),
    ],
)
def test_a_bad_max_grad_norm_is_refused_naming_it_the_value_and_the_line(
    name, value, error, says
):
    net = _model()
    with pytest.raises(error) as info:
        getattr(coconet.optim, name)(net.parameters(), max_grad_norm=value,
                                     **OPTIMIZERS[name])
    e = info.value
    assert f"max_grad_norm={value!r}" in str(e) or f"max_grad_norm={float(value)!r}" in str(e)
    assert says in str(e)
    assert e.hint and "max_grad_norm=1.0" in e.hint
    assert e.loc is not None and e.loc.filename == __file__  # the user's line


def test_a_number_like_max_grad_norm_is_taken():
    net = _model()
    opt = coconet.optim.AdamW(net.parameters(), options=EAGER,
                              max_grad_norm=torch.tensor(2.0))
    assert opt.max_grad_norm == 2.0 and isinstance(opt.max_grad_norm, float)
    assert math.isclose(coconet.optim.SGD(_model().parameters(), max_grad_norm=3).max_grad_norm,
                        3.0)


def test_lamb_keeps_its_own_max_grad_norm_and_a_custom_program_must_say_it_clips():
    # pytorch_optimizer.Lamb's max_grad_norm is read only with pre_norm=True (and 0 is off):
    # stored in the group as Lamb does, no clipping without pre_norm
    opt = coconet.optim.LAMB(_model().parameters(), max_grad_norm=2.0, options=EAGER)
    assert opt.param_groups[0]["max_grad_norm"] == 2.0 and opt.max_grad_norm is None
    off = coconet.optim.LAMB(_model().parameters(), max_grad_norm=0.0, pre_norm=True,
                             options=EAGER)
    assert off.max_grad_norm is None and all(b.clip is Clip.OFF for b in off.buckets)

    class NoClip(coconet.optim.SGD):
        supports_grad_clip = False

    with pytest.raises(ConfigError, match="its program does not clip"):
        NoClip(_model().parameters(), max_grad_norm=1.0)


def test_a_world_of_one_does_not_warn_about_a_clip_before_step():
    # its local gradient is the average: clip_grad_norm_ before step() is right there
    import warnings

    net = _model()
    opt = coconet.optim.AdamW(net.parameters(), options=EAGER)
    torch.nn.functional.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 2)).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", coconet.optim.LocalGradientEditWarning)
        opt.step()


@pytest.mark.parametrize("two", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("foreach", [False, True])
def test_lamb_pre_norm_is_lambs_global_scaling(two, foreach):
    # pytorch_optimizer.Lamb(pre_norm=True): the gradients times
    # clamp(max_grad_norm / (norm + eps), max=1), its eps, the constructor's max_grad_norm
    import pytorch_optimizer

    net, ref = _model(), _model()
    kwargs = {"lr": 1e-2, "weight_decay": 1e-2, "max_grad_norm": 0.7, "pre_norm": True,
              "eps": 1e-5}
    ours = coconet.optim.LAMB(_groups(net, two), options=EAGER, **kwargs)
    theirs = pytorch_optimizer.Lamb(_groups(ref, two), foreach=foreach, **kwargs)
    assert all(b.clip is Clip.GIVEN for b in ours.buckets)  # even a single tensor's bucket
    scaled = []
    for k in range(10):
        gen = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        scale = (0.02, 3.0, 0.5, 20.0)[k % 4]
        for m, o in ((net, ours), (ref, theirs)):
            o.zero_grad()
            (torch.nn.functional.mse_loss(m(x), y) * scale).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        ours.step()
        theirs.step()
        scaled.append(bool(norm + 1e-5 > 0.7))
        assert _rel(ours.last_grad_norm, norm) <= TOL
    assert any(scaled) and not all(scaled)
    assert max(_rel(a, b) for a, b in zip(net.parameters(), ref.parameters(),
                                          strict=True)) <= TOL


# -- schedule="auto": every clipping form of a step takes the recipe tuned for the step ---------


@pytest.mark.parametrize("make, state", [(programs.adam, ("m", "v")), (programs.lamb, ("m", "v")),
                                         (programs.sgd_momentum, ("buf",))])
def test_each_clipping_form_takes_the_tuned_recipe_and_slices_the_state_alike(make, state):
    # A bucket runs its speculative, given-factor and norm-first steps on one state: whatever
    # recipe the tuner picks for the step without clipping, every form must slice that state
    # as it does (tuned each on its own, two forms once picked layouts that did not fit).
    from coconet.optim.buckets import is_sliced as _is_sliced
    from coconet.optim.recipes import same_recipe as _same_recipe
    from coconet.options import TransportKind
    from coconet.tune.candidates import CHUNKS, enumerate_candidates

    base = make(DType.float32)
    candidates, _ = enumerate_candidates(base, [TransportKind.SHARED_MEMORY], CHUNKS, state)
    assert len(candidates) > 3
    for chosen in candidates:
        sliced = {n for n in state if _is_sliced(chosen.scheduled, n)}
        for clip in (Clip.SPECULATIVE, Clip.GIVEN, Clip.IN_STEP):
            form = make(DType.float32, clip=clip)
            target = _same_recipe(form, state, chosen, "Adam")
            scheduled = target.program if hasattr(target, "program") else target
            assert {n for n in state if _is_sliced(scheduled, n)} == sliced, (chosen.name, clip)
