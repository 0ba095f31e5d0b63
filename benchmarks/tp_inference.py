"""Tensor-parallel inference where the shapes change: a nanoGPT-style model whose context grows.

A GPT written the way nanoGPT writes it (``tests/support/nanogpt.py``: ``c_attn``, ``c_proj``,
``c_fc``, pre-LayerNorm blocks, flash attention), parallelized as a new user does it —
``coconet.nn.parallelize(model, comm, {"transformer.h.*.attn": "attention", "*.mlp.c_fc":
"colwise", "*.mlp.c_proj": "rowwise"})`` — on 2 local ranks x 1 torch thread (both cores), next
to the same model on one process (rank 0, one thread; rank 1 idles): eval mode, no grad, float32.

Every layer call of a parallelized model is a compiled step whose ranks agree on their input
shapes (``coconet.runtime.handshake``). A decoder's context grows by a token at a time, so its
shapes change at every call: this measures what that costs. Phases, per model, after a warm-up
at other lengths (the layers' steps compiled), the two contenders in alternation, a barrier
before each call, the slowest rank's time:

- ``new``: one forward at each length 8..39 but 24, the first time the model sees it;
- ``seen``: the same lengths again, each differing from the call before (what a decode loop
  does prompt after prompt);
- ``repeated``: after each of those, two forwards at one length (24), the second timed: a
  call at the length of the call before it, a few milliseconds after the one it is compared
  with (the machine's speed drifts over seconds);
- ``generate``: nanoGPT's ``generate()`` without a KV cache (the whole context each token,
  greedy) of 32 tokens from a 48-token prompt, twice (the first prompt's lengths are new, the
  second's seen): tokens/s, and the tokens compared with one process's.

Then Hugging Face decoding (``--parts decode``): a ``transformers`` Llama (``LLAMA``: d_model
1024, 16 heads, 8 key/value heads, 4 layers; random weights, nothing downloaded) and its own
``generate()`` (greedy, its KV cache) of 64 tokens after a 32-token prompt, batch 4, in
alternation: one process; coconet
(``parallelize(model, comm)``: the model's own tp_plan); DeepSpeed's AutoTP
(``deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})`` over its shared-memory
all_reduce; left out, with the reason, where DeepSpeed or its op is missing); the same
layers written by hand (``hand_written_bare``: this rank's part of each weight, ``F.linear``,
then coconet's bare shared-memory all_reduce or all_gather, no compiled step: what coconet's
layer machinery costs over the transport); and the TP=2 bound (``tp2_bound``: each rank's parts
of the same linears and no communication at all, the model's own Python around them: not a
correct model, its tokens not compared). Five runs per contender after a warm-up; tokens/s
(the slowest rank's time), and every generated token compared with one process's.

Targets (``--json``'s ``targets``; issue 46's names where they apply, from this run):
``growing context: forward at a new length over a repeated length`` <= 1.2 (and the same at a
seen length; the median of each such call over the repeated call timed just after it),
``decode: speedup over one process`` >= 1.6, ``decode: latency over TP=2 bound`` <= 1.1,
``decode: speedup over deepspeed autotp`` >= 1.15, tokens equal to one process. What one
process pays for a new length itself (torch's own per-shape costs) is printed beside, for
scale.

    python benchmarks/tp_inference.py --json benchmarks/results/tp_inference.json \\
        --plot benchmarks/results/tp_inference.png | tee benchmarks/results/tp_inference.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the nanoGPT-style model the tests use
sys.path.insert(0, str(HERE))
from data_parallel_adam import emit, loadavg, machine  # noqa: E402

MODELS = {  # name: (n_embd, n_head, n_layer)
    "small": (128, 4, 2),
    "512x4": (512, 8, 4),
}
PLAN = {"transformer.h.*.attn": "attention", "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise"}  # fmt: skip
VOCAB, BLOCK = 512, 128
REPEATED = 24
NEW_LENGTHS = [n for n in range(8, 40) if n != REPEATED]
WARM_LENGTHS = [100, 101, 102, 103]
PROMPT, GENERATED, PROMPTS = 48, 32, 2
CONTENDERS = ("one_process", "coconet")
TARGET = 1.2
LLAMA = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
         "max_position_embeddings": 256}  # fmt: skip
DECODE = {"batch": 4, "prompt": 32, "new": 64, "runs": 5}
BOUND = "tp2_bound"  # each rank's parts of the parallel layers, no communication (tp2_local)
BARE = "hand_written_bare"  # F.linear + coconet's bare shared-memory collective (tp2_local)


def logits_of(model, idx: torch.Tensor) -> torch.Tensor:
    """nanoGPT's forward without the loss: the logits of every position."""
    t = model.transformer
    x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
    for block in t.h:
        x = block(x)
    return model.lm_head(t.ln_f(x))


