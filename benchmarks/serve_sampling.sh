#!/usr/bin/env bash
# Two versions' servers under the same bench-serve load on one GPU, greedy and at temperature 1 (what clients
# send when they set nothing): 64 clients, then 64 requests/s (Poisson), 32-token prompts, 128 tokens each.
# Usage: benchmarks/serve_sampling.sh OUTDIR AFTER_SITE BEFORE_SITE
#   AFTER_SITE / BEFORE_SITE: directories holding corelib, its backends and the serve extra (pip install --no-deps
#   --target), or PYTHONPATH lists of them, each version's own; the load generator is AFTER_SITE's bench-serve
#   (server.bench.temperature). ROUNDS (default 1): round 1 serves before then after, round 2 after then before,
#   and so on: at 64 clients runs have differed by up to 24 % (the second server slower in two runs, not in a third
#   that served one tree twice), so compare rounds.
# For a dry run elsewhere: MODEL=tiny DEVICE="backend=npu" benchmarks/serve_sampling.sh ...
set -uo pipefail
out=${1:?usage: serve_sampling.sh OUTDIR AFTER_SITE BEFORE_SITE}
after=${2:?}; before=${3:?}
mkdir -p "$out"; out=$(cd "$out" && pwd); repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$out" || exit 1  # from the repository's root, python -m corelib would import the checkout
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
port=${PORT:-8123}
for round in $(seq 1 "${ROUNDS:-1}"); do
  order="before after"; [ $((round % 2)) = 0 ] && order="after before"
  for which in $order; do
    site=$before; [ "$which" = after ] && site=$after
    run="$which-r$round"
    PYTHONPATH="$site" python3 -m corelib serve model="${MODEL:-small-0.6b}" ${DEVICE:-backend=cuda backend.runtime=native} \
      engine.async_token_handoff=on 'engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]' engine.max_num_seqs=128 \
      server.port="$port" server.log_level=warning server.shutdown_grace_s=2 hydra.run.dir="$out/$run-server" \
      >"$out/$run-server.log" 2>&1 &
    server=$!
    PYTHONPATH="$after" python3 "$repo/benchmarks/wait_for_server.py" "$port" "$server" \
      || echo "$run: the server did not come up; see $run-server.log"
    for t in 0.0 1.0; do
      for point in "warm 'server.bench.concurrency=[64]' server.bench.num_requests=128" \
                   "c64 'server.bench.concurrency=[64]' server.bench.num_requests=384" \
                   "r64 'server.bench.rates=[64]' 'server.bench.concurrency=[]' server.bench.num_requests=0 server.bench.duration_s=6"; do
        name=${point%% *}; args=${point#* }
        eval PYTHONPATH="$after" timeout 120 python3 -m corelib bench-serve server.port="$port" server.bench.prompt_len=32 \
          server.bench.output_len=128 server.bench.sample_s=0 server.bench.settle_s=5 server.bench.temperature="$t" \
          "$args" hydra.run.dir="$out/$run-t$t-$name" >"$out/$run-t$t-$name.log" 2>&1 || echo "$run t$t $name failed"
      done
    done
    kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
  done
done
python3 - "$out" "${ROUNDS:-1}" <<'PY' | tee "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("server | round, place | temperature | load | req | lost | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms")
for which in ("before", "after"):
    for rnd in range(1, int(sys.argv[2]) + 1):
        place = "first" if (which == "before") == (rnd % 2 == 1) else "second"
        for t in ("0.0", "1.0"):
            for name in ("c64", "r64"):
                run = f"{which}-r{rnd}-t{t}-{name}"
                try:
                    point = json.loads((out / run / "bench_serve.json").read_text())["points"][0]
                except (OSError, ValueError, KeyError, IndexError) as error:
                    print(run, "no result:", error)
                    continue
                f = lambda k: "-" if point.get(k) is None else f"{point[k]:.1f}"
                print(f"{which} | {rnd}, {place} | {t} | {name} | {point['requests']} | {point['lost']} | "
                      f"{f('output_tokens_per_s')} | {f('ttft_ms_p50')}/{f('ttft_ms_p99')} | "
                      f"{f('tpot_ms_p50')}/{f('tpot_ms_p99')}")
PY
