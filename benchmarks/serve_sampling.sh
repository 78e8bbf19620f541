#!/usr/bin/env bash
# Two versions' servers under the same bench-serve load on one GPU, greedy and at temperature 1 (what clients
# send when they set nothing): 64 clients, then 64 requests/s (Poisson), 32-token prompts, 128 tokens each.
# Usage: benchmarks/serve_sampling.sh OUTDIR AFTER_SITE BEFORE_SITE
#   AFTER_SITE / BEFORE_SITE: directories holding corelib, its backends and the serve extra (pip install --no-deps
#   --target), each version's own; the load generator is AFTER_SITE's bench-serve (server.bench.temperature).
# For a dry run elsewhere: MODEL=tiny DEVICE="backend=npu" benchmarks/serve_sampling.sh ...
set -uo pipefail
out=${1:?usage: serve_sampling.sh OUTDIR AFTER_SITE BEFORE_SITE}
after=${2:?}; before=${3:?}
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$out" || exit 1  # from the repository's root, python -m corelib would import the checkout
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
port=${PORT:-8123}
for which in before after; do
  site=$before; [ "$which" = after ] && site=$after
  PYTHONPATH="$site" python3 -m corelib serve model="${MODEL:-small-0.6b}" ${DEVICE:-backend=cuda backend.runtime=native} \
    engine.async_token_handoff=on 'engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]' engine.max_num_seqs=128 \
    server.port="$port" server.log_level=warning server.shutdown_grace_s=2 hydra.run.dir="$out/$which-server" \
    >"$out/$which-server.log" 2>&1 &
  server=$!
  PYTHONPATH="$after" python3 "$repo/benchmarks/wait_for_server.py" "$port" "$server" \
    || echo "$which: the server did not come up; see $which-server.log"
  for t in 0.0 1.0; do
    for point in "warm 'server.bench.concurrency=[64]' server.bench.num_requests=128" \
                 "c64 'server.bench.concurrency=[64]' server.bench.num_requests=384" \
                 "r64 'server.bench.rates=[64]' 'server.bench.concurrency=[]' server.bench.num_requests=0 server.bench.duration_s=6"; do
      name=${point%% *}; args=${point#* }
      eval PYTHONPATH="$after" timeout 120 python3 -m corelib bench-serve server.port="$port" server.bench.prompt_len=32 \
        server.bench.output_len=128 server.bench.sample_s=0 server.bench.settle_s=5 server.bench.temperature="$t" \
        "$args" hydra.run.dir="$out/$which-t$t-$name" >"$out/$which-t$t-$name.log" 2>&1 || echo "$which t$t $name failed"
    done
  done
  kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("server | temperature | load | req | lost | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms")
for which in ("before", "after"):
    for t in ("0.0", "1.0"):
        for name in ("c64", "r64"):
            try:
                point = json.loads((out / f"{which}-t{t}-{name}" / "bench_serve.json").read_text())["points"][0]
            except (OSError, ValueError, KeyError, IndexError) as error:
                print(which, t, name, "no result:", error)
                continue
            f = lambda k: "-" if point.get(k) is None else f"{point[k]:.1f}"
            print(f"{which} | {t} | {name} | {point['requests']} | {point['lost']} | {f('output_tokens_per_s')} | "
                  f"{f('ttft_ms_p50')}/{f('ttft_ms_p99')} | {f('tpot_ms_p50')}/{f('tpot_ms_p99')}")
PY
