#!/usr/bin/env bash
# Tensor parallelism on two H200s: llama-8b tp=1 vs tp=2 (vocabulary-parallel LM head), NCCL vs
# symmetric-memory all-reduces inside the decode graphs, and tp=2's tokens against tp=1's.
#
# Usage: benchmarks/tp_h200x2.sh [OUTDIR]        (default: $OUT, else ./tp-h200x2)
# Needs 2 GPUs and corelib with its backends installed (pip install -e . -e backends/cuda ...).
#
# Parts, in this order (0, c float32, b, a, c bfloat16), each under `timeout` and within one overall
# budget (BUDGET_S, default 540 s);
# a part that fails or runs out of time is reported and the next one runs:
#   0  preflight: GPUs, torch, symmetric memory in this torch, the worker passing fast_allreduce,
#      `plan model=llama-8b backend=cuda engine.tp=2 engine.transport=shm`          ~15 s
#   a  benchmarks/allreduce.py: one decode step's all-reduces, NCCL vs symmetric memory, eager
#      and CUDA-graph replay, small-0.6b and llama-8b sizes at bs 1 and 32           ~40 s
#   b  bench llama-8b, one process: tp=1, tp=2 with NCCL and tp=2 with symmetric memory
#      (bench.fast_allreduce=[off,on]), bs 1 and 32, async on, fused ops auto; TPOT and the
#      SHM hop p50/p99 per point                                                     ~130 s
#   c  benchmarks/tp_tokens.py: greedy tokens of tp=2 (NCCL, symmetric memory) vs tp=1, in
#      float32 with fused ops: tiny and small-0.6b (must be equal); llama-8b in bfloat16
#      (reports where they part)                                                     ~2-3 min
# Every llama-8b engine: worker start and imports ~5 s, CUDA/NCCL init ~5 s, random weights
# drawn on the GPU (model.init=auto picks device for 8 B parameters) ~2 s, Triton JIT on the
# first engine ~15 s (cached after), two CUDA graphs (engine.graph_batch_sizes=[1,32]) ~2 s.
# Decoding is short: prompt 32, 64 new tokens, 2 repeats after 8 warm-up steps. Both ends of
# the SHM hop spin for engine.shm.spin_us (SPIN_US, default 2000) before they sleep.
#
# Targets: tp=2 at least 1.6x faster per token than tp=1 at bs 1, 1.4x at bs 32.
# Details land in OUTDIR: one log per part, bench.json per bench, allreduce.json, tokens-*.json,
# summary.txt (also printed at the end).
set -uo pipefail
out=${1:-${OUT:-./tp-h200x2}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
# Multicast (NVLS) collectives can take shared GPUs down: off in this shell and every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 CORELIB_PROGRESS_INTERVAL=30
budget=${BUDGET_S:-540}
spin=${SPIN_US:-2000}
started=$(date +%s)
summary="$out/summary.txt"
: >"$summary"
status=0

note() { echo "$*" | tee -a "$summary"; }
left() { echo $((budget - ($(date +%s) - started))); }
part() {  # part NAME CAP_S command...: run under timeout (the cap or what is left), log to OUTDIR/NAME.log
  local name=$1 cap=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 20 ]; then note "== $name: skipped, the budget of ${budget} s is spent"; status=1; return 1; fi
  [ "$cap" -gt "$remaining" ] && cap=$remaining
  local t0; t0=$(date +%s)
  timeout --kill-after=15 "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local took=$(($(date +%s) - t0))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note "== $name: TIMED OUT after ${took} s (cap ${cap} s)"; status=1
  elif [ "$rc" != 0 ]; then note "== $name: FAILED (exit $rc) after ${took} s; last lines:"; tail -3 "$out/$name.log" | tee -a "$summary"; status=1
  else note "== $name: ok in ${took} s"; fi
  return "$rc"
}
bench() {  # bench NAME CAP overrides...
  local name=$1 cap=$2; shift 2
  part "$name" "$cap" python3 -m corelib bench backend=cuda backend.runtime=native model=llama-8b \
    model.max_model_len=1024 "bench.transport=[shm]" "bench.handoff=[on]" "bench.materialization=[auto]" \
    "bench.batch_sizes=[1,32]" bench.prompt_len=32 bench.output_len=64 bench.warmup_steps=8 bench.repeats=2 \
    "bench.fused_ops=[auto]" "engine.graph_batch_sizes=[1,32]" "engine.shm.spin_us=$spin" "$@" \
    hydra.run.dir="$out/$name"
  grep -h "bench: skipping" "$out/$name.log" >>"$summary" || true  # bench skips a refused point and goes on
}

# -- 0: preflight ------------------------------------------------------------------------------
note "== machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1) x$(nvidia-smi -L 2>/dev/null | wc -l)"
note "== torch: $(timeout 60 python3 -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.device_count(), "GPUs")' 2>&1)"
note "== symmetric memory in this torch: $(timeout 60 python3 -c 'from corelib_cuda.backend import symmetric_memory_missing as m; print(m() or "yes")' 2>&1)"
if grep -q "fast_allreduce" corelib/transport/worker.py; then
  note "== worker: passes fast_allreduce to init_group"
