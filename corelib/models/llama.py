"""The Llama family: its weights as the forward reads them, and its forward through the ops.

The weights are assembled from checkpoint tensors through the weight map
(:mod:`corelib.models.weight_map`), which fuses q/k/v and gate/up into one matrix each (fewer
matmul launches per layer) whatever the checkpoint holds. Qwen2 (qkv bias), Qwen3 (per-head
q/k RMSNorm) and Phi-3 (fused checkpoint tensors) are flags of the same code
(``corelib.models.registry`` sets them per architecture).

Everything a backend may accelerate goes through ``corelib.ops``: the projections (``linear``),
RMSNorm with the residual add fused, RoPE with the KV-cache write, paged attention (one query
per row or many), SiLU-and-multiply. One forward serves every step, decode rows and prompt
chunks alike: a layer writes the step's keys and values into the paged cache, then each token
attends over its row's cached keys up to its own position. On one device a layer is four ops:
norm + qkv + RoPE + KV write + the attention (which a provider may run as two kernels, or as a
library GEMM and one attention kernel that rotates and writes the keys itself), o-projection +
residual, norm + gate/up + SiLU-and-multiply, down projection + residual, each of the last three
one kernel where a provider fuses it; the
final norm and the LM head (over each row's last token) are one more. Tensor parallelism (an
all-reduce sits between each projection and its residual add) and per-head q/k norms run the ops
one by one, the residual stream carried as (pending, h): each layer's output is added by the
next RMSNorm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from corelib.errors import ConfigError
from corelib.models.base import ModelFacts, ModelState, StepBatch
from corelib.models.rope import inv_freq
from corelib.models.shape import ModelShape
from corelib.models.sharding import VocabShard
from corelib.models.weight_map import weight_map
from corelib.ops import Ops, fold_norm_weight
from corelib.platform.device import Device
from corelib.support.progress import current as current_progress


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 nkv) hd, H]
    o: torch.Tensor  # [H, nh hd]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    qkv_bias: torch.Tensor | None = None  # [(nh + 2 nkv) hd]
    q_norm: torch.Tensor | None = None  # [hd]
    k_norm: torch.Tensor | None = None  # [hd]
    conv: torch.Tensor | None = None  # [K, H] hybrid only: depthwise causal convolution
    conv_norm: torch.Tensor | None = None  # [H]
    # input_norm and post_norm are folded into qkv's and gate_up's columns (LlamaModel.fold_norm_weights):
    # the norms before them take a unit weight
    norms_folded: bool = field(default=False, init=False)

    @property
    def norm_before_qkv(self) -> torch.Tensor | None:
        """The weight of the norm before the qkv projection; None where it is folded into qkv."""
        return None if self.norms_folded else self.input_norm

    @property
    def norm_before_gate_up(self) -> torch.Tensor | None:
        """The weight of the norm before the gate/up projection; None where it is folded into gate_up."""
        return None if self.norms_folded else self.post_norm


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
    # Tensor parallelism: the block of the vocabulary lm_head holds (None: all of it).
    vocab: VocabShard | None = None


def build_weights(
    shape: ModelShape, state: Mapping[str, torch.Tensor], device: torch.device, copy: bool = False
) -> ModelWeights:
    """Move a Hugging Face state dict to ``device`` in the model dtype, fusing qkv and gate/up.

    ``copy``: never share storage with ``state``, even where the device and dtype already
    match (a state that is kept and reused, like the cached random weights).
    """
    expected = weight_map(shape).shapes()
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

    Tensors are asked for one at a time and each once (a tied LM head is the embedding itself),
    so a loader can read each straight from its file.
    """
    fetched: dict[str, torch.Tensor] = {}

    def source(name: str) -> torch.Tensor:
        if name not in fetched:
            fetched[name] = get(name)
        return fetched[name]

    def stacked(names: tuple[str, ...]) -> torch.Tensor:
        if len(names) == 1:
            return source(names[0])
        return torch.cat([source(name) for name in names], dim=0).contiguous()

    wmap = weight_map(shape)
    layers = [LayerWeights(**{w.name: stacked(w.sources) for w in wmap.layer(i)}) for i in range(shape.num_layers)]
    top = {w.name: stacked(w.sources) for w in wmap.model_weights()}
    return ModelWeights(shape=shape, embed=top["embed"], layers=layers, norm=top["norm"], lm_head=top["lm_head"],
                        cos_sin=rope_table(shape, device))


