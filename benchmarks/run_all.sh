#!/usr/bin/env bash
# Re-runs every benchmark whose output benchmarks/README.md quotes, writing benchmarks/results/.
# Usage: benchmarks/run_all.sh [python]   (default: python on PATH; ~9 minutes on 2 cores)
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

# The same 4M step with only the contenders that allocate little per step: the eager ones
# (coconet:unscheduled, RS_C_AG) make glibc hand memory back and forth, which slows the others.
"$PY" benchmarks/data_parallel_adam.py --params 4194304 --steps 20 \
  --contenders ddp,zero,coconet:AR_C,coconet:fuse_RS_C_AG \
  --json "$R/data_parallel_adam_4M_compiled_only.json" | tee "$R/data_parallel_adam_4M_compiled_only.txt"

"$PY" benchmarks/compile_cost.py --params 4194304 --steps 20 --repeats 2 \
  --json "$R/compile_cost_4M.json" | tee "$R/compile_cost_4M.txt"

"$PY" benchmarks/step_breakdown.py --params 4194304 --steps 10 | tee "$R/step_breakdown_4M.txt"
"$PY" benchmarks/step_breakdown.py --params 16777216 --steps 10 | tee "$R/step_breakdown_16M.txt"
