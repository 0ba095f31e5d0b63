"""The DSL programs behind ``coconet.optim``: one step of each optimizer over a flat bucket.

Each reads this rank's gradient bucket ``g`` (Local), the parameters ``p`` and its state
(Replicated in the program; the schedules store the state sliced, ``as_slice``), and **host
scalars**: hyper-parameter arithmetic that torch does in Python floats (bias corrections, step
sizes, ``1 - lr * weight_decay``) is done by the optimizer on the host in float64 and passed as
float32 values, so that no float32 rounding of ``beta ** step`` enters the update (that alone
costs ~1e-6 relative after 20 steps). The elementwise maths is torch's, op for op, in the order
``torch.optim``'s single-tensor implementation writes it.

The gradient is all-reduced and scaled by ``grad_scale`` (``1 / world``: the average a DDP user
gets; negative for ``maximize``; a GradScaler's ``1 / scale`` folded in).

**16-bit parameters** (``Precision``): the program's ``p`` and ``g`` are bfloat16 or float16,
and a float32 input ``master`` (after the state, stored sliced with it) holds the weights the
update reads and writes in float32; ``p`` is updated with the master's rounding (``cast``, or
``round_stochastic``), which the schedule's gather publishes. ``reduce=`` casts the gradient
before its all_reduce (a 16-bit sum accumulates in float32 and rounds once) and widens the sum
after it. float32 parameters without ``reduce=`` build the programs as they always were.

**Gradient clipping** (``max_grad_norm=``, ``Clip``): torch's ``clip_grad_norm_`` of the
averaged gradient, ``grad * min(max_norm / (||grad||_2 + 1e-6), 1)``. With ``Clip.IN_STEP`` the
norm is computed inside the step (the bucket is all the optimizer holds): a sum of squares of
the averaged gradient, which a schedule that slices the update turns into a sum over this
rank's slice after the reduce_scatter plus an all_reduce of one scalar; the program returns the
norm (``grad_norm``). With ``Clip.GIVEN`` (several buckets: the global norm needs every bucket's
gradient before any bucket is updated) the factor is a scalar input ``clip_coef`` computed from
``grad_norm_pass``, one step over every bucket's gradient run before the updates.
``Clip.SPECULATIVE`` is the unclipped update with the norm computed alongside it (output
``grad_norm``): under ``fuse_RS_C_AG`` one pass over shared memory, the partial sum of squares
in the same loop as the update and its scalar all_reduce over the control channel
(``Form.CONTROL``), so the gather stays published. The optimizer commits it only where the
factor is 1, which is the update clipping by 1 computes, bit for bit (``grad * 1.0`` is
``grad``), and otherwise declines it and steps again with ``Clip.GIVEN``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coconet import dsl as cc
from coconet.ir.program import Program
from coconet.ir.types import Dim, DType, Local, Replicated
from coconet.schedule import Schedule

# torch.nn.utils.clip_grad_norm_'s: clip_coef = max_norm / (total_norm + 1e-6)
CLIP_EPS = 1e-6


class Clip(enum.Enum):
    """How an optimizer's program clips the averaged gradient by its global norm."""

    OFF = "off"
    IN_STEP = "in-step"  # the norm computed in the step; scalar input max_norm, output grad_norm
    GIVEN = "given"  # the factor computed before the step; scalar input clip_coef
    # the update unclipped and the norm computed alongside it (output grad_norm), in one pass:
    # the optimizer commits it only when the factor is 1 and otherwise steps again, GIVEN
    SPECULATIVE = "speculative"


