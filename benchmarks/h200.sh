#!/usr/bin/env bash
# GPU checks and benchmarks behind BENCHMARKS.md, in one go on a CUDA machine.
# Usage: benchmarks/h200.sh OUTDIR [sections...]   sections: tests bench peers race (default: all)
# Assumes corelib and its backends are installed (pip install --no-deps -e . -e backends/...).
set -uo pipefail
out=${1:?usage: h200.sh OUTDIR [sections]}
shift
sections=${*:-tests bench peers race}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
status=0
summary="$out/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

note "== machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
note "== torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')  date: $(date -u +%F)"

for section in $sections; do
  case $section in
    tests)
      # native cuda: the conformance suite and the engine's GPU tests (reference and async equivalence)
      python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" \
        --junitxml="$out/gpu-tests.xml" tests 2>&1 | tee "$out/gpu-tests.log" | tail -25
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
      note "== gpu tests: exit $rc; $(tail -1 "$out/gpu-tests.log")"
      ;;
    bench)
      for model in small-0.6b tiny; do
        python3 -m corelib bench bench=h200 backend=cuda backend.runtime=native model=$model \
          hydra.run.dir="$out/bench-$model" 2>&1 | tee "$out/bench-$model.log" | tail -14
        rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
        note "== bench $model: exit $rc"
        grep -E "^│" "$out/bench-$model.log" | tee -a "$summary" >/dev/null
      done
      ;;
    peers)
      python3 benchmarks/peers.py --out "$out/peers.json" 2>&1 | tee "$out/peers.log" | tail -12
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
      note "== peers: exit $rc"; tail -8 "$out/peers.log" >>"$summary"
      ;;
    race)
      python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-p corelib.testing.plugin -ra" \
        tests/transport 2>&1 | tee "$out/race.log" | tail -8
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
      note "== shm race on host-registered memory: exit $rc; $(tail -1 "$out/race.log")"
      ;;
    *) echo "unknown section $section" >&2; status=2 ;;
  esac
done
cat "$summary"
exit $status
