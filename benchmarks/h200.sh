#!/usr/bin/env bash
# GPU checks and benchmarks behind BENCHMARKS.md, in one go on a CUDA machine.
# Usage: benchmarks/h200.sh OUTDIR [sections...]
#   sections: tests race tp allreduce bench compile peers trace   (default: all; tp and allreduce need 2 GPUs)
# Assumes corelib and its backends are installed (pip install --no-deps -e . -e backends/...).
set -uo pipefail
out=${1:?usage: h200.sh OUTDIR [sections]}
shift
sections=${*:-tests tp allreduce bench compile peers trace}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
status=0
summary="$out/summary.txt"
touch "$summary"
graphs='engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]'

note() { echo "$*" | tee -a "$summary"; }
table() { grep -E "^│" "$1" >>"$summary" || true; }
bench() {  # bench NAME overrides...
  local name=$1; shift
  python3 -m corelib bench backend=cuda backend.runtime=native "$@" hydra.run.dir="$out/$name" \
    >"$out/$name.log" 2>&1
  local rc=$?; [ "$rc" = 0 ] || status=1
  note "== bench $name: exit $rc"; table "$out/$name.log"; tail -3 "$out/$name.log" | grep -v "^│" >>"$summary"
}

note "== machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)"
note "== torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')  date: $(date -u +%F)"

for section in $sections; do
  case $section in
    tests)  # native cuda: conformance, engine, SHM race on registered memory, tensor parallelism; the test
            # of close() CLOSE_REPEATS more times inside (default 20); -v names each test's worker, so a failure
            # can be read against what ran before it in the same process
      python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" \
        --corelib-repeat-close "${CLOSE_REPEATS:-20}" -n "${GPU_TEST_WORKERS:-6}" \
        --junitxml="$out/gpu-tests.xml" tests >"$out/gpu-tests.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      note "== gpu tests: exit $rc; $(tail -1 "$out/gpu-tests.log")"
      grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" >>"$summary" || true
      ;;
    tp)
      bench tp model=small-0.6b "bench.tp=[1,2]" "bench.transport=[shm]" "bench.materialization=[early]" \
        "bench.batch_sizes=[1,32]" "$graphs"
      ;;
    bench)  # in-process sync vs async; SHM early vs ordered (async) with transport latency; tiny
      bench small model=small-0.6b bench=h200 "bench.transport=[inproc]" "bench.batch_sizes=[1,8,32,64]" "$graphs"
      bench small-shm model=small-0.6b bench=h200 "bench.transport=[shm]" "bench.handoff=[on]" \
        "bench.batch_sizes=[1,32,128]" bench.repeats=2 "$graphs"
      bench tiny model=tiny bench=h200 "bench.transport=[inproc]" "bench.batch_sizes=[1,32]" bench.repeats=2
      ;;
    race)  # the SHM race on host-registered memory
      python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" \
        tests/transport/test_race.py >"$out/race.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      note "== race: exit $rc; $(tail -1 "$out/race.log")"
      ;;
    allreduce)
      python3 benchmarks/allreduce.py --layers 28 --hidden 1024 --batch 1 32 --out "$out/allreduce.json" \
        >"$out/allreduce.log" 2>&1 || status=1
      note "== all-reduce alone:"; grep "all-reduce per" "$out/allreduce.log" >>"$summary"
      ;;
    compile)
      bench compiled model=small-0.6b bench=h200 engine.compile=true "bench.transport=[inproc]" \
        "bench.batch_sizes=[1,32]"
      ;;
    peers)
      python3 benchmarks/peers.py --repeats 2 --out "$out/peers.json" >"$out/peers.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || status=1
      note "== peers: exit $rc"; tail -12 "$out/peers.log" >>"$summary"
      ;;
    trace)
      for handoff in off on; do
        python3 -m corelib run backend=cuda backend.runtime=native model=small-0.6b engine.trace=true \
          engine.async_token_handoff=$handoff workload.num_requests=8 workload.prompt_len_min=32 \
          workload.prompt_len_max=32 workload.output_len_min=64 workload.output_len_max=64 workload.ignore_eos=true \
          hydra.run.dir="$out/trace-$handoff" >"$out/trace-$handoff.log" 2>&1 || status=1
      done
      python3 -m corelib trace-plot "$out/trace-off/trace.json" "$out/trace-on/trace.json" --steps 10 \
        --first-step 20 --labels "sync handoff" "async handoff" --out "$out/timeline.png" >>"$summary" 2>&1 || status=1
      note "== trace: $(ls "$out"/timeline.png 2>/dev/null)"
      ;;
    *) echo "unknown section $section" >&2; status=2 ;;
  esac
done
cat "$summary"
exit $status