@dataclass(frozen=True)
class Precision:
    """The dtypes of a step: ``param``, the parameters' and their gradients' (a bucket's);
    ``reduce``, what the gradients are sent in (``reduce_dtype=``; the parameters' by default).
    The update is computed in ``math``: float32 for 16-bit parameters, which then keep an
    float32 master copy (input ``master``, stored sliced with the state: Megatron's
    distributed optimizer's layout) whose update is rounded to the parameters' dtype
    (round-to-nearest-even, ``Tensor.to``) and gathered."""

    param: DType = DType.float32
    reduce: DType = DType.float32
    # the master's rounding into the parameters is stochastic (``round_stochastic``, scalar
    # inputs ``round_seed`` and ``round_step``), not to nearest
    stochastic: bool = False

    @property
    def math(self) -> DType:
        return DType.float32 if self.param in _SIXTEEN else self.param

    @property
    def master(self) -> bool:
        """Whether the step keeps a float32 master copy of the parameters (16-bit ones)."""
        return self.param in _SIXTEEN

    @property
    def plain(self) -> bool:
        """float32 throughout: the programs as they always were (their digests, so caches)."""
        return self.param is self.reduce is DType.float32

    @classmethod
    def of(cls, param: DType, reduce: DType | None = None, stochastic: bool = False
           ) -> Precision:  # fmt: skip
        return cls(param, param if reduce is None else reduce, stochastic)


_SIXTEEN = (DType.float16, DType.bfloat16)

# The master copy's name as a program input and in a torch-format state dict (apex's
# FusedAdam(master_weights=True) and DeepSpeed keep theirs under a name of their own too).
MASTER = "master"
MASTER_STATE_KEY = "master_param"


def _clipped(grad: cc.Tensor, clip: Clip) -> tuple[cc.Tensor, list[cc.Tensor], dict]:
    """``grad`` clipped as ``clip`` says: (the clipped gradient, the extra scalar inputs, the
    extra outputs). The order of operations is torch's: the norm of the averaged gradient, the
    factor clamped at 1 (``torch.clamp(max=1.0)``: NaN stays NaN, as torch's), one multiply."""
    if clip is Clip.OFF:
        return grad, [], {}
    if clip is Clip.GIVEN:
        coef = cc.Scalar("clip_coef")
        return (grad * coef).named("grad_clipped"), [coef], {}
    norm = cc.sqrt(cc.sum(grad * grad).named("grad_sumsq")).named("grad_norm")
    if clip is Clip.SPECULATIVE:
        return grad, [], {"grad_norm": norm}
    max_norm = cc.Scalar("max_norm")
    coef = cc.clamp(max_norm / (norm + CLIP_EPS), max=1.0).named("clip_coef")
    return (grad * coef).named("grad_clipped"), [max_norm], {"grad_norm": norm}


def _averaged(g_sum: cc.Tensor, grad_scale: cc.Tensor, clip: Clip
              ) -> tuple[cc.Tensor, list[cc.Tensor], dict]:
    """The averaged gradient ``g_sum * grad_scale``, clipped as ``clip`` says."""
    if clip is Clip.OFF:
        return g_sum * grad_scale, [], {}  # (the expression as it always was: same digest)
    return _clipped((g_sum * grad_scale).named("grad"), clip)


def _name(base: str, clip: Clip, averaged: bool = False,
          precision: Precision | None = None) -> str:  # fmt: skip
    if precision is not None and not precision.plain:
        base = f"{base}_{precision.param.short}"
        if precision.reduce is not precision.param:
            base = f"{base}_reduce_{precision.reduce.short}"
        if precision.stochastic:
            base = f"{base}_sr"
    base = f"{base}_averaged" if averaged else base
    return base if clip is Clip.OFF else f"{base}_clip_{clip.name.lower()}"


def _summed(g: cc.Tensor, averaged: bool, precision: Precision | None = None) -> cc.Tensor:
    """The ranks' gradients summed (all_reduce), or ``g`` itself when a wrapper (DDP) averaged
    them already: then the optimizer's ``grad_scale`` is 1 (-1 for maximize), not 1 / world,
    and the step communicates nothing (every rank updates the whole bucket, as torch's
    optimizer behind DDP does).

    ``precision``: the gradients sent in ``precision.reduce`` (cast first where it is not
    theirs) and the sum taken up in the update's dtype (``precision.math``). A 16-bit
    reduction accumulates in float32 and rounds once (``semantics.reduce_values``: never a
    16-bit running sum), on every transport."""
    if precision is None:
        return g if averaged else cc.all_reduce(g, name="g_sum")
    if averaged:
        summed = g
    else:
        sent = g if precision.reduce is g.dtype else cc.cast(g, precision.reduce).named("g_sent")
        summed = cc.all_reduce(sent, name="g_sum")
    if summed.dtype is precision.math:
        return summed
    return cc.cast(summed, precision.math).named("g_sum_wide")


