#!/usr/bin/env bash
# Every figure of the decode-at-the-weight-floor targets in one run on an H200, then the targets table.
# Usage: benchmarks/decode_floor.sh OUTDIR [sections...]
#   sections (default: all, in this order):
#     conformance  the op conformance suite on the GPU (the projections and fused ops, graph replay)
#     checks       greedy tokens: PDL on = off in float32 over >= 2000 steps, 3 times; fused = reference (fp32)
#     step         one decode step replayed as a graph: device time, PDL vs plain bit for bit, the bf16 bound
#     kernels      kernels per layer (benchmarks/kernels.py), small-0.6b and llama-1b, bs 1, 32 and 64: eager and in
#                  the graph-replayed step (--graph)
#     bandwidth    each projection kernel's achieved bandwidth against the copy rate, the three models at bs 1
#     bench        python -m corelib bench, async, in process: small-0.6b bs 1/32/128 and llama-1b bs 1/32 with
#                  PDL off and on (BENCH_PDL), llama-8b bs 1/32, long context (prompt 1900) bs 1/32; occupancy
#     before       with BEFORE_SITE set (an install of the previous release): the same small-0.6b and 1 B
#                  benches with it, in this run, for the before/after comparison
#     projections  the kernels against cuBLAS (the thresholds' sweep)
# Environment: CHECK_STEPS / CHECK_REPEATS (2000 / 3), KERNEL_BATCHES ("1 32 64"), BENCH_CAP (600 s per bench run),
# BEFORE_SITE (see before), SITE (below).
# Assumes corelib and its backends are installed (pip install --no-deps . backends/...), or SITE=DIR holding
# them (pip --target), with hydra-core and omegaconf. Runs from OUTDIR: from the repository's root,
# `python -m corelib` would import the checkout's corelib, whose conf/ is not inside the package.
set -uo pipefail
out=${1:?usage: decode_floor.sh OUTDIR [sections]}
shift
sections=${*:-conformance checks step kernels bandwidth bench before projections}
mkdir -p "$out"; out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$out" || exit 1
# Multicast (NVLS) collectives can take shared GPUs down: off in this shell and every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 CORELIB_PROGRESS_INTERVAL=60
[ -n "${SITE:-}" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"; : >"$summary"
status=0
note() { echo "$*" | tee -a "$summary"; }
part() {  # part NAME CAP command...: under timeout, logged to OUTDIR/NAME.log
  local name=$1 cap=$2; shift 2
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || status=1
  note "== $name: exit $rc in $(($(date +%s) - t0)) s"
  [ "$rc" = 0 ] || tail -5 "$out/$name.log" | sed 's/^/   /' | tee -a "$summary"
  return $rc
}
graphs='engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]'
bench() {  # bench NAME overrides...: one bench run, async, in process, random weights drawn on the GPU
  local name=$1; shift
  part "bench-$name" "${BENCH_CAP:-600}" python3 -m corelib bench backend=cuda backend.runtime=native bench=h200 \
    "bench.transport=[inproc]" "bench.handoff=[on]" model.init=device "$@" hydra.run.dir="$out/bench-$name"
  grep -E "^│" "$out/bench-$name.log" >>"$summary" || true
}
# The Llama-3.2-1B shape as the previous release composes it (it has no llama-1b preset).
llama1b_before=(model=llama-8b model.hidden_size=2048 model.num_layers=16 model.head_dim=64
  model.intermediate_size=8192 model.tie_word_embeddings=true model.rope_scaling.factor=32.0)

note "== machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
note "== torch/triton: $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')  $(date -u +%F)"
python3 -m corelib plan backend=cuda backend.runtime=native model=llama-1b >"$out/plan.log" 2>&1
grep -iE "pdl|fused_ops" "$out/plan.log" | head -4 | sed 's/^/   /' | tee -a "$summary"

for section in $sections; do
  case $section in
    conformance)
      part conformance 600 python3 -m pytest -q -p no:cacheprovider -o addopts="" -p corelib.testing.plugin \
        --pyargs corelib.testing.op_conformance --corelib-backend=cuda --corelib-runtime=native -m gpu \
        --junitxml="$out/conformance.xml"
      tail -1 "$out/conformance.log" | sed 's/^/   /' | tee -a "$summary"
      ;;
    checks)
      part checks 900 python3 "$repo/benchmarks/decode_checks.py" --steps "${CHECK_STEPS:-2000}" \
        --repeats "${CHECK_REPEATS:-3}" --out "$out/checks.json"
      grep -E "^(PDL|fused)" "$out/checks.log" | sed 's/^/   /' | tee -a "$summary"
      ;;
    step)
      part step 600 python3 "$repo/benchmarks/decode_step.py" --models small-0.6b llama-1b --batch 1 32 \
        --bf16-bound 64 --out "$out/step.json"
      grep -vE "^\{" "$out/step.log" | tail -8 | sed 's/^/   /' | tee -a "$summary"
      ;;
    kernels)
      # shellcheck disable=SC2086 # KERNEL_BATCHES is a list of batch sizes
      part kernels 600 python3 "$repo/benchmarks/kernels.py" --model small-0.6b llama-1b --batch ${KERNEL_BATCHES:-1 32 64} \
        --fused on --graph --graph-out "$out/graph_kernels.json" \
        --out "$out/kernels.json"
      grep -E "fused|reference" "$out/kernels.log" | grep -v "^ " | sed 's/^/   /' | tee -a "$summary"
      grep -A12 "graph-replayed" "$out/kernels.log" | cut -c1-160 | sed 's/^/   /' | tee -a "$summary"
      ;;
    bandwidth)
      part bandwidth 300 python3 "$repo/benchmarks/kernels.py" --model small-0.6b llama-1b llama-8b --batch 1 --fused \
        --bandwidth --bandwidth-out "$out/bandwidth.json"
      ;;
    bench)
      bench small model=small-0.6b "bench.batch_sizes=[1,32,128]" "bench.pdl=[${BENCH_PDL:-off,auto}]" "$graphs"
      bench llama-1b model=llama-1b "bench.batch_sizes=[1,32]" "bench.pdl=[${BENCH_PDL:-off,auto}]" "$graphs"
      bench llama-8b model=llama-8b "bench.batch_sizes=[1,32]" "engine.graph_batch_sizes=[1,32]"
      bench long model=small-0.6b bench.prompt_len=1900 "bench.batch_sizes=[1,32]" "$graphs"
      ;;
    before)
      if [ -z "${BEFORE_SITE:-}" ]; then note "== before: skipped (BEFORE_SITE is not set)"; continue; fi
      PYTHONPATH="$BEFORE_SITE" bench small-before model=small-0.6b "bench.batch_sizes=[1,32,128]" "$graphs"
      PYTHONPATH="$BEFORE_SITE" bench llama-1b-before "${llama1b_before[@]}" "bench.batch_sizes=[1,32]" "$graphs"
      ;;
    projections)
      part projections 600 python3 "$repo/benchmarks/projections.py" --sections chain tiles thresholds gemm \
        --out "$out/projections.json"
      grep -E "^chain" "$out/projections.log" | sed 's/^/   /' | tee -a "$summary"
      ;;
    *) note "unknown section $section"; status=2 ;;
  esac
done
python3 "$repo/benchmarks/floor_targets.py" "$out" | tee -a "$summary"
exit $status
