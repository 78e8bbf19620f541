#!/usr/bin/env bash
# The decode step (benchmarks/projection_tuning.py: one step replayed as a CUDA graph, Triton ops with PDL) under
# several versions of the cuda backend's kernels, alternating in one run, ROUNDS rounds (default 2).
# Usage: benchmarks/step_ab.sh OUTDIR LABEL=DIR [LABEL=DIR ...]
#   DIR: a directory holding corelib_cuda (a backends/cuda tree); "." for this checkout's. Make one of another
#   revision with: mkdir -p DIR && git archive REV backends/cuda/corelib_cuda | tar -x -C DIR --strip-components=2
# Environment: MODELS ("small-0.6b llama-1b"), BATCH ("1 8 32"), CTX (context tokens, 64), PROFILE (replays under
# the profiler in the first round, 0: none). Needs corelib's dependencies importable (the checkout's corelib is used).
set -uo pipefail
out=${1:?usage: step_ab.sh OUTDIR LABEL=DIR [LABEL=DIR ...]}
shift
[ $# -ge 1 ] || { echo "step_ab.sh: name at least one LABEL=DIR" >&2; exit 2; }
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
read -r -a models <<<"${MODELS:-small-0.6b llama-1b}"
read -r -a batches <<<"${BATCH:-1 8 32}"
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in "$@"; do
    label=${side%%=*}; dir=${side#*=}
    [ "$dir" = . ] && dir=$repo/backends/cuda
    [ -d "$dir/corelib_cuda" ] || { echo "step_ab.sh: $dir holds no corelib_cuda" >&2; exit 2; }
    profile=0; [ "$round" = 1 ] && profile=${PROFILE:-0}
    name="$label-$round"
    PYTHONPATH="$(cd "$dir" && pwd):$repo:$repo/benchmarks${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "${CAP:-300}" \
      python3 "$repo/benchmarks/projection_tuning.py" --models "${models[@]}" --profile "$profile" \
      --context "${CTX:-64}" --out "$out/$name.json" --config "$label" '{}' "${batches[@]}" >"$out/$name.txt" 2>&1
    rc=$?
    [ "$rc" = 0 ] || { status=1; echo "== $name: exit $rc (see $out/$name.txt)"; }
    grep " us err" "$out/$name.txt"
  done
done
exit $status