def generate(model, idx: torch.Tensor, new: int) -> torch.Tensor:
    """nanoGPT's ``generate()``, greedy: the whole (cropped) context again for every token."""
    for _ in range(new):
        logits = logits_of(model, idx[:, -BLOCK:])[:, -1, :]
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    out: dict = {"models": {name: run_model(comm, name) for name in cfg["models"]}}
    if "decode" in cfg["parts"]:
        out["decode"] = run_decode(comm)
    return out


def run_decode(comm) -> dict:
    """The Llama's ``generate()`` per contender: each run's time (the slowest rank's; one
    process: rank 0's), the tokens, and why DeepSpeed was left out (or '')."""
    import copy

    from data_parallel_adam import deepspeed_available, remove_deepspeed_segments
    from transformers import LlamaConfig, LlamaForCausalLM

    from coconet.nn import parallelize

    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    models = {"one_process": ref, "coconet": parallelize(copy.deepcopy(ref), comm)}
    models[BOUND] = tp2_local(ref, models["coconet"])
    models[BARE] = tp2_local(ref, models["coconet"], comm)
    why = deepspeed_available(comm.world)
    if not why:
        import deepspeed

        engine = deepspeed.init_inference(
            copy.deepcopy(ref), tensor_parallel={"tp_size": 2}, dtype=torch.float32,
            replace_with_kernel_inject=False,
        )
        models["deepspeed_autotp"] = engine.module
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, LLAMA["vocab_size"], (DECODE["batch"], DECODE["prompt"]),
                           generator=gen)  # fmt: skip
    times: dict[str, list[float]] = {c: [] for c in models}
    tokens: dict[str, list[int]] = {}
    with torch.no_grad():
        for run in range(1 + DECODE["runs"]):  # (the first: a warm-up)
            for c, model in models.items():
                dist.barrier()
                t0 = time.perf_counter()
                if c != "one_process" or comm.rank == 0:
                    got = model.generate(prompt, max_new_tokens=DECODE["new"], do_sample=False)
                    tokens[c] = got[:, DECODE["prompt"]:].reshape(-1).tolist()
                if run:
                    times[c].append(time.perf_counter() - t0)
    for c, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[c] = t.tolist()
    dist.barrier()
    removed = remove_deepspeed_segments() if not why and comm.rank == 0 else []
    return {"times_s": times, "tokens": tokens, "deepspeed_skipped": why, "removed": removed}


class _BareCollective(torch.nn.Module):
    """A hand-written Megatron-style layer: this rank's part of the weight, ``F.linear``, then
    coconet's bare shared-memory collective (``Communicator.all_reduce_start`` /
    ``all_gather_start``, no compiled step: no agreement, no vote): a row-parallel layer
    all-reduces its output, a column-parallel one whose output is gathered gathers it."""

    def __init__(self, linear: torch.nn.Linear, comm, reduce: bool, gather: bool) -> None:
        super().__init__()
        self.linear, self.comm, self.reduce, self.gather = linear, comm, reduce, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from coconet.ir.ops import ReduceOp

        y = self.linear(x)
        if self.reduce:
            y = self.comm.wait(self.comm.all_reduce_start(y, ReduceOp.SUM, axis=None,
                                                          donate=True, label="y"))  # fmt: skip
        elif self.gather:
            dim = y.dim() - 1
            parts = [y.shape[dim]] * self.comm.world
            y = self.comm.wait(self.comm.all_gather_start(y.contiguous(), dim=dim, parts=parts,
                                                          axis=None, label="y"))  # fmt: skip
        return y


