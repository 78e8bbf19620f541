#!/usr/bin/env bash
# JSON mode's cost on one GPU, and the host's share of it, in one call:
#   benchmarks/json_h200.sh OUT
# 1. benchmarks/json_mode.py: 100 requests with a JSON schema against plain decoding, both schemas, the masks
#    computed the engine's way for this machine and then the other way (the mask thread or the loop's thread);
# 2. benchmarks/json_host.py --full: the host's calls of a JSON step beside a plain step's;
# 3. benchmarks/json_paced.py at a 0.3 ms stand-in step: the host's own time per JSON step, the mask thread on
#    and off, alternating;
# 4. benchmarks/mask_threads.py: one step's masks by thread count and template grouping.
# Each part runs under a timeout; OUT/summary.txt gathers what they print.
set -uo pipefail
out="${1:?usage: benchmarks/json_h200.sh OUT}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
summary="$out/summary.txt"; : >"$summary"
part() {  # part NAME CAP command...
  local name=$1 cap=$2; shift 2
  local t0; t0=$(date +%s)
  (cd "$here" && timeout --kill-after=10 "$cap" "$@") >"$out/$name.log" 2>&1
  echo "== $name: exit $? in $(($(date +%s) - t0)) s" >>"$summary"
  grep -E "ratio|TPOT|round|thread|median|ms for" "$out/$name.log" >>"$summary" || true
}
part json-mode 240 python3 json_mode.py --backend cuda --requests 100 --concurrency 32 --workdir "$out/json-model"
part json-host 150 python3 json_host.py --backend cuda --full --workdir "$out/json-model"
for round in 1 2; do
  for way in on off; do
    part "json-paced-$way-$round" 90 python3 json_paced.py --step-ms 0.3 --rounds 2 --mask-thread "$way" \
      --workdir "$out/json-tiny"
  done
done
part mask-threads 120 python3 mask_threads.py "$out/mask-threads"
cat "$summary"