def rope_table(shape: ModelShape, device: torch.device) -> torch.Tensor:
    """[max_len, 2, hd]: full-width cos and sin per position, in the model dtype as in Hugging Face."""
    frequencies, scale = inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    angles = torch.outer(torch.arange(shape.max_model_len, dtype=torch.float64), frequencies)
    angles = torch.cat([angles, angles], dim=-1).to(torch.float32)
    table = torch.stack([angles.cos() * scale, angles.sin() * scale], dim=1)
    return table.to(device=device, dtype=shape.dtype)


@dataclass
class KVCache(ModelState):
    """The Llama family's state: paged K/V for every layer, [L, 2, num_blocks, block_size, nkv, hd].

    Block 0 is the null block.
    """

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


def fused_layer(
    layer: LayerWeights, shape: ModelShape, h: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor,
    v_cache: torch.Tensor, cos_sin: torch.Tensor, ops: Ops,
) -> torch.Tensor:
    """One decoder layer on one device as four ops: the residual stream h [T, H] in, the next one out."""
    eps, tokens = shape.rms_norm_eps, h.shape[0]
    attn = ops.norm_qkv_attention(h, layer.norm_before_qkv, eps, layer.qkv, layer.qkv_bias, batch.positions, cos_sin,
                                  k_cache, v_cache, batch.slot_mapping, batch.attention,
                                  1.0 / math.sqrt(shape.head_dim))  # [T, nh, hd]
    h = ops.linear_residual(attn.reshape(tokens, shape.num_heads * shape.head_dim), layer.o, h)
    return ops.linear_residual(ops.norm_gate_up_silu_mul(h, layer.norm_before_gate_up, eps, layer.gate_up),
                               layer.down, h)


