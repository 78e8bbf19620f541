#!/usr/bin/env bash
# Every GPU figure of BENCHMARKS.md in one sitting on a 2-GPU H200 host, within BUDGET_S (default 520 s):
#   phase 1, the two GPUs side by side:
#     GPU 0: fused vs reference ops (TPOT sweep, long context, kernels per step, token checks, the SHM race)
#     GPU 1: the previous release vs this one (the refactor's regression check), SHM transport, the server
#   phase 2, both GPUs: llama-8b tp=1 vs tp=2 (NCCL and symmetric memory), the all-reduces alone
# Usage: benchmarks/gpu_session.sh OUTDIR AFTER_SITE BEFORE_SITE
#   AFTER_SITE / BEFORE_SITE: directories holding corelib and its backends installed (pip --target),
#   this version and the previous release; both also need hydra-core and omegaconf on PYTHONPATH.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUTDIR AFTER_SITE BEFORE_SITE}
after=${2:?}; before=${3:?}
mkdir -p "$out"; out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
# Every command runs from OUTDIR: from the repository's root, `python -m corelib` would import the
# checkout's corelib (whose conf/ is not inside the package) instead of the installed one.
cd "$out" || exit 1
# Multicast (NVLS) collectives can take shared GPUs down: off in this shell and every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 CORELIB_PROGRESS_INTERVAL=60
budget=${BUDGET_S:-520}
started=$(date +%s)
summary="$out/summary.txt"; : >"$summary"
note() { echo "$*" >>"$summary"; }
left() { echo $((budget - ($(date +%s) - started))); }
part() {  # part NAME CAP SITE GPUS command...: under timeout, logged to OUTDIR/NAME.log
  local name=$1 cap=$2 site=$3 gpus=$4; shift 4
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 15 ]; then note "== $name: skipped (budget spent)"; return 1; fi
  [ "$cap" -gt "$remaining" ] && cap=$remaining
  local t0; t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH="$site" timeout --kill-after=10 "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  note "== $name: exit $rc in $(($(date +%s) - t0)) s (cap $cap)"
  [ "$rc" = 0 ] || tail -4 "$out/$name.log" | sed 's/^/   /' >>"$summary"
  return $rc
}
# A dry run elsewhere: DEVICE="backend=npu" MODEL=tiny benchmarks/gpu_session.sh ...
read -r -a device <<<"${DEVICE:-backend=cuda backend.runtime=native}"
model=${MODEL:-small-0.6b}
bench() {  # bench NAME CAP SITE GPUS overrides...
  local name=$1 cap=$2 site=$3 gpus=$4; shift 4
  part "$name" "$cap" "$site" "$gpus" python3 -m corelib bench "${device[@]}" model="$model" bench=h200 \
    bench.warmup_steps=8 "$@" hydra.run.dir="$out/$name"
}
tp_bench() {  # tp_bench NAME CAP GPUS overrides...: llama-8b over SHM workers, bs 1 and 32
  local name=$1 cap=$2 gpus=$3; shift 3
  part "$name" "$cap" "$after" "$gpus" python3 -m corelib bench "${device[@]}" model="${TP_MODEL:-llama-8b}" \
    model.max_model_len=1024 bench=h200 "bench.transport=[shm]" "bench.handoff=[on]" "bench.materialization=[auto]" \
    "bench.batch_sizes=[1,32]" bench.prompt_len=32 bench.output_len=64 bench.warmup_steps=8 bench.repeats=2 \
    "engine.graph_batch_sizes=[1,32]" "$@" hydra.run.dir="$out/$name"
}
table() { python3 - "$@" <<'EOF'
import json, sys
from pathlib import Path
for name in sys.argv[1:]:
    path = Path(name) / "bench.json"
    if not path.exists():
        print(f"   {Path(name).name}: no bench.json"); continue
    for p in json.loads(path.read_text())["points"]:
        xport = "" if p.get("transport_us_p50") is None else f" xport p50/p99 {p['transport_us_p50']:.0f}/{p['transport_us_p99']:.0f} us"
        occ = "-" if p["occupancy"] is None else f"{100 * p['occupancy']:.1f}%"
        print(f"   {Path(name).name:<14} ops={p.get('ops', 'reference'):<9} tp={p['tp']} {p['transport']:<6} "
              f"{p['materialization']:<9} handoff={p['handoff']:<3} bs={p['batch_size']:<4} TPOT {p['tpot_ms']:.3f} ms "
              f"occ {occ}{xport}")
EOF
}

