"""A Hugging Face ``Trainer`` with ``coconet.optim.AdamW`` on 2 local ranks: the tutorial's program.

``Trainer`` takes any ``torch.optim.Optimizer`` through ``optimizers=(optimizer, scheduler)``,
and ``coconet.optim.AdamW`` is one. ``Trainer`` wraps the model in DDP whenever it sees torchrun's
variables (``WORLD_SIZE``, ``LOCAL_RANK``, ...); coconet then lets DDP's all_reduce be the one
reduction and updates without moving data. Here coconet's own step averages the gradients
instead (reduce_scatter, the update of this rank's slice, all_gather: one fused collective): each
rank joins the job with ``coconet.runtime.init()`` first, then runs an ordinary one-process
``Trainer`` on its own shard of the data, with torchrun's variables kept from it
(``one_process_trainer_env``), so there is no DDP wrapper. Two more settings follow:

- ``max_grad_norm=0`` for ``Trainer`` and ``max_grad_norm=1.0`` for the optimizer:
  ``Trainer``'s ``clip_grad_norm_`` would clip each rank's *local* gradient, before the average
  exists; coconet clips the averaged gradient by its global norm, inside the step;
- the batch a step sees is ``per_device_train_batch_size`` x ranks, as with DDP.

The model is a small GPT-2 built from a config (nothing is downloaded) trained on a synthetic
next-token task. The same training runs on one process over the whole batch with
``torch.optim.AdamW`` and ``clip_grad_norm_``, the reference the ranks must follow::

    coconet run --nproc 2 examples/hf_trainer.py

It needs ``transformers`` and ``accelerate`` (``pip install -e ".[tutorials]"``). Rank 0 prints
Trainer's log lines, then both runs' losses side by side and an ``ok`` or ``FAIL`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile

import torch

import coconet.optim
from coconet import runtime
from coconet.progress import phase

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_WORLD_SIZE")  # fmt: skip


@contextlib.contextmanager
def one_process_trainer_env():
    """torchrun's variables hidden while Trainer is built and trains (coconet averages the
    gradients; Trainer must not wrap the model in DDP), put back afterwards."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def model(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def dataset(n: int = 64, length: int = 32) -> list[dict]:
    """Sequences of a fixed random walk over 64 tokens (a next-token task a model can learn)."""
    gen = torch.Generator().manual_seed(7)
    steps = torch.randint(1, 4, (n, length), generator=gen)
    starts = torch.randint(0, 64, (n, 1), generator=gen)
    ids = (starts + steps.cumsum(1)) % 64
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: str, batch: int, steps: int, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        train_sampling_strategy="sequential",
        dataloader_drop_last=True, use_cpu=True, seed=0, **kw,
    )  # fmt: skip


def first_step_note(rank: int):
    """A TrainerCallback that says, on rank 0, that the first step compiles coconet's kernels
    (a few seconds cached, 10-35 s on a cold cache) and keeps saying so until it is done."""
    from transformers import TrainerCallback

    class FirstStep(TrainerCallback):
        def __init__(self) -> None:
            self.phase = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                self.phase = phase("step 1: coconet compiles its fused AdamW kernels",
                                   enabled=rank == 0)  # fmt: skip
                self.phase.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self.phase is not None:
                self.phase.__exit__(None, None, None)
                self.phase = None

    return FirstStep()


def losses_of(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# --8<-- [start:rank_run]
def rank_run(comm, args) -> list[float]:
    """This rank's Trainer over its shard: every rank sees its part of each global batch."""
    from transformers import PrinterCallback, Trainer

    data = dataset()
    # rank r takes rows r, r + world, ...: its share of each global batch of batch x world rows
    shard = data[comm.rank :: comm.world]
    net = model()
    opt = coconet.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0, max_grad_norm=1.0,
                              comm=comm)  # fmt: skip
    with tempfile.TemporaryDirectory() as out, one_process_trainer_env():
        trainer = Trainer(
            model=net,
            args=arguments(out, args.batch, args.steps, max_grad_norm=0.0,
                           disable_tqdm=True, log_level="error" if comm.rank else "warning"),
            train_dataset=shard,
            optimizers=(opt, None),
            callbacks=[first_step_note(comm.rank)],
        )  # fmt: skip
        if comm.rank != 0:
            trainer.remove_callback(PrinterCallback)  # rank 0 prints the log lines
        trainer.train()
    if comm.rank == 0:
        by = getattr(opt, "gradients_averaged_by", None)
        print("gradients averaged by " + (by or "coconet's fused step (no DDP wrapper)"),
              flush=True)  # fmt: skip
    # the logged loss is this rank's; the global batch's is the mean over the ranks
    local = torch.tensor(losses_of(trainer), dtype=torch.float64)
    torch.distributed.all_reduce(local)
    return (local / comm.world).tolist()
# --8<-- [end:rank_run]


def reference(args, world: int) -> list[float]:
    """One process, the whole batch (the ranks' shards interleaved back), torch.optim.AdamW."""
    from transformers import Trainer

    data = dataset()
    # the same global batches: rank r's k-th row is row k * world + r of the whole set
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    with tempfile.TemporaryDirectory() as out, one_process_trainer_env():
        trainer = Trainer(
            model=net,
            args=arguments(out, args.batch * world, args.steps, max_grad_norm=1.0,
                           disable_tqdm=True, log_level="error"),
            train_dataset=_global_order(data, world, args.batch),
            optimizers=(opt, None),
        )  # fmt: skip
        trainer.train()
    return losses_of(trainer)


def _global_order(data: list, world: int, batch: int) -> list:
    """``data`` reordered so that one process's batch k holds the rows the ranks' batch k hold."""
    shards = [data[r::world] for r in range(world)]
    out = []
    for k in range(len(shards[0]) // batch):
        for r in range(world):
            out.extend(shards[r][k * batch : (k + 1) * batch])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="relative, on the losses")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("examples/hf_trainer.py needs transformers and accelerate: "
              'pip install -e ".[tutorials]"', file=sys.stderr)  # fmt: skip
        return 2
    comm = runtime.init()  # first: the job, from torchrun's environment (`coconet run` sets it)
    torch.set_num_threads(1)
    # Trainer would warn, rightly for a DDP user, that the process group exists but it is not
    # running distributed: here that is the point (coconet.optim averages the gradients)
    transformers.utils.logging.set_verbosity_error()
    if comm.rank == 0:
        print(f"Trainer on {comm.world} ranks with coconet.optim.AdamW (max_grad_norm=1.0), "
              f"{args.steps} steps of {args.batch} x {comm.world} sequences", flush=True)
    ours = rank_run(comm, args)
    ok = True
    if comm.rank == 0:
        print("the reference: one process, the whole batch, torch.optim.AdamW", flush=True)
        ref = reference(args, comm.world)
        drift = max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))
        print(f"\n{'step':>4} {'1 process':>10} {'coconet':>10}")
        for k, (a, b) in enumerate(zip(ref, ours, strict=True)):
            print(f"{k + 1:>4} {a:>10.5f} {b:>10.5f}")
        ok = all(math.isfinite(x) for x in ours) and drift <= args.tolerance
        print(f"ok: Trainer with coconet.optim.AdamW follows one process ({drift:.1e} <= "
              f"{args.tolerance:g})" if ok else f"FAIL: the losses differ by {drift:.1e} "
              f"(tolerance {args.tolerance:g})")  # fmt: skip
    verdict = torch.tensor([0 if ok else 1])
    torch.distributed.broadcast(verdict, 0)
    runtime.shutdown(comm, exit_code=int(verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