def tp2_local(ref, parallel, comm=None):
    """``ref`` with each linear that ``parallel`` splits replaced by a plain ``nn.Linear``
    holding this rank's part of it (the same shapes, BLAS calls and KV cache as the parallel
    model). ``comm`` None: the TP=2 bound of a decode step, no communication at all (what the
    ranks' own work costs, with the model's own Python around it; not a correct model, so
    its tokens are not compared, and it never stops at an end token). Else the hand-written
    layers over coconet's bare collectives (``_BareCollective``): a correct model."""
    import copy

    from coconet.nn import ColumnParallelLinear, RowParallelLinear

    model = copy.deepcopy(ref)
    for name, layer in parallel.named_modules():
        if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            continue
        w = layer.weight.detach()
        mine = torch.nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None)
        with torch.no_grad():
            mine.weight.copy_(w)
            if layer.bias is not None:
                # (a row-parallel layer's bias once, after the sum: on one rank before it)
                row = isinstance(layer, RowParallelLinear)
                mine.bias.copy_(layer.bias.detach() if not row or comm is None or comm.rank == 0
                                else torch.zeros_like(layer.bias))  # fmt: skip
        if comm is not None:
            row = isinstance(layer, RowParallelLinear)
            mine = _BareCollective(mine, comm, reduce=row,
                                   gather=not row and layer.gather_output)  # fmt: skip
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, mine)
    if comm is None:
        model.generation_config.eos_token_id = None
    return model.eval()


def run_model(comm, name: str) -> dict:
    """Every phase of model ``name``, both contenders: every call's time (the slowest rank's;
    one process: rank 0's) and the tokens generated."""
    import copy

    from support.nanogpt import GPT, GPTConfig

    from coconet.nn import parallelize

    d, heads, layers = MODELS[name]
    torch.manual_seed(0)
    config = GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=layers, n_head=heads, n_embd=d)
    ref = GPT(config).eval()
    models = {"one_process": ref, "coconet": parallelize(copy.deepcopy(ref), comm, PLAN).eval()}
    gen = torch.Generator().manual_seed(1)
    times: dict[str, dict[str, list[float]]] = {c: {} for c in CONTENDERS}
    tokens: dict[str, list[list[int]]] = {c: [] for c in CONTENDERS}

    def call(contender: str, phase: str, fn, *args) -> object:
        """``fn(model, *args)`` between barriers on the ranks that run ``contender``."""
        active = contender == "coconet" or comm.rank == 0
        dist.barrier()
        t0 = time.perf_counter()
        got = fn(models[contender], *args) if active else None
        times[contender].setdefault(phase, []).append(time.perf_counter() - t0)
        return got

    with torch.no_grad():
        for length in WARM_LENGTHS:
            idx = torch.randint(0, VOCAB, (1, length), generator=gen)
            for c in CONTENDERS:
                call(c, "warm-up", logits_of, idx)
        # Each new (or seen) length is followed by two calls at the repeated length, the second
        # timed as ``repeated``: the ratios compare calls a few milliseconds apart, so that
        # what the machine does meanwhile (it drifts by 30% over seconds here) cancels.
        for phase in ("new", "seen"):
            for length in NEW_LENGTHS:
                for what, at in ((phase, length), ("back", REPEATED), ("repeated", REPEATED)):
                    idx = torch.randint(0, VOCAB, (1, at), generator=gen)
                    for c in CONTENDERS:
                        call(c, what, logits_of, idx)
        for k in range(PROMPTS):
            prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=gen)
            for c in CONTENDERS:
                got = call(c, f"generate {k}", generate, prompt, GENERATED)
                if got is not None:
                    tokens[c].append(got[0, PROMPT:].tolist())
    for c in CONTENDERS:
        for phase, ts in times[c].items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[c][phase] = t.tolist()
    return {"times_s": times, "tokens": tokens,
            "config": {"n_embd": d, "n_head": heads, "n_layer": layers}}  # fmt: skip


def summarize(res: dict) -> dict:
    doc = {}
    for name, r in res["models"].items():
        row: dict = {"config": r["config"]}
        for c in CONTENDERS:
            ts = r["times_s"][c]
            med = {p: statistics.median(ts[p]) * 1e3 for p in ("new", "seen", "repeated")}
            gen_s = [ts[f"generate {k}"][0] for k in range(PROMPTS)]
            # each call over the repeated call timed just after it (the first half of the
            # repeated calls follow the new lengths, the second the seen ones)
            n = len(ts["new"])
            paired = {p: statistics.median(a / b for a, b in zip(
                ts[p], ts["repeated"][k * n:(k + 1) * n], strict=True))
                for k, p in enumerate(("new", "seen"))}  # fmt: skip
            row[c] = {
                "median_ms": med,
                "new_over_repeated": paired["new"],
                "seen_over_repeated": paired["seen"],
                "generate_tokens_per_s": [GENERATED / s for s in gen_s],
            }
        ours, one = r["tokens"]["coconet"], r["tokens"]["one_process"]
        row["tokens_equal"] = sum(a == b for x, y in zip(ours, one, strict=True)
                                  for a, b in zip(x, y, strict=True))  # fmt: skip
        row["tokens"] = GENERATED * PROMPTS
        row["generate_speedup"] = [a / b for a, b in zip(
            row["coconet"]["generate_tokens_per_s"],
            row["one_process"]["generate_tokens_per_s"], strict=True)]  # fmt: skip
        doc[name] = row
    return doc