note "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l); $(date -u +%F)"
note "== torch: $(PYTHONPATH=$after python3 -c 'import torch, triton; print(torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)' 2>&1)"

gpu0() {
  bench fused 110 "$after" 0 "bench.transport=[inproc]" "bench.handoff=[on]" "bench.fused_ops=[off,on]" \
    "bench.batch_sizes=[1,8,32,64,128]" bench.output_len=64 bench.repeats=2 "engine.graph_batch_sizes=[1,8,32,64,128]"
  bench long 90 "$after" 0 "bench.transport=[inproc]" "bench.handoff=[on]" "bench.fused_ops=[off,on]" \
    "bench.batch_sizes=[1,32]" bench.prompt_len=1900 bench.output_len=64 "engine.graph_batch_sizes=[1,32]"
  part kernels 60 "$after" 0 python3 "$repo/benchmarks/kernels.py" --batch 1 32 --steps 6 --out "$out/kernels.json"
  tp_bench tp1 70 0 "bench.tp=[1]"
  CORELIB_AGREEMENT_REPORT="$out/bf16-agreement.json" part gpu-tests 100 "$after" 0 python3 -m pytest -q -m gpu \
    -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" --rootdir "$repo" -c "$repo/pyproject.toml" \
    "$repo/tests/engine/test_fused_ops_gpu.py" "$repo/tests/transport/test_race.py" \
    "$repo/tests/engine/test_engine_reference.py"
}
gpu1() {
  # The refactor's regression check: the previous release and this one, the same sweep, reference ops.
  for version in before after; do
    site=$before; extra=(); [ $version = after ] && { site=$after; extra=("bench.fused_ops=[off]"); }
    bench "$version-inproc" 50 "$site" 1 "bench.transport=[inproc]" "bench.handoff=[off,on]" "bench.batch_sizes=[1,32]" \
      bench.repeats=2 "engine.graph_batch_sizes=[1,32]" "${extra[@]}"
    bench "$version-shm" 70 "$site" 1 "bench.transport=[shm]" "bench.materialization=[early,ordered]" "bench.handoff=[on]" \
      "bench.batch_sizes=[1,32]" bench.repeats=2 "engine.graph_batch_sizes=[1,32]" "${extra[@]}"
  done
  # SHM transport with the default (fused) ops: in-process vs ordered vs early, bs 1, 32, 128.
  bench shm-fused 90 "$after" 1 "bench.transport=[inproc,shm]" "bench.materialization=[ordered,early]" \
    "bench.handoff=[on]" "bench.batch_sizes=[1,32,128]" bench.repeats=2 "engine.graph_batch_sizes=[1,32,128]"
  DURATION=5 REQUESTS=256 part serve 100 "$after" 1 bash "$repo/benchmarks/serve_h200.sh" "$out/serve"
}

gpu0 & p0=$!
gpu1 & p1=$!
wait $p0 $p1
note "== phase 1 done at $(($(date +%s) - started)) s"
tp_bench tp2-nccl 70 0,1 "bench.tp=[2]" engine.fast_allreduce=off
tp_bench tp2-symm 60 0,1 "bench.tp=[2]" engine.fast_allreduce=on
part allreduce 40 "$after" 0,1 python3 "$repo/benchmarks/allreduce.py" --repeats 30 --out "$out/allreduce.json"

note "== tables"
table "$out/fused" "$out/long" "$out/before-inproc" "$out/after-inproc" "$out/before-shm" "$out/after-shm" \
  "$out/shm-fused" "$out/tp1" "$out/tp2-nccl" "$out/tp2-symm" >>"$summary" 2>&1
[ -f "$out/allreduce.log" ] && grep -iE "all-reduce|nccl|symm" "$out/allreduce.log" | tail -10 >>"$summary"
[ -f "$out/kernels.log" ] && tail -8 "$out/kernels.log" >>"$summary"
[ -f "$out/gpu-tests.log" ] && grep -E "passed|failed|agreement" "$out/gpu-tests.log" | tail -3 >>"$summary"
[ -f "$out/serve/summary.txt" ] && cat "$out/serve/summary.txt" >>"$summary"
note "== total $(($(date +%s) - started)) s"
cat "$summary"