def _outputs(updates: list, extra: dict) -> list | dict:
    # unclipped programs keep their list of updates (their digest, so caches, stay the same)
    if not extra:
        return updates
    # (the keys of updates are not names: an update returns nothing)
    return {**extra, **{f"update_{i}": u for i, u in enumerate(updates)}}


def _bucket(dtype: DType, state: tuple[str, ...], rows: bool = False, averaged: bool = False,
            precision: Precision | None = None):
    # rows: a bucket of K parameter tensors of N elements each, one per row ([K, N]);
    # averaged: the gradient arrives averaged already (the same on every rank: Replicated).
    # Returns (g, p, state, w): ``w`` the weights the update reads and writes (``p``, or its
    # float32 master copy for 16-bit parameters, an input after the state)
    precision = precision or Precision.of(dtype)
    dims = [Dim("K"), Dim("N")] if rows else [Dim("N")]
    g = cc.Tensor("g", dtype, dims, Replicated if averaged else Local)
    p = cc.Tensor("p", dtype, dims, Replicated)
    math = precision.math
    states = [cc.Tensor(name, math, dims, Replicated) for name in state]
    if precision.master:
        states.append(cc.Tensor(MASTER, math, dims, Replicated))
        return g, p, states, states[-1]
    return g, p, states, p


def _written(p: cc.Tensor, w: cc.Tensor, w_new: cc.Tensor, precision: Precision
             ) -> tuple[list[cc.Tensor], list[cc.Tensor]]:  # fmt: skip
    """(the updates of the weights, the scalar inputs their rounding takes): ``p`` itself, or
    the master copy ``w`` and ``p`` its rounding to the parameters' dtype (what the gather
    publishes), to nearest or stochastically (``round_seed``, ``round_step``)."""
    if w is p:
        return [cc.update(p, w_new)], []
    if precision.stochastic:
        seed, step = cc.Scalar("round_seed", DType.int64), cc.Scalar("round_step", DType.int64)
        rounded = cc.round_stochastic(w_new, p.dtype, seed, step).named("p_rounded")
        return [cc.update(w, w_new), cc.update(p, rounded)], [seed, step]
    rounded = cc.cast(w_new, p.dtype).named("p_rounded")
    return [cc.update(w, w_new), cc.update(p, rounded)], []


def adam(dtype: DType = DType.float32, clip: Clip = Clip.OFF, averaged: bool = False,
         reduce: DType | None = None, stochastic: bool = False) -> Program:  # fmt: skip
    """torch.optim.Adam and AdamW (``amsgrad=False``), one program for both:

    ``d = avg(g) + weight_decay * p`` (Adam's L2; AdamW passes 0),
    ``m = beta1 m + (1 - beta1) d``, ``v = beta2 v + (1 - beta2) d d``,
    ``p = decay * p - step_size * m / (sqrt(v) / bc2_sqrt + eps)`` with
    ``decay = 1 - lr * weight_decay`` for AdamW (1 for Adam), ``step_size = lr / (1 - beta1 ** t)``
    and ``bc2_sqrt = sqrt(1 - beta2 ** t)``. ``clip``: ``avg(g)`` clipped by its norm first
    (see ``Clip``). ``dtype``: the parameters'; 16-bit ones are updated through a float32
    master copy (``Precision``); ``reduce``: the dtype the gradients are sent in;
    ``stochastic``: the master rounded into 16-bit parameters stochastically.
    """
    precision = Precision.of(dtype, reduce, stochastic)
    g, p, (m, v, *master), w = _bucket(dtype, ("m", "v"), averaged=averaged,
                                       precision=precision)  # fmt: skip
    names = (
        "grad_scale", "weight_decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
        "eps", "step_size", "bc2_sqrt", "decay",
    )
    s = {name: cc.Scalar(name) for name in names}
    g_sum = _summed(g, averaged, None if precision.plain else precision)
    grad, extra_in, extra_out = _averaged(g_sum, s["grad_scale"], clip)
    d = (grad + s["weight_decay"] * w).named("d_p")
    m_new = (s["beta1"] * m + s["one_minus_beta1"] * d).named("m_new")
    v_new = (s["beta2"] * v + s["one_minus_beta2"] * (d * d)).named("v_new")
    denom = (cc.sqrt(v_new) / s["bc2_sqrt"] + s["eps"]).named("denom")
    p_new = (s["decay"] * w - s["step_size"] * (m_new / denom)).named("p_new")
    written, rounding = _written(p, w, p_new, precision)
    return Program(
        _name("adam", clip, averaged, precision),
        [g, p, m, v, *master, *s.values(), *extra_in, *rounding],
        _outputs([*written, cc.update(m, m_new), cc.update(v, v_new)], extra_out),
    )


