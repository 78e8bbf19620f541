"""The Llama family: its shape, its weights in Hugging Face names, and its forward through the ops.

Weights are held in Hugging Face Llama names (``model.layers.0.self_attn.q_proj.weight``),
so real checkpoints load into the same structure; at build time q/k/v and gate/up are
fused into one matrix each, which halves the number of matmul launches per layer.
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm) are flags of the same code
(``corelib.models.registry`` sets them per architecture).

Everything a backend may accelerate goes through ``corelib.ops``: the projections (``linear``),
RMSNorm with the residual add fused, RoPE with the KV-cache write, paged decode and prefill
attention, SiLU-and-multiply. A decode step on one device runs each layer as five ops, each of
which a provider may run as one kernel: norm + qkv + RoPE + KV write, the attention,
o-projection + residual, norm + gate/up + SiLU-and-multiply, down projection + residual; the
final norm and the LM head are one more. Prefill, tensor parallelism (an all-reduce sits
between each projection and its residual add) and per-head q/k norms run the ops one by one,
the residual stream carried as (pending, h): each layer's output is added by the next RMSNorm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from corelib.config import ModelConfig
from corelib.device import Device
from corelib.errors import ConfigError
from corelib.models.base import DecodeBatch, ModelFacts, PrefillBatch
from corelib.models.rope import RopeScaling, inv_freq
from corelib.ops import Ops
from corelib.progress import current as current_progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the runner needs, derived once from the config."""

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
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    conv_kernel: int  # 0: no recurrent state
    rope_scaling: RopeScaling | None = None  # None: plain RoPE

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        from corelib.models.registry import llama_variant

        variant = llama_variant(cfg.architecture)
        if cfg.num_heads < 1 or cfg.num_kv_heads < 1:
            raise ConfigError(f"model.num_heads={cfg.num_heads} and model.num_kv_heads={cfg.num_kv_heads} "
                              "must be at least 1")
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={cfg.num_heads} is not a multiple of model.num_kv_heads={cfg.num_kv_heads}"
            )
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            max_model_len=cfg.max_model_len,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            # "auto" (the checkpoint's dtype) is resolved at startup; random weights have none
            dtype=torch_dtype("float32" if cfg.dtype == "auto" else cfg.dtype),
            attention_bias=cfg.attention_bias or variant.attention_bias,
            qk_norm=cfg.qk_norm or variant.qk_norm,
            tie_word_embeddings=cfg.tie_word_embeddings,
            conv_kernel=cfg.conv_kernel if variant.conv_state else 0,
            rope_scaling=RopeScaling.parse(cfg.rope_scaling, cfg.max_model_len),
        )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 nkv) hd, H]
    qkv_bias: torch.Tensor | None  # [(nh + 2 nkv) hd]
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None  # [hd]
    o: torch.Tensor  # [H, nh hd]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    conv: torch.Tensor | None  # [K, H] hybrid only: depthwise causal convolution
    conv_norm: torch.Tensor | None  # [H]


@dataclass
class ModelWeights:
    shape: ModelShape
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    cos_sin: torch.Tensor  # [max_len, 2, hd] full-width cos and sin, model dtype
    # Tensor parallelism: sums the partial outputs of the row-parallel layers across ranks.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


def hf_parameter_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every parameter in Hugging Face names, with its shape."""
    h, hd, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    nq, nkv = shape.num_heads * hd, shape.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nq, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv, h)
        if shape.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nq,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv,)
        if shape.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if shape.conv_kernel:
            shapes[p + "conv.weight"] = (shape.conv_kernel, h)
            shapes[p + "conv_norm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return shapes


def random_state_dict(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face names, generated on the CPU in float32.

    Generating on the CPU makes the weights identical on every device and machine.
    """
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    shapes = hf_parameter_shapes(shape)
    with current_progress().task("generating random weights", total=len(shapes), unit="tensors") as task:
        for name, dims in shapes.items():
            if name.endswith("norm.weight"):
                state[name] = 1.0 + 0.1 * torch.randn(dims, generator=generator)
            elif name.endswith("conv.weight"):
                state[name] = torch.randn(dims, generator=generator) / dims[0]
            else:
                scale = 0.5 if name.endswith(".bias") else 1.0 / dims[-1] ** 0.5
                state[name] = scale * torch.randn(dims, generator=generator)
            task.advance()
    return state


def build_weights(
    shape: ModelShape, state: Mapping[str, torch.Tensor], device: torch.device, copy: bool = False
) -> ModelWeights:
    """Move a Hugging Face state dict to ``device`` in the model dtype, fusing qkv and gate/up.

    ``copy``: never share storage with ``state``, even where the device and dtype already
    match (a state that is kept and reused, like the cached random weights).
    """
    expected = hf_parameter_shapes(shape)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
    for name, dims in expected.items():
        if tuple(state[name].shape) != dims:
            raise ConfigError(f"tensor {name!r} has shape {tuple(state[name].shape)}; expected {dims}")
    with current_progress().task("placing weights on the device", total=len(expected), unit="tensors") as task:
        return assemble_weights(
            shape, lambda name: task.advanced(state[name].to(device=device, dtype=shape.dtype, copy=copy)), device
        )


