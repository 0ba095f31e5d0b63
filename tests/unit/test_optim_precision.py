"""16-bit parameters and ``reduce_dtype=`` in coconet.optim, on a world of one (this process).

The reference is written from torch alone, as the issue asks: a float32 master copy of the
parameters stepped by the torch optimizer (``torch.optim.AdamW``, ``Adam``, ``SGD``;
``pytorch_optimizer.Lamb``) on the averaged float32 gradient, then cast to the parameters'
dtype. The master weights must follow it to ``OPTIM_RTOL`` over 100 steps, and the 16-bit
parameters must be exactly the master's rounding. The multi-rank versions (uneven slices, both
transports, 16-bit reductions) are in ``tests/dist/test_dist_optim_precision.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tolerances import OPTIM_RTOL

import coconet.optim
from coconet import runtime
from coconet.errors import ConfigError
from coconet.optim.programs import MASTER_STATE_KEY
from coconet.options import CompileOptions
from coconet.runtime import CommOptions

EAGER = CompileOptions(fused_kernels=False)
P = torch.nn.Parameter
# float16 stepped without a scaler on purpose here (the warning's own test checks it)
pytestmark = pytest.mark.filterwarnings(
    "ignore::coconet.optim.scaling.Float16WithoutScalerWarning")
SHAPES = [(7, 5), (13,), (3, 3, 2)]
SIXTEEN = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown()


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().item()
    return (actual.double() - expected.double()).abs().max().item() / max(scale, 1e-30)


def grad(t: int, j: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * t + j)
    return (torch.randn(SHAPES[j], generator=g) * scale).to(dtype)


def reference(name: str, kwargs: dict):
    if name == "LAMB":
        pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
        return lambda params: pytorch_optimizer.Lamb(params, **kwargs)
    return lambda params: getattr(torch.optim, name)(params, **kwargs)


CASES = {
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "Adam": {"lr": 3e-3, "weight_decay": 0.05},
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    "SGD-plain": {"lr": 0.05},
    "LAMB": {"lr": 1e-2, "weight_decay": 0.01},
}


@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_16bit_parameters_follow_a_float32_master_stepped_by_torch(comm, case, dtype):
    """100 steps: the master weights (``state_dict()``'s ``master_param``) follow torch's
    optimizer over a float32 copy to OPTIM_RTOL, the parameters are its rounding, bit for bit,
    and the state is float32 in torch's keys."""
    name = case.split("-")[0]
    kwargs = CASES[case]
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    ours = [P(w.to(dtype)) for w in init]
    master = [P(w.to(dtype).float()) for w in init]  # the master starts from the rounding
    opt = getattr(coconet.optim, name)(ours, comm=comm, options=EAGER, **kwargs)
    ref = reference(name, kwargs)(master)
    for t in range(100):
        for j, (p, m) in enumerate(zip(ours, master, strict=True)):
            p.grad = grad(t, j, dtype)
            m.grad = p.grad.float()
        opt.step()
        ref.step()
    sd = opt.state_dict()
    for j, (p, m) in enumerate(zip(ours, master, strict=True)):
        entry = sd["state"][j]
        assert entry[MASTER_STATE_KEY].dtype == torch.float32
        assert rel(entry[MASTER_STATE_KEY], m.detach()) < OPTIM_RTOL, case
        assert torch.equal(p.detach(), entry[MASTER_STATE_KEY].to(dtype))
        for key, value in ref.state[m].items():
            if isinstance(value, torch.Tensor) and value.dim():
                assert entry[key].dtype == torch.float32, key
                assert rel(entry[key], value) < OPTIM_RTOL, (case, key)


@pytest.mark.parametrize("reduce", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_reduce_dtype_rounds_the_gradient_the_reference_rounds(comm, reduce):
    """``reduce_dtype=`` on float32 parameters: the step is torch's on the gradient sent in that
    dtype (one process: its rounding, the sum of one), and float32 is the plain step."""
    torch.manual_seed(1)
    init = [torch.randn(s) for s in SHAPES]
    ours = [P(w.clone()) for w in init]
    theirs = [P(w.clone()) for w in init]
    opt = coconet.optim.AdamW(ours, comm=comm, options=EAGER, lr=1e-2, reduce_dtype=reduce)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    for t in range(20):
        for j, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            p.grad = grad(t, j, torch.float32)
            q.grad = p.grad.to(reduce).float()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        assert rel(p.detach(), q.detach()) < OPTIM_RTOL
    assert MASTER_STATE_KEY not in opt.state_dict()["state"][0]  # float32: no master copy


def test_the_compiled_step_keeps_the_rounding_bitwise(comm):
    """The fused kernels (torch.compile) round as the eager step does: a 16-bit reduction's
    rounding is not skipped by Inductor (``emulate_precision_casts``)."""
    torch.manual_seed(2)
    init = [torch.randn(s) for s in SHAPES]
    a = [P(w.to(torch.bfloat16)) for w in init]
    b = [P(w.to(torch.bfloat16)) for w in init]
    fused = coconet.optim.AdamW(a, comm=comm, lr=1e-2)
    eager = coconet.optim.AdamW(b, comm=comm, options=EAGER, lr=1e-2)
    for t in range(5):
        for j, (p, q) in enumerate(zip(a, b, strict=True)):
            p.grad = grad(t, j, torch.bfloat16)
            q.grad = p.grad.clone()
        fused.step()
        eager.step()
    for p, q in zip(a, b, strict=True):
        assert rel(p.detach(), q.detach()) < OPTIM_RTOL


def test_state_dict_moves_between_16bit_and_torch(comm):
    """Saved with its master (float32), loaded into a like optimizer it continues bit for bit;
    loaded into torch's AdamW over float32 parameters (the masters) it continues as torch; a
    torch float32 AdamW checkpoint with ``with_master_weights`` of its parameters starts the
    masters from the float32 weights, not from their rounding."""
    torch.manual_seed(3)
    init = [torch.randn(s) for s in SHAPES]
    a = [P(w.to(torch.bfloat16)) for w in init]
    opt = coconet.optim.AdamW(a, comm=comm, options=EAGER, lr=1e-2)
    for t in range(3):
        for j, p in enumerate(a):
            p.grad = grad(t, j, torch.bfloat16)
        opt.step()
    sd = opt.state_dict()
    # a like optimizer: continues bit for bit
    b = [P(p.detach().clone()) for p in a]
    again = coconet.optim.AdamW(b, comm=comm, options=EAGER, lr=1e-2)
    again.load_state_dict(sd)
    # torch over the masters
    masters = [P(sd["state"][j][MASTER_STATE_KEY].clone()) for j in range(len(a))]
    torch_opt = torch.optim.AdamW(masters, lr=1e-2)
    torch_opt.load_state_dict(sd)
    for t in range(3, 6):
        for j, (p, q, m) in enumerate(zip(a, b, masters, strict=True)):
            p.grad = grad(t, j, torch.bfloat16)
            q.grad = p.grad.clone()
            m.grad = p.grad.float()
        opt.step()
        again.step()
        torch_opt.step()
    for p, q, m in zip(a, b, masters, strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)) or (
            rel(p.detach(), m.detach()) < 1e-2)
    final = opt.state_dict()
    for j, m in enumerate(masters):
        assert rel(final["state"][j][MASTER_STATE_KEY], m.detach()) < OPTIM_RTOL
    # a float32 torch checkpoint, masters from the float32 weights
    fp32 = [P(w.clone()) for w in init]
    t_opt = torch.optim.AdamW(fp32, lr=1e-2)
    for j, p in enumerate(fp32):
        p.grad = grad(0, j, torch.float32)
    t_opt.step()
    c = [P(p.detach().to(torch.bfloat16)) for p in fp32]
    resumed = coconet.optim.AdamW(c, comm=comm, options=EAGER, lr=1e-2)
    resumed.load_state_dict(coconet.optim.with_master_weights(t_opt.state_dict(), fp32))
    state = resumed.state_dict()["state"]
    for j, p in enumerate(fp32):
        assert torch.equal(state[j][MASTER_STATE_KEY], p.detach())
        assert torch.equal(state[j]["exp_avg"], t_opt.state[p]["exp_avg"])
    # without it, the masters are the 16-bit parameters widened
    d = [P(p.detach().to(torch.bfloat16)) for p in fp32]
    plain = coconet.optim.AdamW(d, comm=comm, options=EAGER, lr=1e-2)
    plain.load_state_dict(t_opt.state_dict())
    for j, p in enumerate(d):
        assert torch.equal(plain.state_dict()["state"][j][MASTER_STATE_KEY], p.detach().float())


def test_parameters_written_in_place_are_taken_into_the_master(comm):
    """A model's ``load_state_dict`` (an in-place copy into the 16-bit parameters) after the
    optimizer was built: the next step starts from the loaded values, not from the master's
    stale ones; a parameter whose ``.data`` is replaced too."""
    torch.manual_seed(4)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    opt = coconet.optim.AdamW(model.parameters(), comm=comm, options=EAGER, lr=1e-2)
    loaded = {k: torch.randn_like(v.float()).to(torch.bfloat16)
              for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    mirror = {k: P(v.float()) for k, v in loaded.items()}
    ref = torch.optim.AdamW(list(mirror.values()), lr=1e-2)
    for name, p in model.named_parameters():
        p.grad = torch.ones_like(p)
        mirror[name].grad = torch.ones_like(mirror[name])
    opt.step()
    ref.step()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), mirror[name].detach().to(torch.bfloat16)), name
    with torch.no_grad():
        model.weight.data = torch.zeros_like(model.weight)  # replaced
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    master = opt.state_dict()["state"][0][MASTER_STATE_KEY]
    assert master.abs().max() < 0.05  # one step from zero, not from the old weights