def summarize_decode(res: dict) -> dict:
    n = DECODE["batch"] * DECODE["new"]
    ref = res["tokens"]["one_process"]
    rows = {}
    for c, ts in res["times_s"].items():
        med = statistics.median(ts)
        rows[c] = {"median_s": med, "tokens_per_s": n / med, "tokens": n}
        if c != BOUND:  # (not a correct model: its tokens are its own)
            rows[c]["tokens_equal"] = sum(a == b for a, b in zip(res["tokens"][c], ref,
                                                                 strict=True))  # fmt: skip
    for row in rows.values():
        row["speedup_vs_one_process"] = rows["one_process"]["median_s"] / row["median_s"]
    return {"contenders": rows, "deepspeed_skipped": res["deepspeed_skipped"]}


def targets(models: dict, decode: dict | None = None) -> list[dict]:
    out = []
    if decode is not None:
        rows = decode["contenders"]
        ours = rows["coconet"]
        out.append({"name": "decode: speedup over one process (llama)",
                    "measured": round(ours["speedup_vs_one_process"], 3), "threshold": ">= 1.6",
                    "met": ours["speedup_vs_one_process"] >= 1.6})  # fmt: skip
        bound = rows[BOUND]["median_s"]
        out.append({"name": "decode: latency over TP=2 bound (llama)",
                    "measured": round(ours["median_s"] / bound, 3), "threshold": "<= 1.1",
                    "met": ours["median_s"] / bound <= 1.1})  # fmt: skip
        if "deepspeed_autotp" in rows:
            r = rows["deepspeed_autotp"]["median_s"] / ours["median_s"]
            out.append({"name": "decode: speedup over deepspeed autotp (llama)",
                        "measured": round(r, 3), "threshold": ">= 1.15",
                        "met": r >= 1.15})  # fmt: skip
        for c, row in rows.items():
            if c not in ("one_process", BOUND):
                out.append({"name": f"decode: tokens equal to one process ({c}, llama)",
                            "measured": f"{row['tokens_equal']} of {row['tokens']}",
                            "threshold": "all",
                            "met": row["tokens_equal"] == row["tokens"]})  # fmt: skip
    for name, row in models.items():
        c = row["coconet"]
        for what, key in (("new", "new_over_repeated"), ("seen", "seen_over_repeated")):
            out.append({"name": f"growing context: forward at a {what} length over a repeated "
                                f"length ({name})", "measured": round(c[key], 3),
                        "threshold": f"<= {TARGET}", "met": c[key] <= TARGET})  # fmt: skip
        out.append({"name": f"generate: tokens equal to one process ({name})",
                    "measured": f"{row['tokens_equal']} of {row['tokens']}",
                    "threshold": "all", "met": row["tokens_equal"] == row["tokens"]})  # fmt: skip
    return out


