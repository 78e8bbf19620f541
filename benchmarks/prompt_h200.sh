#!/usr/bin/env bash
# The H200 figures of steps that carry prompt tokens, in one run (about 8 minutes with small-0.6b):
#   1. correctness first: the captured-step attention against the reference (op conformance, natively)
#      and greedy float32 tokens of padded steps equal to eager ones (tests/engine/test_prompt_graphs.py);
#   2. benchmarks/mixed_step.py, engine.mixed_graphs off then on: 32 decode rows + 512-token chunks (wall,
#      device, host), the eager host's launches, stalls by token bucket, time to first token of 1 x 500,
#      1 x 2,000 and 8 x 2,000 prompt tokens, and transformers' eager forward on those shapes;
#   3. the startup of the default configuration: the graphs captured, their capture time and memory.
# Usage: benchmarks/prompt_h200.sh OUTDIR   (prints a short table; details under OUTDIR)
# Assumes corelib and its backends (with Triton) are installed; run from the repository root.
set -uo pipefail
out=${1:?usage: prompt_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
model=${MODEL:-small-0.6b}
stall_s=${STALL_S:-30}
status=0
echo "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); $(date -u +%F);" \
  "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')" \
  | tee "$out/summary.txt"

# 1. correctness: stop here if the captured attention or the padded steps are wrong
python3 -m pytest -q -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" -m gpu \
  --pyargs corelib.testing.op_conformance --corelib-backend=cuda --corelib-runtime=native \
  -k "steps or captured" >"$out/conformance.log" 2>&1 || status=1
python3 -m pytest -q -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" -m gpu \
  tests/engine/test_prompt_graphs.py >"$out/tokens.log" 2>&1 || status=1
echo "1. conformance: $(tail -1 "$out/conformance.log"); tokens: $(tail -1 "$out/tokens.log")" | tee -a "$out/summary.txt"
if [ "$status" != 0 ]; then
  tail -40 "$out/conformance.log" "$out/tokens.log"
  exit 1
fi

# 2. mixed steps, stalls, time to first token, transformers
python3 benchmarks/mixed_step.py model="$model" backend=cuda backend.runtime=native --stall-seconds "$stall_s" \
  --transformers --out "$out/mixed.json" >"$out/mixed.log" 2>&1 || status=1
grep -v "^corelib:" "$out/mixed.log" | tail -40 | tee -a "$out/summary.txt"

# 3. the default configuration's startup (its graphs), one short run
python3 -m corelib run model="$model" backend=cuda backend.runtime=native workload.num_requests=8 \
  hydra.run.dir="$out/startup" >"$out/startup.log" 2>&1 || status=1
grep -E "engine ready|startup" "$out/startup.log" | tail -3 | tee -a "$out/summary.txt"
exit $status