def test_mixed_dtypes_in_one_group_step_as_a_bucket_each(comm):
    """A group of float32 and bfloat16 parameters (a model left partly in float32): each dtype is
    a bucket of its own, the 16-bit one through its master; the global norm of
    ``max_grad_norm=`` counts both."""
    torch.manual_seed(5)
    init = [torch.randn(s) for s in SHAPES]
    ours = [P(init[0].clone()), P(init[1].to(torch.bfloat16)), P(init[2].to(torch.bfloat16))]
    master = [P(p.detach().float().clone()) for p in ours]
    opt = coconet.optim.AdamW(ours, comm=comm, options=EAGER, lr=1e-2, max_grad_norm=0.5)
    ref = torch.optim.AdamW(master, lr=1e-2)
    for t in range(10):
        for j, (p, m) in enumerate(zip(ours, master, strict=True)):
            p.grad = grad(t, j, p.dtype)
            m.grad = p.grad.float().clone()  # (not p's own: the reference clips it in place)
        norm = torch.nn.utils.clip_grad_norm_(master, 0.5)
        opt.step()
        ref.step()
        assert rel(opt.last_grad_norm, norm) < OPTIM_RTOL
    sd = opt.state_dict()["state"]
    assert MASTER_STATE_KEY not in sd[0] and MASTER_STATE_KEY in sd[1]
    assert rel(ours[0].detach(), master[0].detach()) < OPTIM_RTOL
    for j in (1, 2):
        assert rel(sd[j][MASTER_STATE_KEY], master[j].detach()) < OPTIM_RTOL


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), dtype=st.sampled_from(SIXTEEN),
       scale=st.sampled_from([1e-6, 1.0, 1e3]))
