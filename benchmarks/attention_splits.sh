#!/usr/bin/env bash
# The decode attention at short spans in the engine: benchmarks/attention_splits.py's variants and 128-token decode
# graphs beside the 256-token ones (kv128), alternating, ROUNDS rounds (default 2); small-0.6b, in process, async, TPOT.
# Usage: benchmarks/attention_splits.sh OUTDIR
# Environment: MODEL (small-0.6b), BATCHES ("[1,8,32,128]"), CAP (seconds per run, 100), VARIANTS (all six:
# "base early wide early-wide one-split kv128").
set -uo pipefail
out=${1:?usage: attention_splits.sh OUTDIR}
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for variant in ${VARIANTS:-base early wide early-wide one-split kv128}; do
    tag="$variant-$round"
    args=(bench backend=cuda backend.runtime=native bench=h200 "model=${MODEL:-small-0.6b}" "bench.transport=[inproc]"
          "bench.handoff=[on]" "bench.prompt_lens=[]" "bench.batch_sizes=${BATCHES:-[1,8,32,128]}" bench.warmup_steps=8
          hydra.run.dir="$out/$tag")
    if [ "$variant" = kv128 ]; then
      cmd=(python3 "$repo/benchmarks/attention_splits.py" base "${args[@]}" "engine.graph_kv_sizes=[128,256]")
    else
      cmd=(python3 "$repo/benchmarks/attention_splits.py" "$variant" "${args[@]}")
    fi
    timeout --kill-after=10 "${CAP:-100}" "${cmd[@]}" >"$out/$tag.log" 2>&1 || { status=1; echo "== $tag: failed (see $out/$tag.log)"; }
    echo "$tag: $(grep -E '^corelib: bench .*bs=' "$out/$tag.log" | sed -E 's/.*(bs=[0-9]+): TPOT ([0-9.]+) ms.*/\1 \2/' | tr '\n' ' ')"
  done
done
exit $status