def decoder_layer(
    layer: LayerWeights, shape: ModelShape, pending: torch.Tensor, h: torch.Tensor | None, batch: StepBatch,
    k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor, ops: Ops, all_reduce: AllReduce | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer over the step's tokens: (pending, h) -> (pending, h), all [T, H].

    ``pending`` is added to the residual stream ``h`` by the input norm (None: ``pending`` is h).
    Without tensor parallelism or per-head q/k norms the layer runs fused and returns (h, None).
    Separate so that ``torch.compile`` can compile it once and reuse it for every layer.
    """
    if all_reduce is None and layer.q_norm is None:
        stream = pending if h is None else h + pending
        return fused_layer(layer, shape, stream, batch, k_cache, v_cache, cos_sin, ops), None
    tokens = pending.shape[0]
    x, h = ops.rms_norm(pending, layer.input_norm, shape.rms_norm_eps, h)
    qk, _ = attention_qkv(layer, shape, x, batch.positions, cos_sin, k_cache, v_cache, batch.slot_mapping, ops)
    attn = ops.paged_attention(qk[:, : shape.num_heads], k_cache, v_cache, batch.attention,
                               1.0 / math.sqrt(shape.head_dim))  # [T, nh, hd]
    out = _reduced(ops.linear(attn.reshape(tokens, shape.num_heads * shape.head_dim), layer.o), all_reduce)
    x, h = ops.rms_norm(out, layer.post_norm, shape.rms_norm_eps, h)
    return _reduced(mlp(layer, x, ops), all_reduce), h


DecoderLayer = Callable[
    [LayerWeights, ModelShape, torch.Tensor, torch.Tensor | None, StepBatch, torch.Tensor, torch.Tensor,
     torch.Tensor, Ops, AllReduce | None],
    tuple[torch.Tensor, torch.Tensor | None],
]


@functools.cache
def compiled_decode_layer() -> DecoderLayer:
    """``decoder_layer`` through ``torch.compile`` for decode steps, shared by every engine of the process.

    Dynamic shapes, so batch and KV-width buckets reuse one compilation (sizes 0 and 1 are
    specialised by torch, hence a few compilations at most); no CUDA graphs of its own
    (mode default): the engine captures the compiled kernels in its own graphs.
    """
    return torch.compile(decoder_layer, dynamic=True)


class LlamaModel:
    """Llama, Qwen2 and Qwen3 (flags of the shape) over the paged KV cache."""

    def __init__(self, weights: ModelWeights, facts: ModelFacts, compile_decode: bool = False) -> None:
        self.weights = weights
        self.shape = weights.shape
        self.vocab_shard = weights.vocab  # its logits are that block of the vocabulary (see corelib.models.base)
        self._facts = facts
        # Decode steps (one token per row, graph-captured) may run compiled; prompt chunks run eagerly.
        self._decode_layer: DecoderLayer = compiled_decode_layer() if compile_decode else decoder_layer

    def facts(self) -> ModelFacts:
        return self._facts

    def fold_norm_weights(self) -> bool:
        """Fold each layer's input and post-attention norm weights into its qkv and gate/up weights (once; the
        old weights are freed), where every layer runs fused (one device, no per-head q/k norms): the fused
        norm ops then take a unit weight. Returns whether the weights are folded."""
        layers = self.weights.layers
        if self.weights.all_reduce is not None or any(layer.q_norm is not None for layer in layers):
            return False
        for layer in layers:
            if not layer.norms_folded:
                layer.qkv = fold_norm_weight(layer.qkv, layer.input_norm)
                layer.gate_up = fold_norm_weight(layer.gate_up, layer.post_norm)
                layer.norms_folded = True
        return True

    def allocate_state(self, device: Device, num_blocks: int, block_size: int, num_states: int) -> KVCache:
        shape = self.shape
        return KVCache(
            device.zeros((shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                         shape.dtype),
            block_size,
        )

    @staticmethod
    def _cache(state: ModelState) -> KVCache:
        if not isinstance(state, KVCache):
            raise TypeError(f"the Llama family runs over a KVCache, got {type(state).__name__}")
        return state

    def _logits(self, pending: torch.Tensor, h: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        if h is None:  # the stream is whole: the final norm and the LM head as one op
            return ops.norm_logits(pending, self.weights.norm, self.shape.rms_norm_eps, self.weights.lm_head)
        x, _ = ops.rms_norm(pending, self.weights.norm, self.shape.rms_norm_eps, h)
        return ops.linear(x, self.weights.lm_head).float()

    def copy_blocks(self, state: ModelState, source: torch.Tensor, target: torch.Tensor) -> None:
        data = self._cache(state).data  # [L, 2, NB, bs, nkv, hd]
        data.index_copy_(2, target, data.index_select(2, source))

    def forward(self, batch: StepBatch, state: ModelState, ops: Ops) -> torch.Tensor:
        weights = self.weights
        pending, h = weights.embed[batch.input_ids], None  # [T, H]
        for i, layer in enumerate(weights.layers):
            pending, h = self._block(i, layer, pending, h, batch, state, ops)
        return self._logits(batch.logit_tokens(pending), None if h is None else batch.logit_tokens(h), ops)  # [B, V]

    def _block(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: StepBatch,
        state: ModelState, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        k_cache, v_cache = self._cache(state).layer(index)
        run = self._decode_layer if batch.is_decode else decoder_layer
        return run(layer, self.shape, pending, h, batch, k_cache, v_cache, self.weights.cos_sin, ops,
                   self.weights.all_reduce)
