#!/usr/bin/env bash
# The OpenAI-compatible server on one CUDA GPU: 64 concurrent streaming clients, the TPOT they see against
# the engine's own TPOT at batch 64 (python -m corelib bench), then a short request-rate sweep. About 2.5
# minutes on an H200 with small-0.6b.
# Usage: benchmarks/serve_h200.sh OUTDIR
# Assumes corelib with its serve extra and the cuda backend are installed
# (pip install -e ".[serve]" -e backends/cuda). PORT=N picks the port (default 8123); for a dry run
# elsewhere: MODEL=tiny DEVICE="backend=npu" REQUESTS=128 DURATION=3 benchmarks/serve_h200.sh /tmp/dry
# (RATES=a,b: the request rates of the sweep, default 16,64,256)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: serve_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
port=${PORT:-8123}
prompt_len=32
output_len=128
duration=${DURATION:-8}  # seconds per rate
requests=${REQUESTS:-640}  # requests of the 64-client run: 10 rounds of 64
engine=(model="${MODEL:-small-0.6b}" ${DEVICE:-backend=cuda backend.runtime=native} engine.async_token_handoff=on
        'engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]')
status=0

python3 -c "import fastapi, uvicorn, prometheus_client, jinja2, httpx" 2>/dev/null \
  || { echo "the serve extra is missing: pip install -e '.[serve]'" >&2; exit 2; }
echo "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)" \
  "cpus: $(nproc)  date: $(date -u +%F)" | tee "$out/summary.txt"

# 1. The engine alone: 64 sequences decoding together, async handoff on, the same prompt and output lengths.
python3 -m corelib bench "${engine[@]}" bench=h200 'bench.batch_sizes=[64]' 'bench.handoff=[on]' \
  'bench.transport=[inproc]' bench.prompt_len=$prompt_len bench.output_len=$output_len \
  hydra.run.dir="$out/engine" >"$out/engine.log" 2>&1 || status=1

# 2. The server (its engine in a process of its own), in the background; stopped with SIGTERM on the way out.
python3 -m corelib serve "${engine[@]}" engine.max_num_seqs=128 server.port="$port" server.log_level=warning \
  server.shutdown_grace_s=2 hydra.run.dir="$out/server" >"$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server' EXIT
python3 "$repo/benchmarks/wait_for_server.py" "$port" "$server" || { echo "the server did not come up; see $out/server.log" >&2; exit 1; }

load() {  # load NAME overrides...: one bench-serve run against the server
  local name=$1; shift
  python3 -m corelib bench-serve server.port="$port" server.bench.prompt_len=$prompt_len \
    server.bench.output_len=$output_len server.bench.sample_s=0 "$@" hydra.run.dir="$out/$name" \
    >"$out/$name.log" 2>&1 || status=1
}
load warmup 'server.bench.concurrency=[64]' server.bench.num_requests=128           # first requests warm up
load clients64 'server.bench.concurrency=[64]' server.bench.num_requests="$requests"
load rates "server.bench.rates=[${RATES:-16,64,256}]" 'server.bench.concurrency=[]' server.bench.num_requests=0 \
  server.bench.duration_s="$duration"

# 3. The table: what clients saw against what the engine does alone at batch 64.
python3 - "$out" <<'EOF' | tee -a "$out/summary.txt"
import json, math, sys
from pathlib import Path
out = Path(sys.argv[1])
def read(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as error:
        print(f"{name}: not written ({error}); see its log")
        return None
bench = read("engine/bench.json")
engine = bench["points"][0] if bench else None
if engine:
    print(f"engine alone (bench, batch {engine['batch_size']}, async on): TPOT {engine['tpot_ms']:.3f} ms, "
          f"{engine['tokens_per_s']:.0f} tok/s")
clients = read("clients64/bench_serve.json")
if clients and engine:
    p = clients["points"][0]
    server_tpot = p["tpot_ms_p50"] or math.nan
    print(f"64 clients: server TPOT {server_tpot:.3f} ms (p50 over requests), engine TPOT {engine['tpot_ms']:.3f} ms "
          f"(alone, batch 64): ratio {server_tpot / engine['tpot_ms']:.3f}")
    inside = p.get("engine_tpot_ms_mean")
    if inside and p.get("tpot_ms_mean"):
        print(f"   means over the same requests: clients {p['tpot_ms_mean']:.3f} ms, the engine inside the server "
              f"{inside:.3f} ms: ratio {p['tpot_ms_mean'] / inside:.3f} (what streaming added)")
print(f"{'load':>12} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'/engine':>8} "
      f"{'engine in srv':>13} {'refused':>7} {'lost':>5} {'dup':>4}")
for name in ("clients64", "rates"):
    result = read(f"{name}/bench_serve.json")
    if not result:
        continue
    for p in result["points"]:
        unit = "req/s" if p["mode"] == "rate" else "clients"
        tpot = p["tpot_ms_p50"] or math.nan
        ratio = tpot / engine["tpot_ms"] if engine else math.nan
        inside = p.get("engine_tpot_ms_mean") or math.nan
        print(f"{p['load']:>6g} {unit:<5} {p['requests_per_s']:>7.1f} {p['output_tokens_per_s']:>8.0f} "
              f"{p['ttft_ms_p50'] or 0:>8.1f}/{p['ttft_ms_p99'] or 0:<8.1f} {tpot:>8.3f}/{p['tpot_ms_p99'] or 0:<8.3f} "
              f"{ratio:>8.3f} {inside:>13.3f} {p['refused']:>7} {p['lost']:>5} {p['duplicated']:>4}")
    after = result["server_after"]
    print(f"   after {name}: KV blocks free {after.get('corelib_kv_blocks_free', math.nan):.0f} of "
          f"{after.get('corelib_kv_blocks_total', math.nan):.0f}, "
          f"resident {after.get('process_resident_memory_bytes', 0) / 2**20:.0f} MiB (server process), "
          f"{after.get('corelib_engine_process_resident_memory_bytes', 0) / 2**20:.0f} MiB (engine process)")
EOF
exit $status