def sgd(dtype: DType = DType.float32, clip: Clip = Clip.OFF, averaged: bool = False,
        reduce: DType | None = None, stochastic: bool = False) -> Program:  # fmt: skip
    """torch.optim.SGD without momentum: ``p = p - lr * (avg(g) + weight_decay * p)``
    (``dtype``, ``reduce``, ``stochastic``: as ``adam``'s)."""
    precision = Precision.of(dtype, reduce, stochastic)
    g, p, master, w = _bucket(dtype, (), averaged=averaged, precision=precision)
    grad_scale, weight_decay, lr = (cc.Scalar(n) for n in ("grad_scale", "weight_decay", "lr"))
    g_sum = _summed(g, averaged, None if precision.plain else precision)
    grad, extra_in, extra_out = _averaged(g_sum, grad_scale, clip)
    d = (grad + weight_decay * w).named("d_p")
    p_new = (w - lr * d).named("p_new")
    written, rounding = _written(p, w, p_new, precision)
    return Program(_name("sgd", clip, averaged, precision),
                   [g, p, *master, grad_scale, weight_decay, lr, *extra_in, *rounding],
                   _outputs(written, extra_out))


def sgd_momentum(dtype: DType = DType.float32, clip: Clip = Clip.OFF,
                 averaged: bool = False, reduce: DType | None = None,
                 stochastic: bool = False) -> Program:  # fmt: skip
    """torch.optim.SGD with momentum: ``buf = buf_momentum * buf + buf_damp * d`` (on the first
    step ``buf_momentum = 0, buf_damp = 1``: torch starts the buffer at ``d``; then
    ``momentum, 1 - dampening``), ``p = p - lr * (a d + b buf)`` with ``(a, b) = (1, momentum)``
    for Nesterov and ``(0, 1)`` otherwise (``dtype``, ``reduce``, ``stochastic``: as
    ``adam``'s)."""
    precision = Precision.of(dtype, reduce, stochastic)
    g, p, (buf, *master), w = _bucket(dtype, ("buf",), averaged=averaged, precision=precision)
    names = ("grad_scale", "weight_decay", "buf_momentum", "buf_damp", "a", "b", "lr")
    s = {name: cc.Scalar(name) for name in names}
    g_sum = _summed(g, averaged, None if precision.plain else precision)
    grad, extra_in, extra_out = _averaged(g_sum, s["grad_scale"], clip)
    d = (grad + s["weight_decay"] * w).named("d_p")
    buf_new = (s["buf_momentum"] * buf + s["buf_damp"] * d).named("buf_new")
    direction = (s["a"] * d + s["b"] * buf_new).named("direction")
    p_new = (w - s["lr"] * direction).named("p_new")
    written, rounding = _written(p, w, p_new, precision)
    return Program(
        _name("sgd_momentum", clip, averaged, precision),
        [g, p, buf, *master, *s.values(), *extra_in, *rounding],
        _outputs([*written, cc.update(buf, buf_new)], extra_out),
    )


