#!/usr/bin/env bash
# Every H200 figure of the ragged step in one run (about 5 minutes with small-0.6b):
#   1. decode-only TPOT at batch 1 and 32, this tree against the base commit, in the same run;
#   2. greedy float32 tokens equal with chunked prefill off / 16 / 64 / 512 and prefix caching on / off;
#   3. shared prefix: a 1,024-token system prompt + a 32-token question, 256 requests at concurrency 16,
#      prefix caching off then on (TTFT p50, requests/s, hit rate);
#   4. mixed traffic: Poisson arrivals of 1,500-token prompts while 32 requests decode, chunked prefill
#      off then on (the decoders' inter-token p50 / p99).
# Usage: benchmarks/ragged_h200.sh OUTDIR   (prints a short table; details under OUTDIR)
# BASE=DIR: a checkout of the base commit for (1); without it, one is made with `git worktree` from
# BASE_COMMIT (default 6413ed0) when this is a git checkout, else (1) measures this tree only.
# Assumes corelib with the serve extra and the cuda backend (Triton) are installed from this tree.
# For a dry run elsewhere: MODEL=tiny DEVICE="backend=npu" QUICK=1 benchmarks/ragged_h200.sh /tmp/dry
# (RATE=N: the mixed traffic's arrivals per second, default 16; DECODER_LEN=N: each decoder's tokens, default 2048;
#  CHUNKED="off on": the chunked prefill modes of part 4; MIXED_BUDGET=N: its token budget, default 512)
set -uo pipefail
out=${1:?usage: ragged_h200.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
port=${PORT:-8124}
model=${MODEL:-small-0.6b}
device=(${DEVICE:-backend=cuda backend.runtime=native})
quick=${QUICK:-0}
parts=${PARTS:-1234}  # which of the four parts to run (the table reads whatever OUTDIR holds)
status=0
echo "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)" \
  "cpus: $(nproc)  date: $(date -u +%F)  commit: $(git -C "$here" rev-parse --short HEAD 2>/dev/null)" \
  | tee "$out/summary.txt"

# ---------------------------------------------------------------------------- 1. decode before / after
base=${BASE:-}
if [ -z "$base" ] && [ -d "$out/base-tree" ]; then
  base="$out/base-tree"  # made by an earlier run into this OUTDIR
elif [ -z "$base" ] && [[ $parts == *1* ]] && git -C "$here" rev-parse --git-dir >/dev/null 2>&1; then
  base="$out/base-tree"
  git -C "$here" worktree add --detach "$base" "${BASE_COMMIT:-6413ed0}" >"$out/base-tree.log" 2>&1 \
    || { echo "no base checkout (see $out/base-tree.log): decode measured on this tree only"; base=""; }
fi
decode() {  # decode NAME TREE: bench of decode-only steps at batch 1 and 32, corelib and its backends from TREE
  local name=$1 tree=$2
  # python -m puts the working directory first on sys.path: run from TREE, its backends ahead of the installed ones;
  # the config tree ships as corelib.conf, which the installed (editable) corelib would map to this tree's conf/
  [ -e "$tree/corelib/conf" ] || ln -s ../conf "$tree/corelib/conf"
  (cd "$tree" && PYTHONPATH="$tree/backends/cpu:$tree/backends/cuda:$tree/backends/npu:$tree/backends/mlu${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m corelib bench model="$model" "${device[@]}" bench=h200 'bench.batch_sizes=[1,32]' \
    'bench.handoff=[on]' 'bench.transport=[inproc]' bench.repeats=5 hydra.run.dir="$out/$name") \
    >"$out/$name.log" 2>&1 || status=1
}
if [[ $parts != *1* ]]; then
  :
elif [ -n "$base" ]; then
  decode decode-before "$base"
  decode decode-after "$here"
  decode decode-before-2 "$base"  # before, after, before, after: drift shows as a gap between the repeats
  decode decode-after-2 "$here"
else
  decode decode-after "$here"
fi

# ---------------------------------------------------------------------------- 2. the same tokens
[[ $parts != *2* ]] || python3 - "$out" "$model" "${device[@]}" <<'EOF' >"$out/tokens.log" 2>&1 || status=1
import json, random, sys
from corelib.engine import Engine, SamplingParams
out, model, device = sys.argv[1], sys.argv[2], sys.argv[3:]
rng = random.Random(0)
system = [rng.randrange(2, 5000) for _ in range(300)]
prompts = [(system if i % 3 == 0 else []) + [rng.randrange(2, 5000) for _ in range(rng.choice((1, 17, 200, 700)))]
           for i in range(24)]
params = [SamplingParams(max_tokens=rng.randint(8, 48), ignore_eos=True) for _ in prompts]
base = [f"model={model}", "model.dtype=float32", *device, "engine.max_num_seqs=16", "model.max_model_len=1024"]
runs = {}
for chunk in (None, 16, 64, 512):
    for caching in ("off", "on"):
        chunked = ["engine.chunked_prefill=off"] if chunk is None else [
            "engine.chunked_prefill=on", f"engine.max_num_batched_tokens={chunk}"]
        with Engine.from_overrides([*base, *chunked, f"engine.prefix_caching={caching}"]) as engine:
            outputs = []
            for i in range(0, len(prompts), 6):  # a few at a time: later ones find earlier prefixes cached
                outputs += [o.output_token_ids for o in engine.generate(prompts[i:i + 6], params[i:i + 6])]
            blocks = engine.stats()
            runs[f"chunk={chunk} cache={caching}"] = {
                "tokens": outputs, "hit_rate": engine.metrics(1.0)["prefix_cache_hit_rate"],
                "all_blocks_free": blocks.kv_blocks_free == blocks.kv_blocks_total}
first = next(iter(runs.values()))["tokens"]
table = {name: {"equal": run["tokens"] == first, "hit_rate": run["hit_rate"], "all_blocks_free": run["all_blocks_free"]}
         for name, run in runs.items()}
json.dump(table, open(f"{out}/tokens.json", "w"), indent=2)
print(json.dumps(table))
EOF

# ---------------------------------------------------------------------------- 3, 4: the server
serve() {  # serve NAME overrides...: start a server in the background, wait for /health
  local name=$1; shift
  python3 -m corelib serve model="$model" "${device[@]}" engine.async_token_handoff=on engine.max_num_seqs=64 \
    model.max_model_len=4096 server.port="$port" server.log_level=warning server.shutdown_grace_s=2 "$@" \
    hydra.run.dir="$out/$name-server" >"$out/$name-server.log" 2>&1 &
  server=$!
  python3 "$here/benchmarks/wait_for_server.py" "$port" "$server" || { echo "the $name server did not come up; see $out/$name-server.log"; return 1; }
}
stop() { kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null; }
trap 'kill -TERM ${server:-0} 2>/dev/null' EXIT
load() {  # load NAME overrides...: one bench-serve run against the server
  local name=$1; shift
  python3 -m corelib bench-serve server.port="$port" server.bench.sample_s=0 "$@" hydra.run.dir="$out/$name" \
    >"$out/$name.log" 2>&1 || status=1
}
shared=(server.bench.shared_prefix_len=1024 server.bench.prompt_len=32 server.bench.output_len=64
        'server.bench.concurrency=[16]' server.bench.num_requests=$([ "$quick" = 1 ] && echo 32 || echo 256))
mixed=(server.bench.prompt_len=1500 server.bench.output_len=64 "server.bench.rates=[${RATE:-16}]" 'server.bench.concurrency=[]'
       server.bench.num_requests=0 server.bench.duration_s=$([ "$quick" = 1 ] && echo 2 || echo 10)
       server.bench.decoders=32 server.bench.decoder_output_len="${DECODER_LEN:-2048}")
for caching in off on; do
  [[ $parts == *3* ]] || break
  if serve "prefix-$caching" engine.prefix_caching="$caching" engine.chunked_prefill=on; then
    load "prefix-$caching-warmup" "${shared[@]}" server.bench.num_requests=16 server.bench.shared_prefix_len=0
    load "prefix-$caching" "${shared[@]}"
  else status=1; fi
  stop
done
for chunked in ${CHUNKED:-off on}; do
  [[ $parts == *4* ]] || break
  if serve "mixed-$chunked" engine.chunked_prefill="$chunked" engine.prefix_caching=off \
      engine.max_num_batched_tokens="${MIXED_BUDGET:-512}"; then
    load "mixed-$chunked-warmup" 'server.bench.concurrency=[32]' server.bench.num_requests=64
    load "mixed-$chunked" "${mixed[@]}"
  else status=1; fi
  stop
done

# ---------------------------------------------------------------------------- the table
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
def tpot(name):
    bench = read(f"{name}/bench.json")
    return {p["batch_size"]: p["tpot_ms"] for p in bench["points"]} if bench else {}
after = [tpot("decode-after"), tpot("decode-after-2")]
before = [tpot("decode-before"), tpot("decode-before-2")] if (out / "decode-before").exists() else []
print("1. decode-only TPOT ms (async, in process): batch  before  after  after/before")
for bs in (1, 32):
    a = [t[bs] for t in after if bs in t]
    b = [t[bs] for t in before if bs in t]
    am, bm = (min(a) if a else math.nan), (min(b) if b else math.nan)
    print(f"   bs {bs:>3}: {bm:8.3f} {am:8.3f} {am / bm:8.3f}   (runs: before {b}, after {a})")
tokens = read("tokens.json") or {}
print("2. greedy float32 tokens, against chunk=None cache=off:",
      ", ".join(f"{k}: {'equal' if v['equal'] else 'DIFFER'}" for k, v in tokens.items()),
      "; every KV block free after each:", all(v["all_blocks_free"] for v in tokens.values()) if tokens else "-")
def point(name):
    result = read(f"{name}/bench_serve.json")
    return result["points"][0] if result else None
off, on = point("prefix-off"), point("prefix-on")
if off and on:
    print("3. shared prefix (1,024 + 32 tokens, 256 requests, 16 clients): TTFT p50 ms, req/s, hit rate")
    for label, p in (("caching off", off), ("caching on", on)):
        print(f"   {label:>11}: TTFT p50 {p['ttft_ms_p50']:.1f}  p99 {p['ttft_ms_p99']:.1f}  {p['requests_per_s']:.2f} req/s"
              f"  hits {p['prefix_cache_hit_rate']}")
    print(f"   on / off: TTFT p50 {on['ttft_ms_p50'] / off['ttft_ms_p50']:.3f} (target <= 0.25), "
          f"req/s {on['requests_per_s'] / off['requests_per_s']:.2f} (target >= 4)")
print("4. mixed traffic (1,500-token prompts, Poisson, while 32 decode): decoders' inter-token ms p50 / p99")
for label in ("off", "on"):
    p = point(f"mixed-{label}")
    if p:
        print(f"   chunked {label:>3}: {p['decoder_itl_ms_p50']:.3f} / {p['decoder_itl_ms_p99']:.3f} "
              f"(p99/p50 {p['decoder_itl_ms_p99'] / p['decoder_itl_ms_p50']:.2f}, target <= 1.5 with chunking); "
              f"arrivals: TTFT p50 {p['ttft_ms_p50']:.1f} ms, TPOT p50/p99 {p['tpot_ms_p50']:.3f}/{p['tpot_ms_p99']:.3f}")
EOF
[ -n "${BASE:-}" ] || [ ! -d "$out/base-tree" ] || git -C "$here" worktree remove --force "$out/base-tree" >/dev/null 2>&1
exit $status
