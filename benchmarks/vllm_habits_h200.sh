#!/usr/bin/env bash
# A real-shaped checkpoint served the way vLLM users start it, and JSON mode's cost, on one GPU:
#   benchmarks/vllm_habits_h200.sh OUT
# 1. a Qwen3-0.6B-shaped checkpoint (random bf16 weights, max_position_embeddings 40,960) run with no
#    dtype and no context given: the startup lines say the dtype, the context and the KV pool's blocks;
# 2. benchmarks/json_mode.py: 100 requests with a JSON schema against plain decoding, in one process.
set -euo pipefail
out="${1:?usage: benchmarks/vllm_habits_h200.sh OUT}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ckpt="$out/qwen3-shape"
python3 - "$ckpt" <<'PY'
import pathlib, sys, torch
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint
config = tiny_hf_config("Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
                        torch_dtype="bfloat16")
write_random_checkpoint(pathlib.Path(sys.argv[1]), config, dtype=torch.bfloat16)
PY
python3 -m corelib run "model.path=$ckpt" backend=cuda workload.num_requests=8 "hydra.run.dir=$out/run" \
    > "$out/real-shaped-checkpoint.log" 2>&1
grep -E "model.dtype=auto|model.max_model_len=|KV pool:|engine ready" "$out/real-shaped-checkpoint.log"
python3 benchmarks/json_mode.py --backend cuda --requests 100 --concurrency 32 --workdir "$out/json-model" \
    | tee "$out/json-mode.log"
