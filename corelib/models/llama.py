"""A Llama-family decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights are held in Hugging Face Llama names (``model.layers.0.self_attn.q_proj.weight``),
so real checkpoints load into the same structure; at build time q/k/v and gate/up are
fused into one matrix each, which halves the number of matmul launches per layer.
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm) are flags of the same code.
The hybrid variant adds a per-sequence causal-convolution state to every layer.

Attention reads the paged KV cache: prefill writes K/V through the slot mapping and
attends within each sequence; decode gathers only the first ``kv_blocks`` blocks of each
block table (the live ones, rounded up to a bucket), never the whole cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corelib import progress
from corelib.config import ModelConfig
from corelib.errors import ConfigError
from corelib.models.rope import RopeScaling, inv_freq

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
            attention_bias=cfg.attention_bias or cfg.architecture == "qwen2",
            qk_norm=cfg.qk_norm or cfg.architecture == "qwen3",
            tie_word_embeddings=cfg.tie_word_embeddings,
            conv_kernel=cfg.conv_kernel if cfg.architecture == "hybrid" else 0,
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
    with progress.current().task("generating random weights", total=len(shapes), unit="tensors") as task:
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
    shape: ModelShape, state: Mapping[str, torch.Tensor], device: torch.device
) -> ModelWeights:
    """Move a Hugging Face state dict to ``device`` in the model dtype, fusing qkv and gate/up."""
    expected = hf_parameter_shapes(shape)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
    for name, dims in expected.items():
        if tuple(state[name].shape) != dims:
            raise ConfigError(f"tensor {name!r} has shape {tuple(state[name].shape)}; expected {dims}")
    with progress.current().task("placing weights on the device", total=len(expected), unit="tensors") as task:
        return assemble_weights(shape, lambda name: task.advanced(state[name].to(device=device, dtype=shape.dtype)),
                                device)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # [..., H]; statistics in float32, then the weight in the model dtype, as in Hugging Face
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: [T, n, hd]; rope: [T, 2, hd] (cos, sin) -> rotate-half RoPE as in Hugging Face Llama
    x1, x2 = x.chunk(2, dim=-1)
    return x * rope[:, 0:1] + torch.cat((-x2, x1), dim=-1) * rope[:, 1:2]


def _qkv(
    layer: LayerWeights, shape: ModelShape, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [T, H] -> q [T, nh, hd], k/v [T, nkv, hd], RoPE applied
    qkv = F.linear(x, layer.qkv, layer.qkv_bias)
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    rope = cos_sin[positions]
    if layer.q_norm is not None and layer.k_norm is not None:
        q = rms_norm(qkv[:, : nh * hd].view(-1, nh, hd), layer.q_norm, shape.rms_norm_eps)
        k = rms_norm(qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd), layer.k_norm, shape.rms_norm_eps)
        return apply_rope(q, rope), apply_rope(k, rope), v
    qk = apply_rope(qkv[:, : (nh + nkv) * hd].view(-1, nh + nkv, hd), rope)  # q and k rotated together
    return qk[:, :nh], qk[:, nh:], v


def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    gate_up = F.linear(x, layer.gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer.down)


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


@dataclass
class ConvState:
    """Hybrid models: the last K-1 normalised inputs of every layer, per sequence slot."""

    data: torch.Tensor  # [L, num_slots, K-1, H]


def _conv_decode(
    layer: LayerWeights, state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, eps: float
) -> torch.Tensor:
    # x: [B, H]; state: [S, K-1, H]; returns the conv branch output and advances the state
    assert layer.conv is not None and layer.conv_norm is not None, "hybrid layer without conv weights"
    xn = rms_norm(x, layer.conv_norm, eps)
    window = torch.cat([state[slots], xn[:, None, :]], dim=1)  # [B, K, H]
    out = (window * layer.conv[None]).sum(dim=1)
    state.index_copy_(0, slots, window[:, 1:])
    return F.silu(out)


def _conv_prefill(
    layer: LayerWeights,
    state: torch.Tensor,
    x: torch.Tensor,
    pad_index: torch.Tensor,
    valid: torch.Tensor,
    last_index: torch.Tensor,
    slots: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    # x: [T, H] flat tokens; pad_index: [n, L] into x; a sequence starts from a zero state
    assert layer.conv is not None and layer.conv_norm is not None, "hybrid layer without conv weights"
    kernel = layer.conv.shape[0]
    xn = rms_norm(x, layer.conv_norm, eps)
    padded = xn[pad_index] * valid[..., None]  # [n, L, H]
    padded = F.pad(padded, (0, 0, kernel - 1, 0))  # [n, K-1+L, H]
    windows = padded.unfold(1, kernel, 1)  # [n, L, H, K]
    out = torch.einsum("nlhk,kh->nlh", windows, layer.conv)
    lengths = last_index + 1  # [n]
    tail_pos = lengths[:, None] + torch.arange(kernel - 1, device=x.device)[None, :]  # in padded coords
    tail = padded.gather(1, tail_pos[..., None].expand(-1, -1, padded.shape[-1]))
    state.index_copy_(0, slots, tail)
    return F.silu(out[valid])


def prefill_forward(
    weights: ModelWeights,
    cache: KVCache,
    conv_state: ConvState | None,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    pad_index: torch.Tensor,
    valid: torch.Tensor,
    last_index: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Full causal attention within each sequence of a prefill batch; returns last-token logits.

    token_ids/positions/slot_mapping: [T] flat; pad_index: [n, L] flat index of each
    sequence's i-th token (0 where padded); valid: [n, L]; last_index: [n].
    """
    shape = weights.shape
    n, length = pad_index.shape
    h = weights.embed[token_ids]  # [T, H]
    causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]  # [n, 1, L, L]
    for i, layer in enumerate(weights.layers):
        if conv_state is not None:
            h = h + _conv_prefill(
                layer, conv_state.data[i], h, pad_index, valid, last_index, state_indices, shape.rms_norm_eps
            )
        x = rms_norm(h, layer.input_norm, shape.rms_norm_eps)
        q, k, v = _qkv(layer, shape, x, positions, weights.cos_sin)
        k_cache, v_cache = cache.layer(i)
        k_cache.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slot_mapping, v)
        qp, kp, vp = (t[pad_index].transpose(1, 2) for t in (q, k, v))  # [n, heads, L, hd]
        attn = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
        attn_flat = attn.transpose(1, 2)[valid].reshape(-1, shape.num_heads * shape.head_dim)  # [T, nh hd]
        out = F.linear(attn_flat, layer.o)
        h = h + (out if weights.all_reduce is None else weights.all_reduce(out))
        mlp = _mlp(layer, rms_norm(h, layer.post_norm, shape.rms_norm_eps))
        h = h + (mlp if weights.all_reduce is None else weights.all_reduce(mlp))
    last = h[pad_index[torch.arange(n, device=h.device), last_index]]  # [n, H]
    return F.linear(rms_norm(last, weights.norm, shape.rms_norm_eps), weights.lm_head).float()