# pytorch_optimizer.Lamb clamps the weight norm at this value (its class attribute ``clamp``).
LAMB_WEIGHT_NORM_CLAMP = 10.0


def lamb(dtype: DType = DType.float32, clip: Clip = Clip.OFF, rows: bool = False,
         averaged: bool = False, reduce: DType | None = None,
         stochastic: bool = False) -> Program:  # fmt: skip
    """``pytorch_optimizer.Lamb`` (4.x; its defaults ``weight_decouple=True``, ``rectify=False``,
    ``adam=False``, ``pre_norm=False``) over **one parameter tensor**: its trust ratio is that
    tensor's (layer-wise), so ``coconet.optim.LAMB`` runs it per tensor (or ``rows=True``,
    below, over tensors of one size).

    ``m = beta1 m + beta3 g`` (``beta3 = 1 - beta1``, or 1 without grad averaging),
    ``v = beta2 v + (1 - beta2) g g``, ``p_d = decay p`` (``decay = 1 - lr weight_decay``: the
    decoupled decay, applied before the norms), ``u = m / (sqrt(v) + eps)`` (no bias correction
    of ``v``), ``w = min(decay |p|, 10)`` (``min(|p_d|, 10)`` up to one rounding), trust
    ``= w / (|u| + eps)`` (1 where ``w`` or ``|u|`` is 0; ``use_trust = 0`` for ``adam=True``),
    ``p = p_d - step_size trust u`` with ``step_size = lr / (1 - beta1 ** t)``. ``clip``: Lamb's
    ``pre_norm`` (``Clip.GIVEN``: the gradient times the factor of its global norm).

    ``rows=True``: the same over **K parameter tensors of N elements each**, one per row of
    ``[K, N]`` inputs, each row's norms its own (``norm(dim=1)``): many tensors in one step.
    Sliced by rows (``fuse_RS_C_AG``), a rank updates whole tensors, so their norms need no
    collective: the step is one pass over shared memory (the flat program's norms over a
    sliced tensor are partial sums and an all_reduce each, which cut it in two).

    ``dtype``, ``reduce``, ``stochastic``: as ``adam``'s (the norms are the float32 master
    copy's).
    """
    precision = Precision.of(dtype, reduce, stochastic)
    g, p, (m, v, *master), w = _bucket(dtype, ("m", "v"), rows, averaged, precision)
    # the per-tensor norms: whole (flat), or each row's, kept as a column to scale its row
    over = {"dim": 1, "keepdim": True} if rows else {}
    names = (
        "grad_scale", "beta1", "beta3", "beta2", "one_minus_beta2", "eps", "decay",
        "step_size", "use_trust",
    )
    s = {name: cc.Scalar(name) for name in names}
    g_sum = _summed(g, averaged, None if precision.plain else precision)
    grad = (g_sum * s["grad_scale"]).named("grad")
    grad, extra_in, extra_out = _clipped(grad, clip)
    m_new = (s["beta1"] * m + s["beta3"] * grad).named("m_new")
    v_new = (s["beta2"] * v + s["one_minus_beta2"] * (grad * grad)).named("v_new")
    p_d = (s["decay"] * w).named("p_decayed")
    update = (m_new / (cc.sqrt(v_new) + s["eps"])).named("update")
    # |decay p| as decay |p| (decay > 0): the norm then reads only p, so a schedule computes it
    # before the gradient arrives (the same value up to one rounding)
    p_norm = (s["decay"] * cc.norm(w, **over).named("p_norm_raw")).named("p_norm")
    weight_norm = cc.where(p_norm > LAMB_WEIGHT_NORM_CLAMP, LAMB_WEIGHT_NORM_CLAMP, p_norm)
    u_norm = cc.norm(update, **over).named("u_norm")
    ratio = cc.where(u_norm > 0, weight_norm / (u_norm + s["eps"]), 1.0)
    ratio = cc.where(weight_norm > 0, ratio, 1.0).named("trust_ratio")
    trust = (s["use_trust"] * ratio + (1 - s["use_trust"])).named("trust")
    p_new = (p_d - s["step_size"] * (trust * update)).named("p_new")
    # Lamb's per-tensor diagnostics, which it keeps in each parameter's state (users log them):
    # the clamped weight norm, the update's norm and the trust ratio (before adam=True drops it).
    # A flat bucket's are scalars the step has anyway (its norms are all-reduced); a bucket of
    # rows would have to gather them, which would cut its one pass: coconet.optim.LAMB computes
    # those on the host from the rows each rank holds whole (LAMB.after_bucket)
    diagnostics = {} if rows else {"weight_norm": weight_norm.named("weight_norm"),
                                   "adam_norm": u_norm, "trust_ratio": ratio}  # fmt: skip
    written, rounding = _written(p, w, p_new, precision)
    return Program(
        _name("lamb_rows" if rows else "lamb", clip, averaged, precision),
        [g, p, m, v, *master, *s.values(), *extra_in, *rounding],
        _outputs([*written, cc.update(m, m_new), cc.update(v, v_new)],
                 {**extra_out, **diagnostics}),
    )


def grad_norm_pass(dtype: DType | tuple[DType, ...], buckets: int,
                   reduce: DType | None = None) -> Program:  # fmt: skip
    """The global norm of the averaged gradient over ``buckets`` flat gradient buckets (inputs
    ``g0``, ``g1``, ..., Local; ``grad_scale``): each bucket reduce_scattered and scaled
    (``avg(g)``'s slice on this rank, as the update's step computes it), the squares of every
    slice summed here, one all_reduce of that scalar, its square root (output ``grad_norm``).
    Written sliced (no all_gather: nothing needs the whole average); ``grad_norm_pass_schedule``
    fuses each bucket's reduce_scatter with its squares' sum (one pass over the peers' slices,
    nothing written). The optimizer runs it before the buckets' updates (``Clip.GIVEN``) when it
    holds more than one bucket. ``dtype``: the buckets' (one for all, or one each); 16-bit
    gradients and ``reduce`` as the update's step takes them (``_summed``): reduced in
    ``reduce``, squared in float32."""
    dtypes = (dtype,) * buckets if isinstance(dtype, DType) else tuple(dtype)
    grad_scale = cc.Scalar("grad_scale")
    gs = [cc.Tensor(f"g{j}", dtypes[j], [Dim(f"N{j}")], Local) for j in range(buckets)]
    total = None
    for j, g in enumerate(gs):
        sent = g
        if reduce is not None and reduce is not g.dtype:
            sent = cc.cast(g, reduce).named(f"g{j}_sent")
        rs = cc.reduce_scatter(sent, name=f"g{j}_rs")
        if rs.dtype is not DType.float32:
            rs = cc.cast(rs, DType.float32).named(f"g{j}_wide")
        part = (rs * grad_scale).named(f"grad{j}_slice")
        sumsq = cc.sum((part * part).named(f"sq{j}_slice")).named(f"sumsq{j}_partial")
        total = sumsq if total is None else (total + sumsq).named(f"sumsq_upto{j}_partial")
    norm = cc.sqrt(cc.all_reduce(total, name="sumsq")).named("grad_norm")
    return Program("grad_norm_pass", [*gs, grad_scale], {"grad_norm": norm})


def grad_norm_pass_schedule(program: Program) -> Schedule:
    """``grad_norm_pass``'s schedule: each bucket's reduce_scatter fused with the scaling, the
    squares and their sum (a fused collective; over shared memory one pass that reads every
    peer's slice and writes only the partial sum), the scalar adds and the all_reduce as they
    are."""
    s = Schedule(program, "fuse_RS_sumsq")
    names = {n.name for n in program.nodes}
    j = 0
    while f"g{j}" in names:
        wide = [f"g{j}_wide"] if f"g{j}_wide" in names else []
        s.fuse([f"g{j}_rs", *wide, f"grad{j}_slice", f"sq{j}_slice", f"sumsq{j}_partial"])
        j += 1
    return s
