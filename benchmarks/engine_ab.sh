#!/usr/bin/env bash
# The engine's TPOT under several trees of corelib and its backends, alternating in one run, ROUNDS rounds (default 2):
# `python -m corelib bench`, async, in process, greedy, each tree first on PYTHONPATH; then a table of each label's
# median TPOT per model and batch size, against the first label's.
# Usage: benchmarks/engine_ab.sh OUTDIR LABEL=DIR[@JSON] [LABEL=DIR[@JSON] ...]
#   DIR: a tree holding corelib/ (with its conf link), conf/ and backends/; "." for this checkout. Make one of another
#   revision with: mkdir -p DIR && git archive REV corelib backends conf | tar -x -C DIR
#   @JSON: that run goes through benchmarks/tuning_bench.py with the CUDA projections' Tuning fields changed (a kernel
#   choice A/B within one tree), e.g. base=. 'tc=.@{"gemm_max_k": 2048}'
# Environment: MODELS ("small-0.6b"), BATCH ("1 32"), DEVICE ("backend=cuda backend.runtime=native"), EXTRA (more
# overrides, space-separated), CAP (seconds a run, 300). corelib's dependencies must be importable; runs from OUTDIR,
# as `python -m corelib` from the repository's root would import the checkout's corelib whatever PYTHONPATH says.
# A dry run without a GPU (the stream emulator): DEVICE=backend=npu MODELS=tiny ROUNDS=1 benchmarks/engine_ab.sh OUT a=. b=.
set -uo pipefail
out=${1:?usage: engine_ab.sh OUTDIR LABEL=DIR [LABEL=DIR ...]}
shift
[ $# -ge 1 ] || { echo "engine_ab.sh: name at least one LABEL=DIR" >&2; exit 2; }
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
read -r -a device <<<"${DEVICE:-backend=cuda backend.runtime=native}"
read -r -a models <<<"${MODELS:-small-0.6b}"
read -r -a batches <<<"${BATCH:-1 32}"
read -r -a extra <<<"${EXTRA:-}"
sizes=$(IFS=,; echo "${batches[*]}")
trees=()
for side in "$@"; do
  label=${side%%=*}; dir=${side#*=}; tuning=
  [[ "$dir" == *@* ]] && { tuning=${dir#*@}; dir=${dir%%@*}; }
  [[ "$label" =~ ^[A-Za-z0-9_.]+$ ]] || { echo "engine_ab.sh: label '$label' (letters, digits, _ and . only)" >&2; exit 2; }
  [ "$dir" = . ] && dir=$repo
  [ -d "$dir/corelib" ] && [ -d "$dir/backends" ] || { echo "engine_ab.sh: $dir holds no corelib/ and backends/" >&2; exit 2; }
  dir=$(cd "$dir" && pwd)
  trees+=("$label=$dir@$tuning")
done
cd "$out" || exit 1
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for model in "${models[@]}"; do
    for side in "${trees[@]}"; do
      label=${side%%=*}; dir=${side#*=}; tuning=${dir#*@}; dir=${dir%%@*}
      name="$label-$model-$round"
      bench=(-m corelib bench)
      [ -n "$tuning" ] && bench=("$repo/benchmarks/tuning_bench.py" "$tuning" bench)
      path="$dir"
      for backend in "$dir"/backends/*/; do path="$path:${backend%/}"; done
      path="$path${PYTHONPATH:+:$PYTHONPATH}"
      # the log's first line names the tree each run imported
      PYTHONPATH="$path" python3 -c 'import corelib; print("corelib from", corelib.__file__)' >"$out/$name.log" 2>&1
      PYTHONPATH="$path" timeout --kill-after=10 "${CAP:-300}" \
        python3 "${bench[@]}" "${device[@]}" bench=h200 "model=$model" model.init=device bench.warmup_steps=8 \
        "bench.transport=[inproc]" "bench.handoff=[on]" "bench.prompt_lens=[]" "bench.batch_sizes=[$sizes]" \
        "${extra[@]}" hydra.run.dir="$out/$name" >>"$out/$name.log" 2>&1
      rc=$?
      [ "$rc" = 0 ] || { status=1; echo "== $name: exit $rc (see $out/$name.log)"; tail -3 "$out/$name.log"; }
    done
  done
done
python3 - "$out" "${trees[@]%%=*}" <<'EOF' || status=1
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

out, labels = Path(sys.argv[1]), sys.argv[2:]
tpot: dict[tuple[str, str, int], list[float]] = defaultdict(list)
for path in sorted(out.glob("*/bench.json")):
    label, _, rest = path.parent.name.partition("-")
    model = rest.rsplit("-", 1)[0]
    for point in json.loads(path.read_text())["points"]:
        tpot[(label, model, point["batch_size"])].append(point["tpot_ms"])
first = labels[0]
print(f"{'model':>12} {'bs':>4} " + " ".join(f"{label:>22}" for label in labels))
for model, batch in sorted({(m, b) for _, m, b in tpot}):
    base = tpot.get((first, model, batch))
    cells = []
    for label in labels:
        runs = tpot.get((label, model, batch))
        if not runs:
            cells.append(f"{'-':>22}")
            continue
        ratio = f" ({statistics.median(runs) / statistics.median(base):.3f})" if base and label != first else ""
        cells.append(f"{' / '.join(f'{r:.3f}' for r in runs) + ratio:>22}")
    print(f"{model:>12} {batch:>4} " + " ".join(cells))
EOF
exit $status