def test_any_size_and_magnitude(comm, n, seed, dtype, scale):
    """Any bucket size and gradient magnitude: the master follows torch, the parameter is its
    rounding (a float16 gradient of 1e3 stays finite; the update is Adam's, scale-free)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    p = P(w.to(dtype))
    m = P(w.to(dtype).float())
    opt = coconet.optim.Adam([p], comm=comm, options=EAGER, lr=1e-3)
    ref = torch.optim.Adam([m], lr=1e-3)
    for _ in range(3):
        p.grad = (torch.randn(n, generator=g) * scale).to(dtype)
        m.grad = p.grad.float()
        opt.step()
        ref.step()
    master = opt.state_dict()["state"][0][MASTER_STATE_KEY]
    assert rel(master, m.detach()) < OPTIM_RTOL
    assert torch.equal(p.detach(), master.to(dtype))


def test_misuse_is_a_clear_error(comm):
    with pytest.raises(ConfigError, match="reduce_dtype=torch.int32"):
        coconet.optim.AdamW([P(torch.zeros(3))], comm=comm, reduce_dtype=torch.int32)
    with pytest.raises(ConfigError, match="reduce_dtype='bf16'"):
        coconet.optim.AdamW([P(torch.zeros(3))], comm=comm, reduce_dtype="bf16")
    with pytest.raises(ConfigError, match="float64 are not supported"):
        coconet.optim.AdamW([P(torch.zeros(3, dtype=torch.float64))], comm=comm)
    p = P(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="4 weights for the state dict's 1 parameters"):
        coconet.optim.with_master_weights(
            {"state": {}, "param_groups": [{"params": [0]}]}, [torch.zeros(1)] * 4)
    opt = coconet.optim.AdamW([p], comm=comm, options=EAGER)
    with pytest.raises(ConfigError, match="master_param"):
        opt.load_state_dict({"state": {0: {"master_param": torch.zeros(4)}},
                             "param_groups": opt.state_dict()["param_groups"]})


def scaled_steps(opt, params, ref, ref_params, dtype, steps, clip=None, inf_at=(2,),
                 unscale_first=False):  # fmt: skip
    """``steps`` steps of ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``
    for ``opt`` (gradients written as backward would: scaled, in the parameters' dtype) and
    torch's recipe for ``ref`` over float32 copies (unscale_, clip, step, update); an inf in
    the gradient at the steps ``inf_at``. Returns both scalers' scales after each step."""
    ours = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ours.scale(torch.ones(()))
    theirs.scale(torch.ones(()))
    scales = []
    for t in range(steps):
        gs = [grad(t, j, torch.float32) for j in range(len(params))]
        if t in inf_at:
            gs[-1].view(-1)[0] = float("inf")
        for p, q, g in zip(params, ref_params, gs, strict=True):
            p.grad = (g * ours.get_scale()).to(dtype)
            q.grad = (g * theirs.get_scale()).to(dtype).float()
        if unscale_first:
            ours.unscale_(opt)
        ours.step(opt)
        ours.update()
        theirs.unscale_(ref)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_params, clip)
        theirs.step(ref)
        theirs.update()
        scales.append((ours.get_scale(), theirs.get_scale()))
    return scales


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("groups", [1, 2], ids=["one-bucket", "two-buckets"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_grad_scaler_unscales_and_skips_inside_the_step(comm, dtype, groups, clip):
    """torch's AMP recipe unchanged: the step unscales inside the fused pass, a step with an
    inf is skipped with the parameters, state and step counts untouched, the scaler backs off
    and grows as torch's; float32 parameters (autocast's case) and float16 ones; one bucket
    (the speculative check) and two (the other bucket's norm first)."""
    torch.manual_seed(6)
    init = [torch.randn(s) for s in SHAPES[:2]]
    params = [P(w.to(dtype)) for w in init]
    ref_params = [P(w.to(dtype).float().clone()) for w in init]
    given = ([{"params": [p]} for p in params] if groups == 2 else params)
    opt = coconet.optim.AdamW(given, comm=comm, options=EAGER, lr=1e-2, max_grad_norm=clip)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    scales = scaled_steps(opt, params, ref, ref_params, dtype, 7, clip=clip)
    assert all(a == b for a, b in scales), scales
    assert scales[2][0] == scales[1][0] / 2  # backed off after the inf
    sd = opt.state_dict()["state"]
    assert float(sd[0]["step"]) == 6  # 7 steps, one skipped
    for j, q in enumerate(ref_params):
        weights = sd[j].get(MASTER_STATE_KEY, params[j].detach())
        assert rel(weights, q.detach()) < OPTIM_RTOL, j
        assert rel(sd[j]["exp_avg"], ref.state[q]["exp_avg"]) < OPTIM_RTOL, j


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
def test_grad_scaler_after_the_users_unscale(comm):
    """``scaler.unscale_(opt)`` before ``scaler.step(opt)`` (to log or clip the local
    gradient; torch refuses it for float16 gradients, so bfloat16 and float32 here): the step
    takes the gradients as unscaled, and still skips an inf."""
    torch.manual_seed(7)
    init = [torch.randn(s) for s in SHAPES[:2]]
    for dtype in (torch.bfloat16, torch.float32):
        params = [P(w.to(dtype)) for w in init]
        ref_params = [P(w.to(dtype).float().clone()) for w in init]
        opt = coconet.optim.AdamW(params, comm=comm, options=EAGER, lr=1e-2)
        ref = torch.optim.AdamW(ref_params, lr=1e-2)
        scales = scaled_steps(opt, params, ref, ref_params, dtype, 5, unscale_first=True)
        assert all(a == b for a, b in scales), scales
        sd = opt.state_dict()["state"]
        for j, q in enumerate(ref_params):
            assert rel(sd[j].get(MASTER_STATE_KEY, params[j].detach()), q.detach()) < OPTIM_RTOL


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_stochastic_rounding_keeps_updates_a_nearest_rounding_loses(comm, fused):
    """``rounding="stochastic"``: weights of 1.0 moved by 1e-4 a step (bfloat16's spacing below
    1 is 2**-8) never move in 10 steps when rounded to nearest; rounded stochastically they
    follow the master on average (unbiased), and the master itself is the same either way."""
    results = {}
    for rounding in ("nearest", "stochastic"):
        p = P(torch.ones(20000, dtype=torch.bfloat16))
        opt = coconet.optim.SGD([p], comm=comm, options=None if fused else EAGER, lr=1e-4,
                                rounding=rounding)  # fmt: skip
        for _ in range(10):
            p.grad = torch.ones_like(p)
            opt.step()
        master = opt.state_dict()["state"][0][MASTER_STATE_KEY]
        results[rounding] = (p.detach().double().mean().item(), master)
    nearest, stochastic = results["nearest"], results["stochastic"]
    assert nearest[0] == 1.0
    assert torch.equal(nearest[1], stochastic[1])
    expected = stochastic[1].double().mean().item()  # 1 - 10 * 1e-4
    assert abs(stochastic[0] - expected) < 3e-5, (stochastic[0], expected)


def test_stochastic_rounding_draws_the_same_bits_compiled_or_not(comm):
    """The counter-based bits inside Inductor's kernel (an integer view of the float32 pattern)
    are the simulator's: the compiled step's parameters equal the eager step's, bit for bit."""
    torch.manual_seed(8)
    w = torch.randn(4099)
    params = {}
    for fused in (False, True):
        p = P(w.to(torch.bfloat16))
        opt = coconet.optim.AdamW([p], comm=comm, options=None if fused else EAGER, lr=1e-3,
                                  rounding="stochastic")  # fmt: skip
        for t in range(3):
            p.grad = (torch.randn(4099, generator=torch.Generator().manual_seed(t))
                      ).to(torch.bfloat16)  # fmt: skip
            opt.step()
        params[fused] = p.detach().clone()
    assert torch.equal(params[False], params[True])


def test_rounding_misuse(comm):
    with pytest.raises(ConfigError, match="rounding='up' is not one of"):
        coconet.optim.AdamW([P(torch.zeros(3))], comm=comm, rounding="up")
    with pytest.raises(ConfigError, match="rounds into bfloat16 parameters, these are "
                                          "torch.float16"):
        coconet.optim.AdamW([P(torch.zeros(3, dtype=torch.float16))], comm=comm,
                            rounding="stochastic")
    # float32 parameters have nothing to round: accepted, a plain step
    coconet.optim.AdamW([P(torch.zeros(3))], comm=comm, rounding="stochastic")


def test_float16_without_a_scaler_warns_once_and_overflows_as_torch(comm):
    """The misuse table's last row: float16 parameters stepped without a GradScaler warn once
    (Float16WithoutScalerWarning), and an overflowing gradient then does what torch's optimizer
    over a float32 master does: the parameters become non-finite."""
    from coconet.optim.scaling import Float16WithoutScalerWarning

    p = P(torch.ones(4, dtype=torch.float16))
    m = P(torch.ones(4))
    opt = coconet.optim.AdamW([p], comm=comm, options=EAGER, lr=1e-2)
    ref = torch.optim.AdamW([m], lr=1e-2)
    p.grad = torch.full((4,), 70000.0).to(torch.float16)  # beyond float16's range: inf
    m.grad = p.grad.float()
    with pytest.warns(Float16WithoutScalerWarning, match="without torch.amp.GradScaler"):
        opt.step()
    ref.step()
    assert not torch.isfinite(p.detach()).any()
    assert not torch.isfinite(m.detach()).any()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", Float16WithoutScalerWarning)
        p.grad = torch.ones(4, dtype=torch.float16)
        opt.step()  # once per optimizer


def test_autocast_with_float32_parameters_is_todays_step(comm):
    """``torch.autocast`` (bfloat16 compute, float32 parameters): the gradients are float32, the
    step is the float32 one, equal to torch's AdamW on the same gradients."""
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    twin.load_state_dict(model.state_dict())
    opt = coconet.optim.AdamW(model.parameters(), comm=comm, options=EAGER, lr=1e-2)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for t in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
        for net, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x).float().pow(2).mean()
            loss.backward()
        for p in model.parameters():
            assert p.grad.dtype == torch.float32
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert rel(p.detach(), q.detach()) < OPTIM_RTOL
