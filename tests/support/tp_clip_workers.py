"""Rank bodies for tests/dist/test_dist_tp_clip.py: gradient clipping of a tensor-parallel model
by the global norm, with torch's own ``clip_grad_norm_`` (on the parallelized model) and with
``coconet.optim``'s ``max_grad_norm=`` over the data-parallel group of a ``dp x tp`` mesh,
against the same model on one process."""

from __future__ import annotations

import copy

import torch

from coconet.errors import ConfigError

MLP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
BLOCK_PLAN = {**MLP_PLAN, "transformer.h.*.attn": "attention"}
MAX_NORM = 0.5  # below the gradient's norm at every step here: every step clips
# AdamW's eps: the attention's key bias has a gradient that is zero but for rounding (softmax
# does not see it), which eps=1e-8 would turn into lr-sized steps of noise on either side
ADAMW = {"lr": 1e-2, "eps": 1e-3}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _models(comm, plan: dict, seed: int = 3):
    from coconet.nn import parallelize
    from support.nanogpt import GPT, GPTConfig

    torch.manual_seed(seed)
    reference = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=16))
    model = parallelize(copy.deepcopy(reference), comm, plan, axis="tp" if "tp" in
                        comm.mesh.names else None)  # fmt: skip
    return model, reference


def _batch(step: int, rows: int):
    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 32, (rows, 16), generator=gen)
    return idx, torch.randint(0, 32, (rows, 16), generator=gen)


def _replicated(model) -> list[tuple[str, torch.Tensor]]:
    from coconet.runtime.shards import placement_of

    return [(n, p) for n, p in model.named_parameters() if placement_of(p) is None]


def _whole(model, reference) -> dict[str, float]:
    """Every parallelized weight gathered against the reference's."""
    errors = {}
    for i, block in enumerate(model.transformer.h):
        ref = reference.transformer.h[i]
        errors[f"h.{i}.c_fc"] = _err(block.mlp.c_fc.to_full().weight, ref.mlp.c_fc.weight)
        errors[f"h.{i}.c_proj"] = _err(block.mlp.c_proj.to_full().weight, ref.mlp.c_proj.weight)
        if hasattr(block.attn, "to_full"):
            errors[f"h.{i}.c_attn"] = _err(block.attn.to_full()[0].weight, ref.attn.c_attn.weight)
    return errors


def _compared(model, reference, errors: dict[str, float], clipped: int) -> dict:
    """Every weight and replicated parameter against the reference's, and the replicated
    parameters' bits (to compare across the ranks)."""
    errors.update(_whole(model, reference))
    ref_params = dict(reference.named_parameters())
    for name, p in _replicated(model):
        # (ParallelSelfAttention names nanoGPT's c_proj proj)
        errors[name] = _err(p, ref_params[name.replace(".attn.proj.", ".attn.c_proj.")])
    bits = [p.detach().numpy().tobytes() for _, p in _replicated(model)]
    return {"errors": errors, "clipped": clipped, "bits": bits}


def torch_clip_on_a_parallelized_model(comm, plan_name: str, foreach: bool | None = None,
                                       steps: int = 5) -> dict:  # fmt: skip
    """nanoGPT's own lines on a parallelized model: ``clip_grad_norm_(model.parameters(), c)``
    then ``torch.optim.AdamW``. The norm each rank gets, the weights and the replicated
    parameters (LayerNorms, embeddings) against one process; the replicated parameters'
    bits, to compare across the ranks."""
    plan = BLOCK_PLAN if plan_name == "block" else MLP_PLAN
    model, reference = _models(comm, plan)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    errors: dict[str, float] = {}
    clipped = 0
    for step in range(steps):
        idx, targets = _batch(step, 4)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(idx, targets).backward()
        # foreach=True: torch's _foreach_norm over every gradient at once (one round per group)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=foreach)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        clipped += bool(ref_norm > MAX_NORM)
        errors[f"norm step {step}"] = _err(norm, ref_norm)
        opt.step()
        ref_opt.step()
    return _compared(model, reference, errors, clipped)


