"""Greedy decoding with ``train_gpt.py``'s GPT split over the ranks, token by token with a KV cache.

The model is trained briefly on one process (so that it predicts something), on one thread
whatever the machine (the weights do not depend on the machine's thread count), and those weights
are handed to every rank, which builds the tensor-parallel model from them
(``train_gpt_tp.tensor_parallel``: each block's attention holds ``heads / tp`` heads and their KV
cache; the MLP its hidden slice), runs the prompt once (prefill) and then one token per step,
each attending to the cached keys and values. The reference is one process recomputing the
whole sequence for every token, no cache. Every generated token must be the reference's::

    python examples/generate_tp.py                   # TP = 2: 15-30 s on 2 cores
    python examples/generate_tp.py --world 4

The reference and the ranks decode from the very same weights, so what is compared is the
decoding alone (the KV cache, the heads split over the ranks, the row-parallel all_reduces), not
two trainings whose float32 sums ran on different thread counts: those part after 80 AdamW steps
by enough to flip a greedy argmax. It prints each phase as it starts, then the two texts and an
``ok`` or ``FAIL`` line; the exit status is non-zero if any token differs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_gpt  # noqa: E402
import train_gpt_tp  # noqa: E402

from coconet.progress import phase, say  # noqa: E402


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def trained(cfg: train_gpt.Config, steps: int, report: bool = False) -> train_gpt.GPT:
    """The model after ``steps`` AdamW steps on one process, on one thread: the same weights on
    any machine (float32 sums split over threads round differently with the thread count)."""
    data = train_gpt.corpus()
    net = train_gpt.model(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    shown = time.perf_counter()
    with threads(1):
        for k in range(steps):
            x, y = train_gpt.batch(data, cfg, k)
            opt.zero_grad()
            loss = train_gpt.loss_of(net, x, y)
            loss.backward()
            opt.step()
            if report and (time.perf_counter() - shown > 2.0 or k + 1 == steps):
                shown = time.perf_counter()
                say(f"  step {k + 1}/{steps}: loss {loss.item():.3f}")
    return net


def weights(net: torch.nn.Module) -> bytes:
    """``net``'s state dict as bytes, for the ranks (plain bytes pickle without shared memory)."""
    buf = io.BytesIO()
    torch.save(net.state_dict(), buf)
    return buf.getvalue()


def from_weights(cfg: train_gpt.Config, blob: bytes) -> train_gpt.GPT:
    net = train_gpt.model(cfg)
    net.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
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


def ranks(comm, cfg: train_gpt.Config, blob: bytes, prompt_len: int, new: int) -> dict:
    net = train_gpt_tp.tensor_parallel(from_weights(cfg, blob), comm).eval()
    caches = [b.attn.new_cache() for b in net.blocks]

    def logits(tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = net.tok(tokens) + net.pos(torch.arange(start, start + tokens.shape[1]))
        for block, cache in zip(net.blocks, caches, strict=True):
            x = block(x, cache=cache)
        return net.head(net.ln(x))

    idx = prompt(cfg, prompt_len)
    out, ms = [], []
    with torch.inference_mode():
        with phase("the prefill (rank 0): each layer's first call compiles its steps",
                   enabled=comm.rank == 0):  # fmt: skip
            last = logits(idx, 0)[0, -1]  # the prefill: the whole prompt once
        if comm.rank == 0:
            say(f"decoding {new} tokens, one step each with the KV cache")
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

    params = sum(p.numel() for p in train_gpt.model(cfg).parameters())
    say(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, {params:,} "
        f"parameters; greedy decoding of {args.new} tokens after a {args.prompt}-token prompt, "
        f"tensor parallel over {args.world} ranks")
    with phase(f"training the model on one process, one thread ({args.train_steps} AdamW "
               "steps), so that it predicts something"):  # fmt: skip
        net = trained(cfg, args.train_steps, report=True)
    with phase(f"decoding on {args.world} ranks (tensor parallel, KV cache) from those "
               "weights"):  # fmt: skip
        res = spawn(ranks, args.world, cfg, weights(net), args.prompt, args.new,
                    options=CommOptions(timeout=300), timeout=1200)  # fmt: skip
    with phase("the reference: one process, the whole sequence again for every token"):
        want = reference(net, prompt(cfg, args.prompt), args.new)
    got = res[0]["tokens"]
    agree = all(r["tokens"] == got for r in res)
    text = bytes(prompt(cfg, args.prompt)[0].tolist()).decode(errors="replace")
    say(f"\nprompt {text!r}")
    say(f"tp={args.world}: {bytes(got).decode(errors='replace')!r}")
    say(f"one process: {bytes(want).decode(errors='replace')!r}")
    if res[0]["ms"]:
        med = sorted(res[0]["ms"])[len(res[0]["ms"]) // 2]
        say(f"per-token latency (rank 0, median of {len(res[0]['ms'])}): {med:.1f} ms")
    same = got == want and agree
    say(f"{len(set(got))} distinct tokens")
    if same:
        say(f"ok: token for token equal to one process ({args.new} tokens, tp={args.world})")
        return 0
    first = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    say("FAIL: DIFFERENT from one process" + (
        f" from token {first + 1} on" if first is not None else ": the ranks disagree"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
