"""Greedy decoding with ``train_gpt.py``'s GPT split over the ranks, token by token with a KV cache.

The model is trained briefly on one process (so that it predicts something), then every rank
builds the tensor-parallel model from the same weights (``train_gpt_tp.tensor_parallel``: each
block's attention holds ``heads / tp`` heads and their KV cache; the MLP its hidden slice), runs
the prompt once (prefill) and then one token per step, each attending to the cached keys and
values. The reference is one process recomputing the whole sequence for every token, no cache.
Every generated token must be the reference's::

    python examples/generate_tp.py                   # TP = 2
    python examples/generate_tp.py --world 4

The exit status is non-zero if any token differs.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_gpt  # noqa: E402
import train_gpt_tp  # noqa: E402


def trained(cfg: train_gpt.Config, steps: int) -> train_gpt.GPT:
    """The model after ``steps`` AdamW steps on one process (deterministic)."""
    data = train_gpt.corpus()
    net = train_gpt.model(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    for k in range(steps):
        x, y = train_gpt.batch(data, cfg, k)
        opt.zero_grad()
        train_gpt.loss_of(net, x, y).backward()
        opt.step()
    return net


def prompt(cfg: train_gpt.Config, length: int) -> torch.Tensor:
    return train_gpt.corpus()[100 : 100 + length].unsqueeze(0)


def reference(net: train_gpt.GPT, idx: torch.Tensor, new: int) -> list[int]:
    """One process, no cache: the whole sequence again for every token."""
    out = []
    with torch.no_grad():
        for _ in range(new):
            nxt = int(net(idx)[0, -1].argmax())
            out.append(nxt)
            idx = torch.cat([idx, torch.tensor([[nxt]])], dim=1)
    return out


def ranks(comm, cfg: train_gpt.Config, train_steps: int, prompt_len: int, new: int) -> dict:
    net = train_gpt_tp.tensor_parallel(trained(cfg, train_steps), comm).eval()
    caches = [b.attn.new_cache() for b in net.blocks]

    def logits(tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = net.tok(tokens) + net.pos(torch.arange(start, start + tokens.shape[1]))
        for block, cache in zip(net.blocks, caches, strict=True):
            x = block(x, cache=cache)
        return net.head(net.ln(x))

    idx = prompt(cfg, prompt_len)
    out, ms = [], []
    with torch.inference_mode():
        last = logits(idx, 0)[0, -1]  # the prefill: the whole prompt once
        for k in range(new):
            nxt = int(last.argmax())
            out.append(nxt)
            if k + 1 == new:
                break
            t0 = time.perf_counter()
            last = logits(torch.tensor([[nxt]]), prompt_len + k)[0, -1]
            ms.append((time.perf_counter() - t0) * 1e3)
    return {"tokens": out, "ms": ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--new", type=int, default=24, help="tokens to generate")
    ap.add_argument("--train-steps", type=int, default=80)
    ap.add_argument("--d-model", type=int, default=train_gpt.Config.d_model)
    ap.add_argument("--layers", type=int, default=train_gpt.Config.layers)
    args = ap.parse_args(argv)
    cfg = replace(train_gpt.Config(), d_model=args.d_model, layers=args.layers, world=args.world)
    if args.prompt + args.new > cfg.seq:
        ap.error(f"--prompt + --new must be at most the model's {cfg.seq} positions")
    from coconet.runtime import CommOptions, spawn

    res = spawn(ranks, args.world, cfg, args.train_steps, args.prompt, args.new,
                options=CommOptions(timeout=300), timeout=1200)  # fmt: skip
    want = reference(trained(cfg, args.train_steps), prompt(cfg, args.prompt), args.new)
    got = res[0]["tokens"]
    agree = all(r["tokens"] == got for r in res)
    text = bytes(prompt(cfg, args.prompt)[0].tolist()).decode(errors="replace")
    print(f"prompt {text!r}")
    print(f"tp={args.world}: {bytes(got).decode(errors='replace')!r}")
    print(f"one process: {bytes(want).decode(errors='replace')!r}")
    if res[0]["ms"]:
        med = sorted(res[0]["ms"])[len(res[0]["ms"]) // 2]
        print(f"per-token latency (rank 0, median of {len(res[0]['ms'])}): {med:.1f} ms")
    same = got == want and agree
    print("token for token equal to one process" if same else "DIFFERENT from one process")
    print(f"{len(set(got))} distinct tokens")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