def dp_x_tp_max_grad_norm(comm, steps: int = 4) -> dict:
    """Mesh(dp=2, tp=2): ``coconet.optim.AdamW(..., comm=comm.along("dp"), max_grad_norm=c)``
    over each replica group, the layers over tp; each replica takes half of every batch. The
    norm (``last_grad_norm``), the losses and the weights against one process stepping the
    whole batch with clip_grad_norm_ and torch's AdamW."""
    import coconet.optim

    model, reference = _models(comm, BLOCK_PLAN)
    replica = comm.mesh.index_in(comm.rank, "dp")
    opt = coconet.optim.AdamW(model.parameters(), comm=comm.along("dp"), max_grad_norm=MAX_NORM,
                              **ADAMW)  # fmt: skip
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    errors: dict[str, float] = {}
    clipped = 0
    for step in range(steps):
        idx, targets = _batch(step, 4)
        share = 4 // comm.mesh.axis_size("dp")
        mine = slice(share * replica, share * (replica + 1))
        opt.zero_grad()
        loss = model(idx[mine], targets[mine])
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        clipped += bool(ref_norm > MAX_NORM)
        errors[f"norm step {step}"] = _err(opt.last_grad_norm, ref_norm)
    return _compared(model, reference, errors, clipped)


def refusals(comm) -> dict[str, str]:
    """Mesh(dp=2, tp=2): an optimizer over the whole world (it would average different parts of
    one tensor) and LAMB (its trust ratio needs each whole tensor's norms) are refused."""
    import coconet.optim

    model, _ = _models(comm, BLOCK_PLAN)
    out = {}
    for name, make in (
        ("whole world", lambda: coconet.optim.AdamW(model.parameters(), comm=comm)),
        ("lamb", lambda: coconet.optim.LAMB(model.parameters(), comm=comm.along("dp"))),
    ):
        try:
            make()
            out[name] = "accepted"
        except ConfigError as e:
            out[name] = str(e)
    return out


def replicated_drift(comm) -> dict:
    """A replicated parameter (a LayerNorm's weight) changed on rank 1 only: the next training
    forward fails on every rank with a ConfigError naming it; eval-mode forwards are not
    checked; the training forwards before the drift were (one check each)."""
    model, _ = _models(comm, BLOCK_PLAN)
    idx, targets = _batch(0, 2)
    out: dict = {}
    model(idx, targets).backward()  # checked: the same everywhere
    model.eval()
    with torch.no_grad():
        model(idx, targets)
    model.train()
    check = model.transformer.h[0].mlp.c_fc._replicas
    out["checks before"] = check.checks
    if comm.rank == 1:
        with torch.no_grad():
            model.transformer.h[1].ln_2.weight.mul_(1.001)
    try:
        model(idx, targets)
        out["error"] = None
    except ConfigError as e:
        out["error"] = str(e)
    return out


def dp_x_tp_fully_sharded(comm, clip: float | None = None, steps: int = 4) -> dict:
    """Mesh(dp=2, tp=2): the tensor-parallel model fully sharded over each replica group
    (``coconet.fsdp.fully_shard(model, comm=comm.along("dp"))``: every block's parameters, the
    tp parts included, stored 1/dp per rank) and ``coconet.optim.AdamW`` over it, each replica
    half of every batch; ``clip``: ``max_grad_norm=``, whose norm sums the parts' squares over
    tp too. The weights against one process."""
    import coconet.fsdp
    import coconet.optim

    model, reference = _models(comm, BLOCK_PLAN)
    dp = comm.along("dp")
    fs = coconet.fsdp.fully_shard(model, comm=dp, blocks=model.transformer.h)
    extra = {} if clip is None else {"max_grad_norm": clip}
    opt = coconet.optim.AdamW(model.parameters(), comm=dp, **ADAMW, **extra)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    replica = comm.mesh.index_in(comm.rank, "dp")
    errors: dict[str, float] = {}
    clipped = 0
    for step in range(steps):
        idx, targets = _batch(step, 4)
        share = 4 // comm.mesh.axis_size("dp")
        mine = slice(share * replica, share * (replica + 1))
        opt.zero_grad()
        model(idx[mine], targets[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        reference(idx, targets).backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            clipped += bool(ref_norm > clip)
            errors[f"norm step {step}"] = _err(opt.last_grad_norm, ref_norm)
        ref_opt.step()
    with fs.gathered():
        return _compared(model, reference, errors, clipped)
