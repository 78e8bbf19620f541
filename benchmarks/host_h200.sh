#!/usr/bin/env bash
# The host side at sub-millisecond steps, on one H200, in one run of about 4 minutes:
#   a  python -m corelib bench, small-0.6b, async on, in-process and SHM ordered, bs 1 8 32 64 128:
#      TPOT, occupancy, host time per step (schedule + pack + post-process, measured in the engine),
#      the SHM hop (producer commit to inputs staged in the worker) p50/p99              ~100 s
#   b  benchmarks/host_step.py: the host's work per decode step alone at bs 1..256 on this CPU   ~20 s
#   c  only with BEFORE=DIR (a checkout of the previous release, e.g. `git worktree add DIR 6413ed0`):
#      in-process async TPOT at bs 1 and 32, this tree and DIR alternately (a b a b)     ~80 s
#
# Usage: benchmarks/host_h200.sh OUTDIR [extra overrides]     (BEFORE=DIR, SPIN_US=2000, BUDGET_S=260)
# Needs corelib and its backends installed (pip install -e . -e backends/cuda ...) and one GPU.
#
# Targets: occupancy >= 99 % at bs 1..128; host time per step <= 0.4 ms at bs 128; SHM hop p50 <= 30 us
# and p99 <= 150 us at bs 1 and 32; ordered SHM TPOT <= 1.02 x in-process at bs 1, 32, 128; in-process
# async TPOT at bs 1 and 32 within 2 % of BEFORE's.
# Both ends of the SHM hop spin for engine.shm.spin_us before they sleep on their doorbell; SPIN_US
# (default 2000, about one step) keeps them spinning across a step on a host with cores to spare.
set -uo pipefail
out=${1:?usage: host_h200.sh OUTDIR [overrides...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 CORELIB_PROGRESS_INTERVAL=30
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
budget=${BUDGET_S:-260}
spin=${SPIN_US:-2000}
started=$(date +%s)
summary="$out/summary.txt"
: >"$summary"
status=0
note() { echo "$*" | tee -a "$summary"; }
left() { echo $((budget - ($(date +%s) - started))); }
part() {  # part NAME CAP_S command...: under timeout (the cap or what is left), logged to OUTDIR/NAME.log
  local name=$1 cap=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 15 ]; then note "== $name: skipped, the budget of ${budget} s is spent"; status=1; return 1; fi
  [ "$cap" -gt "$remaining" ] && cap=$remaining
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note "== $name: TIMED OUT after $(($(date +%s) - t0)) s"; status=1
  elif [ "$rc" != 0 ]; then note "== $name: FAILED (exit $rc); last lines:"; tail -3 "$out/$name.log" | tee -a "$summary"; status=1
  else note "== $name: ok in $(($(date +%s) - t0)) s"; fi
  return "$rc"
}
# HOST_BENCH_BACKEND / HOST_BENCH_MODEL: a dry run elsewhere, e.g. "backend=npu" and tiny on a CPU machine.
read -r -a backend <<<"${HOST_BENCH_BACKEND:-backend=cuda backend.runtime=native}"
common=("${backend[@]}" "model=${HOST_BENCH_MODEL:-small-0.6b}" bench=h200 "bench.handoff=[on]" bench.prompt_len=32
        bench.output_len=128 bench.warmup_steps=8 "engine.shm.spin_us=$spin")

note "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1); $(getconf _NPROCESSORS_ONLN) cores; $(date -u +%FT%TZ)"

# -- a: the engine's figures ------------------------------------------------------------------
part bench 150 python3 -m corelib bench "${common[@]}" "bench.transport=[inproc,shm]" "bench.materialization=[ordered]" \
  "bench.batch_sizes=[1,8,32,64,128]" bench.repeats=2 "engine.graph_batch_sizes=[1,8,32,64,128]" "$@" \
  hydra.run.dir="$out/bench"

# -- b: the host's work alone ------------------------------------------------------------------
part host_step 40 python3 benchmarks/host_step.py --batch-sizes 1 8 32 64 128 256 --steps 128 --repeats 3 \
  --out "$out/host_step.json"
sed -n '/^medians/,$p' "$out/host_step.log" >>"$summary"

# -- c: no regression against the previous release --------------------------------------------
if [ -n "${BEFORE:-}" ]; then
  # An editable install maps corelib.conf to this tree's conf/: give the other checkout its own.
  [ -e "$BEFORE/corelib/conf" ] || ln -s ../conf "$BEFORE/corelib/conf"
  for turn in a b; do
    for tree in after before; do
      dir=$here; [ "$tree" = before ] && dir=$(cd "$BEFORE" && pwd)
      part "regression-$tree-$turn" 45 env PYTHONPATH="$dir" python3 -m corelib bench "${common[@]}" \
        "bench.transport=[inproc]" "bench.batch_sizes=[1,32]" bench.repeats=2 "engine.graph_batch_sizes=[1,32]" \
        "$@" hydra.run.dir="$out/regression-$tree-$turn"
    done
  done
fi

# -- summary -----------------------------------------------------------------------------------
python3 - "$out" >>"$summary" 2>&1 <<'EOF' || status=1
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
path = out / "bench" / "bench.json"
if not path.exists():
    sys.exit("== no bench/bench.json (see bench.log)")
points = {(p["transport"], p["batch_size"]): p for p in json.loads(path.read_text())["points"]}
missed = []
print(f"{'bs':>4} {'inproc ms':>10} {'shm ms':>8} {'shm/in':>7} {'occ. in':>8} {'occ. shm':>9} {'host us':>8} "
      f"{'hop p50/p99 us':>15}")
for bs in sorted({b for _, b in points}):
    inproc, shm = points.get(("inproc", bs)), points.get(("shm", bs))
    def ms(p): return "-" if p is None else f"{p['tpot_ms']:.3f}"
    def occ(p): return "-" if p is None or p["occupancy"] is None else f"{100 * p['occupancy']:.1f}%"
    ratio = shm["tpot_ms"] / inproc["tpot_ms"] if shm and inproc else None
    host = inproc.get("host_us") if inproc else None
    hop = "-" if not shm or shm["transport_us_p50"] is None else f"{shm['transport_us_p50']:.0f}/{shm['transport_us_p99']:.0f}"
    print(f"{bs:>4} {ms(inproc):>10} {ms(shm):>8} {'-' if ratio is None else f'{ratio:.3f}':>7} {occ(inproc):>8} "
          f"{occ(shm):>9} {'-' if host is None else f'{host:.0f}':>8} {hop:>15}")
    for p, label in ((inproc, "in-process"), (shm, "shm")):
        if p and p["occupancy"] is not None and p["occupancy"] < 0.99:
            missed.append(f"occupancy {label} bs {bs}")
    if ratio is not None and bs in (1, 32, 128) and ratio > 1.02:
        missed.append(f"shm/in-process bs {bs} ({ratio:.3f})")
    if shm and bs in (1, 32) and shm["transport_us_p50"] is not None:
        if shm["transport_us_p50"] > 30 or shm["transport_us_p99"] > 150:
            missed.append(f"hop bs {bs}")
    if bs == 128 and host is not None and host > 400:
        missed.append(f"host time bs 128 ({host:.0f} us)")
regression = {}
for tree in ("after", "before"):
    for turn in ("a", "b"):
        found = out / f"regression-{tree}-{turn}" / "bench.json"
        if found.exists():
            for p in json.loads(found.read_text())["points"]:
                regression.setdefault((tree, p["batch_size"]), []).append(p["tpot_ms"])
if regression:
    print("== in-process async TPOT, this tree vs BEFORE (median of the turns)")
    for bs in (1, 32):
        now, then = regression.get(("after", bs)), regression.get(("before", bs))
        if now and then:
            change = statistics.median(now) / statistics.median(then)
            print(f"   bs {bs}: {statistics.median(now):.3f} ms vs {statistics.median(then):.3f} ms = {change:.3f}x")
            if change > 1.02:
                missed.append(f"regression bs {bs} ({change:.3f}x)")
print(f"== targets missed: {len(missed)}" + (f" ({'; '.join(missed)})" if missed else ""))
EOF
note "== total: $(( $(date +%s) - started )) s of ${budget} s; details in $out"
echo
cat "$summary"
exit $status
