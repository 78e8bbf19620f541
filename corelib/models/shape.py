"""The shape of a Llama-family model: its sizes, its numbers and its variant's flags, fixed once.

A :class:`ModelShape` is made by the variant from a resolved config
(:meth:`corelib.models.registry.LlamaVariant.shape`); everything below that (the weight map,
the assembly, the shards, the forward) reads the shape and never the config or a variant's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corelib.errors import ConfigError
from corelib.models.rope import RopeScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the runner needs, derived once from the config, and the variant's flags."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    dtype: torch.dtype
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3)
    tie_word_embeddings: bool
    conv_kernel: int  # 0: no recurrent state
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    fused_qkv: bool = False  # the checkpoint holds q/k/v as one qkv_proj tensor (Phi-3)
    fused_gate_up: bool = False  # the checkpoint holds gate/up as one gate_up_proj tensor (Phi-3)

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim
