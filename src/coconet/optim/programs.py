"""The DSL programs behind ``coconet.optim``: one step of each optimizer over a flat bucket.

Each reads this rank's gradient bucket ``g`` (Local), the parameters ``p`` and its state
(Replicated in the program; the schedules store the state sliced, ``as_slice``), and **host
scalars**: hyper-parameter arithmetic that torch does in Python floats (bias corrections, step
sizes, ``1 - lr * weight_decay``) is done by the optimizer on the host in float64 and passed as
float32 values, so that no float32 rounding of ``beta ** step`` enters the update (that alone
costs ~1e-6 relative after 20 steps). The elementwise maths is torch's, op for op, in the order
``torch.optim``'s single-tensor implementation writes it.

The gradient is all-reduced and scaled by ``grad_scale`` (``1 / world``: the average a DDP user
gets; negative for ``maximize``).
"""

from __future__ import annotations

from coconet import dsl as cc
from coconet.ir.program import Program
from coconet.ir.types import Dim, DType, Local, Replicated


def _bucket(dtype: DType, state: tuple[str, ...]):
    n = Dim("N")
    g = cc.Tensor("g", dtype, [n], Local)
    p = cc.Tensor("p", dtype, [n], Replicated)
    return g, p, [cc.Tensor(name, dtype, [n], Replicated) for name in state]


def adam(dtype: DType = DType.float32) -> Program:
    """torch.optim.Adam and AdamW (``amsgrad=False``), one program for both:

    ``d = avg(g) + weight_decay * p`` (Adam's L2; AdamW passes 0),
    ``m = beta1 m + (1 - beta1) d``, ``v = beta2 v + (1 - beta2) d d``,
    ``p = decay * p - step_size * m / (sqrt(v) / bc2_sqrt + eps)`` with
    ``decay = 1 - lr * weight_decay`` for AdamW (1 for Adam), ``step_size = lr / (1 - beta1 ** t)``
    and ``bc2_sqrt = sqrt(1 - beta2 ** t)``.
    """
    g, p, (m, v) = _bucket(dtype, ("m", "v"))
    names = (
        "grad_scale", "weight_decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
        "eps", "step_size", "bc2_sqrt", "decay",
    )
    s = {name: cc.Scalar(name) for name in names}
    g_sum = cc.all_reduce(g, name="g_sum")
    d = (g_sum * s["grad_scale"] + s["weight_decay"] * p).named("d_p")
    m_new = (s["beta1"] * m + s["one_minus_beta1"] * d).named("m_new")
    v_new = (s["beta2"] * v + s["one_minus_beta2"] * (d * d)).named("v_new")
    denom = (cc.sqrt(v_new) / s["bc2_sqrt"] + s["eps"]).named("denom")
    p_new = (s["decay"] * p - s["step_size"] * (m_new / denom)).named("p_new")
    return Program(
        "adam",
        [g, p, m, v, *s.values()],
        [cc.update(p, p_new), cc.update(m, m_new), cc.update(v, v_new)],
    )


def sgd(dtype: DType = DType.float32) -> Program:
    """torch.optim.SGD without momentum: ``p = p - lr * (avg(g) + weight_decay * p)``."""
    g, p, _ = _bucket(dtype, ())
    grad_scale, weight_decay, lr = (cc.Scalar(n) for n in ("grad_scale", "weight_decay", "lr"))
    g_sum = cc.all_reduce(g, name="g_sum")
    d = (g_sum * grad_scale + weight_decay * p).named("d_p")
    p_new = (p - lr * d).named("p_new")
    return Program("sgd", [g, p, grad_scale, weight_decay, lr], [cc.update(p, p_new)])


