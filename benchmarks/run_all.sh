#!/usr/bin/env bash
# Re-runs every benchmark whose output benchmarks/README.md quotes, writing benchmarks/results/.
# Usage: benchmarks/run_all.sh [python]   (default: python on PATH; ~15 minutes on 2 cores)
set -euo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p "$R"

"$PY" benchmarks/data_parallel_adam.py --params 4194304 --steps 20 --fresh-inductor-cache \
  --json "$R/data_parallel_adam_4M.json" --plot "$R/data_parallel_adam_4M.png" \
  | tee "$R/data_parallel_adam_4M.txt"

"$PY" benchmarks/data_parallel_adam.py --params 16777216 --steps 20 --fresh-inductor-cache \
  --json "$R/data_parallel_adam_16M.json" --plot "$R/data_parallel_adam_16M.png" \
  | tee "$R/data_parallel_adam_16M.txt"

# 64M: the best fused form against the best baselines only (six contenders at 64M ran out of
# this machine's 24 GB at the correctness check).
"$PY" benchmarks/data_parallel_adam.py --params 67108864 --steps 10 \
  --contenders "ddp,shm_all_reduce+adam_fused,deepspeed_shm_all_reduce+adam_fused,coconet.optim.Adam[host-shared]" \
  --json "$R/data_parallel_adam_64M.json" --plot "$R/data_parallel_adam_64M.png" \
  | tee "$R/data_parallel_adam_64M.txt"

# max_grad_norm='s cost (issue 25): never clipping and clipping at every step, one and two buckets
"$PY" benchmarks/data_parallel_adam.py --params 16777216 --steps 40 \
  --contenders "ddp,coconet.optim.Adam,coconet.optim.Adam[clip],coconet.optim.Adam[clip-active],coconet.optim.Adam[2-groups],coconet.optim.Adam[2-groups][clip],coconet.optim.Adam[2-groups][clip-active],coconet.optim.Adam[2-groups-63:1],coconet.optim.Adam[2-groups-63:1][clip]" \
  --json "$R/optim_clip_16M.json" | tee "$R/optim_clip_16M.txt"

"$PY" benchmarks/collectives.py --json "$R/collectives.json" | tee "$R/collectives.txt"

"$PY" benchmarks/first_step.py --json "$R/first_step.json" | tee "$R/first_step.txt"

"$PY" benchmarks/compile_cost.py --params 4194304 --steps 20 --repeats 2 \
  --json "$R/compile_cost_4M.json" | tee "$R/compile_cost_4M.txt"

"$PY" benchmarks/step_breakdown.py --params 4194304 --steps 10 --commit swap \
  | tee "$R/step_breakdown_4M.txt"
"$PY" benchmarks/step_breakdown.py --params 16777216 --steps 10 --commit swap \
  | tee "$R/step_breakdown_16M.txt"
"$PY" benchmarks/optim_step_timeline.py --params 4096,1048576,4194304 --steps 40 \
  --json "$R/optim_step_timeline.json" | tee "$R/optim_step_timeline.txt"

# The end-to-end training step: coconet.optim.AdamW against DDP + fused AdamW (examples/).
"$PY" examples/train_gpt.py --steps 40 --json "$R/train_gpt.json" --plot "$R/train_gpt.png" \
  | tee "$R/train_gpt.txt"

# coconet.optim's optimizers against ddp / zero / pytorch_optimizer.Lamb at 16M parameters.
for opt in adam lamb; do
  "$PY" benchmarks/data_parallel.py --optimizer $opt --params 16M --nproc 2 \
    --json "$R/dp_optim_${opt}_16M.json" --plot "$R/dp_optim_${opt}_16M.png" \
    | tee "$R/dp_optim_${opt}_16M.txt"
done

# The fixed cost of a small coconet.optim step (one process, 1,000 parameters) vs torch.optim.Adam.
"$PY" benchmarks/optim_small_step.py --params 1000 --steps 2000 \
  --json "$R/optim_small_step_1k.json" | tee "$R/optim_small_step_1k.txt"

# coconet tune's own output at 16M (the table the README shows), measured afresh.
"$PY" -m coconet.cli tune examples/adam.py:program --nproc 2 --size N=16777216 --commit swap \
  --retune --json "$R/tune_adam_16M.json" | tee "$R/tune_adam_16M.txt"

# The tuner's first round (one candidate after the other) against its deciding round (steps
# interleaved), six repeats each.
"$PY" benchmarks/tune_rematch.py --size 16M --json "$R/tune_rematch_16M.json" \
  | tee "$R/tune_rematch_16M.txt"

# The tuner: every candidate of data-parallel Adam predicted and measured at 1M, 16M, 64M
# parameters (is the default tune's pick within 5% of the best? predictions within 25%?), and
# coconet plan's BERT-large table on a DGX-A100-like cluster.
"$PY" benchmarks/tune_quality.py --examples adam --sizes 1M,16M,64M --repeat 2 \
  --json "$R/tune_quality.json" --plot "$R/tune_quality.png" | tee "$R/tune_quality.txt"

# Small steps (issue 19.3): the fixed cost of small all_reduces and of a compiled step, against
# DeepSpeed's inference_all_reduce, 4 KiB to 64 MiB, with the issue's targets in the JSON.
"$PY" benchmarks/small_steps.py --json "$R/small_steps.json" | grep -v "^DeepSpeed " \
  | tee "$R/small_steps.txt"

# Tensor parallelism (issue 20): one GPT block at TP=2, prefill / training / decode, against one
# process, DTensor, Megatron f/g over gloo, coconet's and DeepSpeed's shared memory.
"$PY" benchmarks/tensor_parallel.py --json "$R/tensor_parallel.json" \
  --plot "$R/tensor_parallel.png" | tee "$R/tensor_parallel.txt"

# Sequence parallelism (issue 20): the overlapped layer schedules against the programs as written.
"$PY" benchmarks/sequence_parallel.py --json "$R/sequence_parallel.json" \
  | tee "$R/sequence_parallel.txt"

# Pipeline parallelism (issue 21): train_gpt's GPT at PP=2, 8 micro-batches, coconet.pipeline's
# 1F1B and GPipe against torch.distributed.pipelining's and one process, with issue 21's targets.
"$PY" benchmarks/pipeline_parallel.py --json "$R/pipeline_parallel.json" \
  --plot "$R/pipeline_parallel.png" | tee "$R/pipeline_parallel.txt"

# Observability (issue 48): tracing on against off, the flight recorder on against off, the
# instrumentation's cost with nothing recording, and the fault trials' named victims.
"$PY" benchmarks/observability.py --json "$R/observability.json" \
  --png "$R/observability_trace.png" | tee "$R/observability.txt"