def assemble_weights(shape: ModelShape, get: Callable[[str], torch.Tensor], device: torch.device) -> ModelWeights:
    """Build the model from ``get(hf_name)``, which returns each checked tensor on ``device`` in the model dtype.

    Tensors are asked for one at a time, so a loader can read each straight from its file.
    """

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([get(n) for n in names], dim=0).contiguous()

    layers = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=cat(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                qkv_bias=cat(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
                if shape.attention_bias
                else None,
                q_norm=get(attn + "q_norm.weight") if shape.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if shape.qk_norm else None,
                o=get(attn + "o_proj.weight"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=get(p + "mlp.down_proj.weight"),
                conv=get(p + "conv.weight") if shape.conv_kernel else None,
                conv_norm=get(p + "conv_norm.weight") if shape.conv_kernel else None,
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if shape.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(
        shape=shape,
        embed=embed,
        layers=layers,
        norm=get("model.norm.weight"),
        lm_head=lm_head,
        cos_sin=rope_table(shape, device),
    )


def rope_table(shape: ModelShape, device: torch.device) -> torch.Tensor:
    """[max_len, 2, hd]: full-width cos and sin per position, in the model dtype as in Hugging Face."""
    frequencies, scale = inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    angles = torch.outer(torch.arange(shape.max_model_len, dtype=torch.float64), frequencies)
    angles = torch.cat([angles, angles], dim=-1).to(torch.float32)
    table = torch.stack([angles.cos() * scale, angles.sin() * scale], dim=1)
    return table.to(device=device, dtype=shape.dtype)



@dataclass
class KVCache:
    """Paged K/V for every layer: [L, 2, num_blocks, block_size, nkv, hd]; block 0 is the null block."""

    data: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _reduced(x: torch.Tensor, all_reduce: AllReduce | None) -> torch.Tensor:
    return x if all_reduce is None else all_reduce(x)


def attention_qkv(
    layer: LayerWeights, shape: ModelShape, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (rotated q and k [T, nh+nkv, hd], v [T, nkv, hd]); new keys and values go to the cache."""
    qkv = ops.linear(x, layer.qkv, layer.qkv_bias)  # [T, (nh + 2 nkv) hd]
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    if layer.q_norm is not None and layer.k_norm is not None:
        q, _ = ops.rms_norm(qkv[:, : nh * hd].view(-1, nh, hd), layer.q_norm, shape.rms_norm_eps)
        k, _ = ops.rms_norm(qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd), layer.k_norm, shape.rms_norm_eps)
        qk = torch.cat([q, k], dim=1)
    else:
        qk = qkv[:, : (nh + nkv) * hd].view(-1, nh + nkv, hd)  # q and k rotated together
    return ops.rope_kv_write(qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping), v


def mlp(layer: LayerWeights, x: torch.Tensor, ops: Ops) -> torch.Tensor:
    return ops.linear(ops.silu_mul(ops.linear(x, layer.gate_up)), layer.down)


def fused_decode_layer(
    layer: LayerWeights, shape: ModelShape, h: torch.Tensor, batch: DecodeBatch, k_cache: torch.Tensor,
    v_cache: torch.Tensor, cos_sin: torch.Tensor, ops: Ops,
) -> torch.Tensor:
    """One decoder layer on one device as five ops: the residual stream h [B, H] in, the next one out."""
    eps, batch_size = shape.rms_norm_eps, h.shape[0]
    q = ops.norm_qkv_rope_kv_write(h, layer.input_norm, eps, layer.qkv, layer.qkv_bias, batch.positions, cos_sin,
                                   k_cache, v_cache, batch.slot_mapping)  # [B, nh, hd]
    attn = ops.paged_decode_attention(q, k_cache, v_cache, batch.attention, 1.0 / math.sqrt(shape.head_dim))
    h = ops.linear_residual(attn.reshape(batch_size, shape.num_heads * shape.head_dim), layer.o, h)
    return ops.linear_residual(ops.norm_gate_up_silu_mul(h, layer.post_norm, eps, layer.gate_up), layer.down, h)


def decode_layer(
    layer: LayerWeights, shape: ModelShape, pending: torch.Tensor, h: torch.Tensor | None, batch: DecodeBatch,
    k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor, ops: Ops, all_reduce: AllReduce | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer for one new token per sequence: (pending, h) -> (pending, h), all [B, H].

    ``pending`` is added to the residual stream ``h`` by the input norm (None: ``pending`` is h).
    Without tensor parallelism or per-head q/k norms the layer runs fused and returns (h, None).
    Separate so that ``torch.compile`` can compile it once and reuse it for every layer.
    """
    if all_reduce is None and layer.q_norm is None:
        stream = pending if h is None else h + pending
        return fused_decode_layer(layer, shape, stream, batch, k_cache, v_cache, cos_sin, ops), None
    batch_size = pending.shape[0]
    x, h = ops.rms_norm(pending, layer.input_norm, shape.rms_norm_eps, h)
    qk, _ = attention_qkv(layer, shape, x, batch.positions, cos_sin, k_cache, v_cache, batch.slot_mapping, ops)
    attn = ops.paged_decode_attention(qk[:, : shape.num_heads], k_cache, v_cache, batch.attention,
                                      1.0 / math.sqrt(shape.head_dim))  # [B, nh, hd]
    out = _reduced(ops.linear(attn.reshape(batch_size, shape.num_heads * shape.head_dim), layer.o), all_reduce)
    x, h = ops.rms_norm(out, layer.post_norm, shape.rms_norm_eps, h)
    return _reduced(mlp(layer, x, ops), all_reduce), h


DecodeLayer = Callable[
    [LayerWeights, ModelShape, torch.Tensor, torch.Tensor | None, DecodeBatch, torch.Tensor, torch.Tensor,
     torch.Tensor, Ops, AllReduce | None],
    tuple[torch.Tensor, torch.Tensor | None],
]


@functools.cache
def compiled_decode_layer() -> DecodeLayer:
    """``decode_layer`` through ``torch.compile``, shared by every engine of the process.

    Dynamic shapes, so batch and KV-width buckets reuse one compilation (sizes 0 and 1 are
    specialised by torch, hence a few compilations at most); no CUDA graphs of its own
    (mode default): the engine captures the compiled kernels in its own graphs.
    """
    return torch.compile(decode_layer, dynamic=True)


class LlamaModel:
    """Llama, Qwen2 and Qwen3 (flags of the shape) over the paged KV cache."""

    def __init__(self, weights: ModelWeights, facts: ModelFacts, compile_decode: bool = False) -> None:
        self.weights = weights
        self.shape = weights.shape
        self._facts = facts
        self._decode_layer: DecodeLayer = compiled_decode_layer() if compile_decode else decode_layer

    def facts(self) -> ModelFacts:
        return self._facts

    def allocate_state(self, device: Device, num_blocks: int, block_size: int, num_slots: int) -> object:
        shape = self.shape
        return KVCache(
            device.zeros((shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                         shape.dtype),
            block_size,
        )

    @staticmethod
    def _cache(state: object) -> KVCache:
        cache = getattr(state, "cache", state)
        if not isinstance(cache, KVCache):
            raise TypeError(f"the Llama family runs over a KVCache, got {type(state).__name__}")
        return cache

    def _logits(self, pending: torch.Tensor, h: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        if h is None:  # the stream is whole: the final norm and the LM head as one op
            return ops.norm_logits(pending, self.weights.norm, self.shape.rms_norm_eps, self.weights.lm_head)
        x, _ = ops.rms_norm(pending, self.weights.norm, self.shape.rms_norm_eps, h)
        return ops.linear(x, self.weights.lm_head).float()

    def decode(self, batch: DecodeBatch, state: object, ops: Ops) -> torch.Tensor:
        weights = self.weights
        pending, h = weights.embed[batch.input_ids], None  # [B, H]
        for i, layer in enumerate(weights.layers):
            pending, h = self._decode_block(i, layer, pending, h, batch, state, ops)
        return self._logits(pending, h, ops)

    def _decode_block(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: DecodeBatch,
        state: object, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        k_cache, v_cache = self._cache(state).layer(index)
        return self._decode_layer(layer, self.shape, pending, h, batch, k_cache, v_cache, self.weights.cos_sin, ops,
                                  self.weights.all_reduce)

    def prefill(self, batch: PrefillBatch, state: object, ops: Ops) -> torch.Tensor:
        weights, shape = self.weights, self.shape
        pending, h = weights.embed[batch.token_ids], None  # [T, H]
        scale = 1.0 / math.sqrt(shape.head_dim)
        for i, layer in enumerate(weights.layers):
            pending, h = self._before_layer(i, layer, pending, h, batch, state, ops)
            k_cache, v_cache = self._cache(state).layer(i)
            x, h = ops.rms_norm(pending, layer.input_norm, shape.rms_norm_eps, h)
            qk, v = attention_qkv(layer, shape, x, batch.positions, weights.cos_sin, k_cache, v_cache,
                                  batch.slot_mapping, ops)
            attn = ops.prefill_attention(qk[:, : shape.num_heads], qk[:, shape.num_heads :], v, batch.attention,
                                         scale)
            out = _reduced(ops.linear(attn.reshape(-1, shape.num_heads * shape.head_dim), layer.o),
                           weights.all_reduce)
            x, h = ops.rms_norm(out, layer.post_norm, shape.rms_norm_eps, h)
            pending = _reduced(mlp(layer, x, ops), weights.all_reduce)
        last = batch.last_index
        return self._logits(pending[last], None if h is None else h[last], ops)  # [n, V]

    def _before_layer(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: PrefillBatch,
        state: object, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A hook for variants that add a branch before the attention (the hybrid's convolution)."""
        return pending, h
