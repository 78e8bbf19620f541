"""One weight map per architecture: the checkpoint tensors a Llama-family variant has, and what becomes of them.

Llama-family checkpoints name their tensors alike (``model.layers.0.self_attn.q_proj.weight``),
except where a variant stores several projections as one tensor (Phi-3's ``qkv_proj`` and
``gate_up_proj``) or adds some (Qwen2's q/k/v biases, Qwen3's q/k norms, the hybrid's
convolution). :func:`weight_map` says, for one :class:`~corelib.models.shape.ModelShape`, every
tensor the checkpoint holds (its name, its shape, how tensor parallelism splits it, how random
weights draw it) and which of them are stacked into each weight the forward reads (q/k/v rows
into ``qkv``, gate/up rows into ``gate_up``). The loader's checks, the assembly, the shards, the
random weights and the synthetic checkpoints all read it; no other module spells a tensor name.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from corelib.models.shape import ModelShape


class Split(enum.Enum):
    """How tensor parallelism divides a tensor among ranks (Megatron-style)."""

    replicated = "replicated"  # every rank holds all of it: norms, the embedding, the LM head
    column = "column"  # the output rows are divided: q/k/v and gate/up (biases alike)
    row = "row"  # the input columns are divided; the partial outputs are all-reduced: o and down


class Init(enum.Enum):
    """How a random weight is drawn (``corelib.models.random_init``)."""

    matrix = "matrix"  # normal / sqrt(fan-in)
    norm = "norm"  # 1 + 0.1 normal
    bias = "bias"  # 0.5 normal
    conv = "conv"  # normal / kernel width


@dataclass(frozen=True)
class Source:
    """One tensor of the checkpoint."""

    name: str  # its Hugging Face name
    shape: tuple[int, ...]
    split: Split = Split.replicated
    init: Init = Init.matrix
    # A fused column-parallel tensor: the rows of each stacked part (q, k, v). Each part is
    # divided among the ranks on its own, so that a rank holds its heads of each.
    parts: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Weight:
    """A weight the forward reads: its sources stacked along the rows, in order."""

    name: str  # a ModelWeights field, or a LayerWeights field when ``layer`` is set
    sources: tuple[str, ...]
    layer: int | None = None


EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"  # absent where the head is the embedding table (tied)


@dataclass(frozen=True)
class WeightMap:
    """Every checkpoint tensor of one model, and the weights made of them."""

    sources: dict[str, Source] = field(default_factory=dict)
    weights: list[Weight] = field(default_factory=list)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's name and shape, in the order of the weights."""
        return {name: source.shape for name, source in self.sources.items()}

    def parameter_count(self) -> int:
        return sum(source.numel for source in self.sources.values())

    def step_parameter_count(self) -> int:
        """The parameters a decode step reads: all but the embedding table, whose rows it gathers (tied to the LM
        head, the table is read whole as the head)."""
        embed = self.sources.get(EMBEDDING)
        gathered = 0 if embed is None or LM_HEAD not in self.sources else embed.numel
        return self.parameter_count() - gathered

    def layer(self, index: int) -> Iterator[Weight]:
        return (weight for weight in self.weights if weight.layer == index)

    def model_weights(self) -> Iterator[Weight]:
        return (weight for weight in self.weights if weight.layer is None)

    def _add(self, name: str, sources: list[Source], layer: int | None = None) -> None:
        for source in sources:
            self.sources.setdefault(source.name, source)
        self.weights.append(Weight(name, tuple(source.name for source in sources), layer))


def weight_map(shape: ModelShape) -> WeightMap:
    """The weight map of the Llama-family model of ``shape`` (its variant's flags included)."""
    h, hd, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    nq, nkv = shape.q_rows, shape.kv_rows
    row, norm = Split.row, Init.norm
    found = WeightMap()
    embed = Source(EMBEDDING, (shape.vocab_size, h))
    found._add("embed", [embed])
    for i in range(shape.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        found._add("input_norm", [Source(f"model.layers.{i}.input_layernorm.weight", (h,), init=norm)], i)
        found._add("qkv", _stacked(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (nq, nkv, nkv), shape.fused_qkv,
                                   ".weight", (h,)), i)
        if shape.attention_bias:
            found._add("qkv_bias", _stacked(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (nq, nkv, nkv),
                                            shape.fused_qkv, ".bias", ()), i)
        if shape.qk_norm:
            found._add("q_norm", [Source(attn + "q_norm.weight", (hd,), init=norm)], i)
            found._add("k_norm", [Source(attn + "k_norm.weight", (hd,), init=norm)], i)
        found._add("o", [Source(attn + "o_proj.weight", (h, nq), row)], i)
        found._add("post_norm", [Source(f"model.layers.{i}.post_attention_layernorm.weight", (h,), init=norm)], i)
        found._add("gate_up", _stacked(mlp, "gate_up_proj", ("gate_proj", "up_proj"), (inter, inter),
                                       shape.fused_gate_up, ".weight", (h,)), i)
        found._add("down", [Source(mlp + "down_proj.weight", (h, inter), row)], i)
        if shape.conv_kernel:
            found._add("conv", [Source(f"model.layers.{i}.conv.weight", (shape.conv_kernel, h), init=Init.conv)], i)
            found._add("conv_norm", [Source(f"model.layers.{i}.conv_norm.weight", (h,), init=norm)], i)
    found._add("norm", [Source("model.norm.weight", (h,), init=norm)])
    found._add("lm_head", [embed if shape.tie_word_embeddings else Source(LM_HEAD, (shape.vocab_size, h))])
    return found


def _stacked(prefix: str, fused: str, separate: tuple[str, ...], rows: tuple[int, ...], is_fused: bool,
             suffix: str, trailing: tuple[int, ...]) -> list[Source]:
    """Column-parallel parts stacked along the rows: one fused tensor, or one tensor per part."""
    init = Init.bias if suffix == ".bias" else Init.matrix
    if is_fused:
        return [Source(prefix + fused + suffix, (sum(rows), *trailing), Split.column, init, parts=rows)]
    return [Source(prefix + name + suffix, (part, *trailing), Split.column, init)
            for name, part in zip(separate, rows, strict=True)]
