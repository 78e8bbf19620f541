#!/usr/bin/env bash
# A follow-up sitting on one H200: where the host's time goes at long context, the server's 64 clients,
# and the in-process regression check again, the two versions interleaved with nothing else running.
# Usage: benchmarks/gpu_followup.sh OUTDIR AFTER_SITE BEFORE_SITE
set -uo pipefail
out=${1:?}; after=${2:?}; before=${3:?}
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd); cd "$out" || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
summary="$out/summary.txt"; : >"$summary"
run() { local name=$1 cap=$2 site=$3; shift 3; local t0; t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$site" timeout --kill-after=10 "$cap" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? in $(($(date +%s) - t0)) s" >>"$summary"; }
echo "== serve imports: $(PYTHONPATH=$after python3 -c 'import fastapi, uvicorn, prometheus_client, jinja2, httpx; print("ok")' 2>&1 | tail -1)" >>"$summary"
run profile-long 70 "$after" python3 "$repo/benchmarks/profile_step.py" backend=cuda backend.runtime=native \
  model=small-0.6b --batch 32 --prompt 1900 --steps 30
head -1 "$out/profile-long.log" >>"$summary"; sed -n '/Ordered by: internal/,/^$/p' "$out/profile-long.log" | head -22 >>"$summary"
for round in 1 2; do
  for version in before after; do
    site=$before; extra=(); [ $version = after ] && { site=$after; extra=("bench.fused_ops=[off]"); }
    run "$version-$round" 60 "$site" python3 -m corelib bench backend=cuda backend.runtime=native model=small-0.6b \
      bench=h200 "bench.transport=[inproc]" "bench.handoff=[off,on]" "bench.batch_sizes=[1,32]" bench.repeats=3 \
      bench.warmup_steps=8 "engine.graph_batch_sizes=[1,32]" "${extra[@]}" hydra.run.dir="$out/$version-$round"
    grep -E "corelib: bench .*TPOT" "$out/$version-$round.log" | sed "s/^/   $version-$round /" >>"$summary"
  done
done
DURATION=4 REQUESTS=320 run serve 150 "$after" bash "$repo/benchmarks/serve_h200.sh" "$out/serve"
[ -f "$out/serve/summary.txt" ] && cat "$out/serve/summary.txt" >>"$summary"
cat "$summary"