def decode_layer(
    layer: LayerWeights,
    shape: ModelShape,
    h: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos_sin: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decoder layer for one new token per sequence: h [B, H] -> [B, H].

    Separate so that ``torch.compile`` can compile it once and reuse it for every layer.
    """
    batch, kv_blocks = block_tables.shape
    span = kv_blocks * k_cache.shape[1]
    x = rms_norm(h, layer.input_norm, shape.rms_norm_eps)
    q, k, v = _qkv(layer, shape, x, positions, cos_sin)
    k_cache.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, shape.num_kv_heads, shape.head_dim).index_copy_(0, slot_mapping, v)
    # [B, kv_blocks, bs, nkv, hd] -> [B, nkv, S, hd]: only the live blocks of each table
    keys = k_cache[block_tables].view(batch, span, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
    values = v_cache[block_tables].view(batch, span, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=True)
    out = F.linear(attn.reshape(batch, shape.num_heads * shape.head_dim), layer.o)
    h = h + (out if all_reduce is None else all_reduce(out))
    mlp = _mlp(layer, rms_norm(h, layer.post_norm, shape.rms_norm_eps))
    return h + (mlp if all_reduce is None else all_reduce(mlp))


DecodeLayer = Callable[
    [LayerWeights, ModelShape, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
     torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None],
    torch.Tensor,
]


def decode_forward(
    weights: ModelWeights,
    cache: KVCache,
    conv_state: ConvState | None,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    state_indices: torch.Tensor,
    layer_fn: DecodeLayer = decode_layer,
) -> torch.Tensor:
    """One new token per sequence. block_tables: [B, kv_blocks] live blocks only; returns [B, V] logits."""
    shape = weights.shape
    span = block_tables.shape[1] * cache.block_size
    h = weights.embed[token_ids]  # [B, H]
    key_pos = torch.arange(span, device=h.device)
    mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    for i, layer in enumerate(weights.layers):
        if conv_state is not None:
            h = h + _conv_decode(layer, conv_state.data[i], state_indices, h, shape.rms_norm_eps)
        k_cache, v_cache = cache.layer(i)
        h = layer_fn(layer, shape, h, positions, slot_mapping, block_tables, mask, k_cache, v_cache, weights.cos_sin,
                     weights.all_reduce)
    return F.linear(rms_norm(h, weights.norm, shape.rms_norm_eps), weights.lm_head).float()


@functools.cache
def compiled_decode_layer() -> DecodeLayer:
    """``decode_layer`` through ``torch.compile``, shared by every engine of the process.

    Dynamic shapes, so batch and KV-width buckets reuse one compilation (sizes 0 and 1 are
    specialised by torch, hence a few compilations at most); no CUDA graphs of its own
    (mode default): the engine captures the compiled kernels in its own graphs.
    """
    return torch.compile(decode_layer, dynamic=True)