def sgd_momentum(dtype: DType = DType.float32) -> Program:
    """torch.optim.SGD with momentum: ``buf = buf_momentum * buf + buf_damp * d`` (on the first
    step ``buf_momentum = 0, buf_damp = 1``: torch starts the buffer at ``d``; then
    ``momentum, 1 - dampening``), ``p = p - lr * (a d + b buf)`` with ``(a, b) = (1, momentum)``
    for Nesterov and ``(0, 1)`` otherwise."""
    g, p, (buf,) = _bucket(dtype, ("buf",))
    names = ("grad_scale", "weight_decay", "buf_momentum", "buf_damp", "a", "b", "lr")
    s = {name: cc.Scalar(name) for name in names}
    g_sum = cc.all_reduce(g, name="g_sum")
    d = (g_sum * s["grad_scale"] + s["weight_decay"] * p).named("d_p")
    buf_new = (s["buf_momentum"] * buf + s["buf_damp"] * d).named("buf_new")
    direction = (s["a"] * d + s["b"] * buf_new).named("direction")
    p_new = (p - s["lr"] * direction).named("p_new")
    return Program(
        "sgd_momentum",
        [g, p, buf, *s.values()],
        [cc.update(p, p_new), cc.update(buf, buf_new)],
    )


# pytorch_optimizer.Lamb clamps the weight norm at this value (its class attribute ``clamp``).
LAMB_WEIGHT_NORM_CLAMP = 10.0


def lamb(dtype: DType = DType.float32) -> Program:
    """``pytorch_optimizer.Lamb`` (4.x; its defaults ``weight_decouple=True``, ``rectify=False``,
    ``adam=False``, ``pre_norm=False``) over **one parameter tensor**: its trust ratio is that
    tensor's (layer-wise), so ``coconet.optim.LAMB`` runs one program per parameter.

    ``m = beta1 m + beta3 g`` (``beta3 = 1 - beta1``, or 1 without grad averaging),
    ``v = beta2 v + (1 - beta2) g g``, ``p_d = decay p`` (``decay = 1 - lr weight_decay``: the
    decoupled decay, applied before the norms), ``u = m / (sqrt(v) + eps)`` (no bias correction
    of ``v``), ``w = min(decay |p|, 10)`` (``min(|p_d|, 10)`` up to one rounding), trust
    ``= w / (|u| + eps)`` (1 where ``w`` or ``|u|`` is 0; ``use_trust = 0`` for ``adam=True``),
    ``p = p_d - step_size trust u`` with ``step_size = lr / (1 - beta1 ** t)``.
    """
    g, p, (m, v) = _bucket(dtype, ("m", "v"))
    names = (
        "grad_scale", "beta1", "beta3", "beta2", "one_minus_beta2", "eps", "decay",
        "step_size", "use_trust",
    )
    s = {name: cc.Scalar(name) for name in names}
    g_sum = cc.all_reduce(g, name="g_sum")
    grad = (g_sum * s["grad_scale"]).named("grad")
    m_new = (s["beta1"] * m + s["beta3"] * grad).named("m_new")
    v_new = (s["beta2"] * v + s["one_minus_beta2"] * (grad * grad)).named("v_new")
    p_d = (s["decay"] * p).named("p_decayed")
    update = (m_new / (cc.sqrt(v_new) + s["eps"])).named("update")
    # |decay p| as decay |p| (decay > 0): the norm then reads only p, so a schedule computes it
    # before the gradient arrives (the same value up to one rounding)
    p_norm = (s["decay"] * cc.norm(p).named("p_norm_raw")).named("p_norm")
    weight_norm = cc.where(p_norm > LAMB_WEIGHT_NORM_CLAMP, LAMB_WEIGHT_NORM_CLAMP, p_norm)
    u_norm = cc.norm(update).named("u_norm")
    ratio = cc.where(u_norm > 0, weight_norm / (u_norm + s["eps"]), 1.0)
    trust = cc.where(weight_norm > 0, ratio, 1.0)
    trust = (s["use_trust"] * trust + (1 - s["use_trust"])).named("trust_ratio")
    p_new = (p_d - s["step_size"] * (trust * update)).named("p_new")
    return Program(
        "lamb",
        [g, p, m, v, *s.values()],
        [cc.update(p, p_new), cc.update(m, m_new), cc.update(v, v_new)],
    )
