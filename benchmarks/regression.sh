#!/usr/bin/env bash
# Two versions of corelib side by side on one GPU, interleaved: in-process and SHM TPOT (async handoff)
# at bs 1 and 32 on small-0.6b, ROUNDS rounds of before then after, then the ratio table.
# Usage: benchmarks/regression.sh OUTDIR AFTER_SITE BEFORE_SITE [overrides...]
#   AFTER_SITE / BEFORE_SITE: directories holding corelib and its backends (pip install --no-deps --target),
#   each version's own; hydra-core and omegaconf must be importable (DEPS_SITE is prepended when set).
set -uo pipefail
out=${1:?usage: regression.sh OUTDIR AFTER_SITE BEFORE_SITE [overrides...]}
after=${2:?}; before=${3:?}; shift 3
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$out" || exit 1  # from the repository's root, python -m corelib would import the checkout
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
deps=${DEPS_SITE:+:$DEPS_SITE}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for version in before after; do
    site=$before; [ "$version" = after ] && site=$after
    name="$version-$round"; t0=$(date +%s)
    PYTHONPATH="$site$deps" timeout --kill-after=10 "${CAP:-120}" python3 -m corelib bench backend=cuda \
      backend.runtime=native model=small-0.6b bench=h200 "bench.transport=[inproc,shm]" "bench.handoff=[on]" \
      "bench.materialization=[auto]" "bench.batch_sizes=[1,32]" bench.repeats=2 bench.warmup_steps=8 \
      "engine.graph_batch_sizes=[1,32]" "$@" hydra.run.dir="$out/$name" >"$out/$name.log" 2>&1
    echo "== $name: exit $? in $(($(date +%s) - t0)) s"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
tpot: dict[tuple[str, str, int], list[float]] = {}
for path in sorted(out.glob("*-*/bench.json")):
    version = path.parent.name.split("-")[0]
    for p in json.loads(path.read_text())["points"]:
        tpot.setdefault((version, p["transport"], p["batch_size"]), []).append(p["tpot_ms"])
print(f"{'transport':<9} {'bs':>3} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
for transport, batch in sorted({(t, b) for _, t, b in tpot}):
    b, a = tpot.get(("before", transport, batch)), tpot.get(("after", transport, batch))
    if a and b:
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"{transport:<9} {batch:>3} {mb:>10.3f} {ma:>10.3f} {ma / mb:>13.3f}")
PY