else
  note "== WARNING: corelib/transport/worker.py does not pass fast_allreduce to init_group: every tp=2 engine uses NCCL, b2 and tp2-symm measure NCCL again"
fi
part plan 60 python3 -m corelib plan model=llama-8b backend=cuda backend.runtime=native engine.tp=2 \
  engine.transport=shm hydra.run.dir="$out/plan"
grep -E "fast_allreduce|fused_ops" "$out/plan.log" | head -4 >>"$summary"

# -- c (first: the check that must hold): tp=2 tokens against tp=1 in float32 ----------------------
for case in tiny-f32 small-f32; do
  part "tokens-$case" 150 python3 benchmarks/tp_tokens.py --cases "$case" --out "$out/tokens-$case.json"
  sed -n '/^case /,$p' "$out/tokens-$case.log" >>"$summary"
done

# -- b: llama-8b TPOT, tp=1 vs tp=2, NCCL vs symmetric memory inside the graphs, side by side ------
bench bench-tp 240 "bench.tp=[1,2]" "bench.fast_allreduce=[off,on]"

# -- a: the all-reduces alone, then llama-8b's bfloat16 tokens, while the budget lasts -------------
part allreduce 90 python3 benchmarks/allreduce.py --repeats 50 --out "$out/allreduce.json"
sed -n '/^model /,$p' "$out/allreduce.log" >>"$summary"
part tokens-llama-bf16 150 python3 benchmarks/tp_tokens.py --cases llama-bf16 --out "$out/tokens-llama-bf16.json"
sed -n '/^case /,$p' "$out/tokens-llama-bf16.log" >>"$summary"

# -- summary -----------------------------------------------------------------------------------
python3 - "$out" >>"$summary" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
tpot, hop = {}, {}  # (label, bs) -> ms, "p50/p99"
path = out / "bench-tp" / "bench.json"
if not path.exists():
    print("== bench-tp: no bench.json (see bench-tp.log)")
else:
    for p in json.loads(path.read_text())["points"]:
        label = "tp1" if p["tp"] == 1 else ("tp2-symm" if p.get("fast_allreduce") else "tp2-nccl")
        tpot[(label, p["batch_size"])] = p["tpot_ms"]
        if p.get("transport_us_p50") is not None:
            hop[(label, p["batch_size"])] = f"{p['transport_us_p50']:.0f}/{p['transport_us_p99']:.0f}"
print("== llama-8b on 2 H200s: TPOT ms (async on, fused ops auto, shm workers, vocabulary-parallel LM head at tp=2)")
print(f"{'bs':>4}{'tp=1':>9}{'tp=2 nccl':>11}{'tp=2 symm':>11}{'speed-up nccl':>15}{'speed-up symm':>15}{'target':>8}"
      f"   hop p50/p99 us tp1 | nccl | symm")
targets = {1: 1.6, 32: 1.4}
for bs in (1, 32):
    one = tpot.get(("tp1", bs))
    row = [tpot.get((k, bs)) for k in ("tp1", "tp2-nccl", "tp2-symm")]
    cells = "".join(f"{'-' if v is None else f'{v:.3f}':>{w}}" for v, w in zip(row, (9, 11, 11)))
    speed = [None if (one is None or v is None) else one / v for v in row[1:]]
    verdict = "".join(f"{'-' if s is None else f'{s:.2f}x' + (' ok' if s >= targets[bs] else ' low'):>15}" for s in speed)
    hops = " | ".join(hop.get((k, bs), "-") for k in ("tp1", "tp2-nccl", "tp2-symm"))
    print(f"{bs:>4}{cells}{verdict}{targets[bs]:>7}x   {hops}")
print("== tp=2 tokens against tp=1 (float32 must be equal)")
for case in ("tiny-f32", "small-f32", "llama-bf16"):
    found = out / f"tokens-{case}.json"
    if not found.exists():
        print(f"   {case}: no tokens-{case}.json")
        continue
    for name, run in json.loads(found.read_text()).get(case, {}).items():
        vs = run.get("vs_tp1")
        if vs is None:
            continue
        equal = vs["equal"] == vs["requests"]
        verdict = "equal" if equal else f"first difference at token {vs['first_divergence']}"
        must = case.endswith("f32")
        print(f"   {case} {name} (fused ops: {','.join(run.get('fused_ops', [])) or 'none'}, fast_allreduce "
              f"{'on' if run.get('fast_allreduce') else 'off'}): {vs['equal']}/{vs['requests']} {verdict}"
              + (" MISMATCH" if must and not equal else ""))
EOF
note "== total: $(( $(date +%s) - started )) s of a ${budget} s budget; details in $out"
echo
cat "$summary"
exit $status
