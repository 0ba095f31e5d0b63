"""A ``transformers.Trainer`` script as a user writes it, with ``coconet.optim.AdamW`` or
torch's AdamW (``sys.argv[1]``); run by tests/dist/test_dist_optim_contracts.py under
``coconet run --nproc 2``. Prints the logged losses of rank 0 (``LOSSES <which> [...]``)."""

from __future__ import annotations

import json
import sys
import tempfile
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import coconet.optim
import coconet.runtime

warnings.filterwarnings("ignore", category=FutureWarning)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def main(which: str) -> None:
    comm = coconet.runtime.init()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
            learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            lr_scheduler_type="constant", weight_decay=0.0, disable_tqdm=True,
        )  # fmt: skip
        if which == "coconet":
            opt = coconet.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, comm=comm)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          optimizers=(opt, schedule))  # fmt: skip
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if comm.rank == 0:
        print("LOSSES", which, json.dumps(losses))
        if which == "coconet":
            print(f"gradients averaged by {opt.gradients_averaged_by}")


if __name__ == "__main__":
    main(sys.argv[1])