def table(doc: dict) -> str:
    lines = ["tensor-parallel inference with a growing context: nanoGPT-style models, 2 ranks x 1 "
             "thread (coconet.nn.parallelize) against one process x 1 thread; float32, no grad; "
             "medians of per-call times (slowest rank), one run"]  # fmt: skip
    for name, row in doc["models"].items():
        cfg = row["config"]
        lines += ["", f"{name}: d_model {cfg['n_embd']}, {cfg['n_head']} heads, "
                      f"{cfg['n_layer']} layers, vocab {VOCAB}",
                  f"  {'':12} {'new ms':>8} {'seen ms':>8} {'repeat ms':>9} {'new/rep':>8} "
                  f"{'seen/rep':>8}  generate tok/s (prompt 1, 2)"]  # fmt: skip
        for c in CONTENDERS:
            r = row[c]
            m = r["median_ms"]
            tps = ", ".join(f"{x:.0f}" for x in r["generate_tokens_per_s"])
            lines.append(f"  {c:12} {m['new']:8.3f} {m['seen']:8.3f} {m['repeated']:9.3f} "
                         f"{r['new_over_repeated']:8.2f} {r['seen_over_repeated']:8.2f}  "
                         f"{tps}")  # fmt: skip
        sp = ", ".join(f"{x:.2f}x" for x in row["generate_speedup"])
        lines.append(f"  generate speedup over one process: {sp}; tokens equal to one process: "
                     f"{row['tokens_equal']} of {row['tokens']}")  # fmt: skip
    if "decode" in doc:
        dec = doc["decode"]
        lines += ["", f"llama decode: transformers LlamaForCausalLM {LLAMA}, generate() greedy "
                      f"{DECODE['new']} tokens after {DECODE['prompt']}, batch "
                      f"{DECODE['batch']}; median of {DECODE['runs']} runs",
                  f"  {'':18} {'s':>7} {'tokens/s':>9} {'vs one':>7}  tokens equal"]  # fmt: skip
        for c, row in dec["contenders"].items():
            equal = (f"{row['tokens_equal']} of {row['tokens']}" if "tokens_equal" in row
                     else "(not a correct model)")  # fmt: skip
            lines.append(f"  {c:18} {row['median_s']:7.3f} {row['tokens_per_s']:9.1f} "
                         f"{row['speedup_vs_one_process']:6.2f}x  {equal}")  # fmt: skip
        rows = dec["contenders"]
        lines.append(f"  {BOUND}: each rank's parts of the parallel layers and no communication "
                     "(the ranks' own work); the most a TP=2 decode can gain over one process "
                     f"here: {rows[BOUND]['speedup_vs_one_process']:.2f}x; over the bound: "
                     + ", ".join(f"{c} {r['median_s'] / rows[BOUND]['median_s']:.2f}x"
                                 for c, r in rows.items()
                                 if c not in ("one_process", BOUND)))  # fmt: skip
        if dec["deepspeed_skipped"]:
            lines.append(f"  deepspeed_autotp left out: {dec['deepspeed_skipped']}")
    lines += ["", "targets (from this run: the growing context's as medians of each call over the "
              "repeated call just after it, the rest as ratios of medians):"]
    for t in doc["targets"]:
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {t['name']}: {t['measured']} "
                     f"(target {t['threshold']})")  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    phases = ("new", "seen", "repeated")
    for ax, name in zip(axes[0], names, strict=True):
        row = doc["models"][name]
        for i, c in enumerate(CONTENDERS):
            vals = [row[c]["median_ms"][p] for p in phases]
            ax.bar([j + 0.4 * i for j in range(len(phases))], vals, width=0.4, label=c)
        ax.set_xticks([j + 0.2 for j in range(len(phases))], [f"{p} length" for p in phases])
        ax.set_ylabel("forward, ms (median)")
        ax.set_title(f"{name}: lengths 8..39, 2 ranks")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {','.join(MODELS)}")
    ap.add_argument("--parts", default="growing,decode", help="growing (the nanoGPT models' "
                    "growing context), decode (the transformers Llama's generate())")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"growing", "decode"}:
        ap.error("--parts: choose from growing,decode")
    models = [m.strip() for m in args.models.split(",") if m.strip()] if "growing" in parts \
        else []  # fmt: skip
    if set(models) - set(MODELS):
        ap.error(f"--models: choose from {','.join(MODELS)}")

    from coconet.runtime import CommOptions, spawn

    before = loadavg()
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks inherit it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print("spawning 2 ranks ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = spawn(worker, 2, {"models": models, "parts": sorted(parts)},
                options=CommOptions(timeout=120), timeout=1800)[0]  # fmt: skip
    wall = time.perf_counter() - t0
    doc = {"benchmark": "tp_inference", "machine": machine(before), "world_size": 2,
           "config": {"models": {m: MODELS[m] for m in models}, "vocab": VOCAB,
                      "lengths": [NEW_LENGTHS[0], NEW_LENGTHS[-1]], "repeated": REPEATED,
                      "prompt": PROMPT, "generated": GENERATED, "threads": 1,
                      "dtype": "float32"},
           "models": summarize(res),
           "raw_times_s": {m: r["times_s"] for m, r in res["models"].items()},
           "wall_s": round(wall, 1)}  # fmt: skip
    if "decode" in res:
        doc["decode"] = summarize_decode(res["decode"])
        doc["raw_times_s"]["llama decode"] = res["decode"]["times_s"]
        doc["config"]["llama"] = {**LLAMA, **DECODE}
        if res["decode"]["removed"]:
            print(f"removed DeepSpeed's /dev/shm workspace: {', '.join(res['decode']['removed'])}")
    doc["targets"] = targets(doc["models"], doc.get("decode"))
    emit(doc, table(doc), wall, args.json, plot if models else None,
         args.plot if models else None)  # fmt: skip
    return 0 if all(t["met"] for t in doc["targets"] if "tokens" in t["name"]) else 1


if __name__ == "__main__":
    sys.exit(main())
