"""What every op takes and returns, the container the model calls, and what a provider supplies.

Shapes use: T tokens (flat: a step's queries), B sequences (rows), H hidden, nh query heads,
nkv KV heads, hd head dim, NB KV blocks, bs block size, W block-table width, V vocabulary.
Every op is graph-safe in the reference: no host sync, no data-dependent shapes.

Long: every op's contract in one module, the one a provider's author reads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from corelib.ops.composed import (
    linear_residual,
    norm_gate_up_silu_mul,
    norm_logits,
    norm_qkv_attention,
    norm_qkv_rope_kv_write,
    relay_inputs,
    sample_publish,
)
from corelib.platform.device import Device
from corelib.sampling_params import LOGIT_BIAS_WIDTH, MIN_TOKENS_STOP_WIDTH
from corelib.sampling_params import columns as sampler_columns

OP_NAMES = (
    "rms_norm",
    "rope_kv_write",
    "paged_attention",
    "silu_mul",
    "sample",
    "linear",
    "linear_residual",
    "norm_qkv_rope_kv_write",
    "norm_gate_up_silu_mul",
    "norm_logits",
    "norm_qkv_attention",
    "sample_publish",
    "relay_inputs",
)
#: the ops that are a composition of others, with their parts: where no provider runs one, the
#: container composes it from its own ops (corelib.ops.composed), so a provider's rms_norm or
#: linear still runs in it; its provider then reads "composed" (all parts reference: "reference")
COMPOSED_PARTS: dict[str, tuple[str, ...]] = {
    "linear_residual": ("linear",),
    "norm_qkv_rope_kv_write": ("rms_norm", "linear", "rope_kv_write"),
    "norm_gate_up_silu_mul": ("rms_norm", "linear", "silu_mul"),
    "norm_logits": ("rms_norm", "linear"),
    # after norm_qkv_rope_kv_write, whose provider it reads
    "norm_qkv_attention": ("norm_qkv_rope_kv_write", "paged_attention"),
    "sample_publish": ("sample",),
    "relay_inputs": (),  # plain torch, no op of its own inside
}
COMPOSED_OPS = tuple(COMPOSED_PARTS)
COMPOSED = "composed"
_COMPOSERS = {f.__name__: f for f in (linear_residual, norm_qkv_rope_kv_write, norm_gate_up_silu_mul, norm_logits,
                                      norm_qkv_attention, sample_publish, relay_inputs)}


@dataclass(frozen=True)
class PagedAttention:
    """Where one step's keys and values live: built once per step, shared by every layer.

    block_tables [B, W] int32: the first W blocks of each sequence (padded with block 0);
    seq_lens [B] int64: keys each row attends to once this step's keys are written (>= 1);
    query_start [B+1] int64, or None for one query per row (row i's query is token i): row i's
    queries are the step's tokens query_start[i]:query_start[i+1], the last ones of its context,
    so its query j sits at position seq_lens[i] - q_len_i + j and attends to the keys up to it;
    max_query_len: a host int, the most queries of one row (1: a decode step, graph-safe);
    decode_rows: a host int, rows [0, decode_rows) have one query each (a step lists its decode
    rows first), so a provider may run them as a decode step and only the rest as chunks;
    captured: one graph serves every step of a token bucket, so only T (the bucket) and B are known
    (max_query_len T, decode_rows 0); rows past the step's are empty, tokens past query_start[B] are
    no row's (their output: 0). The launch may depend on T and B alone.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    query_start: torch.Tensor | None = None
    max_query_len: int = 1
    decode_rows: int = 0
    captured: bool = False

    @property
    def is_decode(self) -> bool:
        """One query per row: the decode step (a captured graph's shape)."""
        return self.max_query_len == 1

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:
        """[B, 1, 1, W*bs] True where a key position is live; the reference computes it once per step."""
        span = self.block_tables.shape[1] * self.block_size
        positions = torch.arange(span, device=self.seq_lens.device)
        return (positions[None, :] < self.seq_lens[:, None])[:, None, None, :]

    def query_lens(self) -> torch.Tensor:
        """[B] int64: each row's query count."""
        if self.query_start is None:
            return torch.ones_like(self.seq_lens)
        return self.query_start[1:] - self.query_start[:-1]

    def split(self) -> tuple[PagedAttention, PagedAttention]:
        """(the first ``decode_rows`` rows as a decode step, the other rows with their queries): the
        decode rows' queries are the step's first ``decode_rows`` tokens; the others keep their offsets."""
        d, starts = self.decode_rows, self.query_start
        if starts is None or not 0 < d < self.block_tables.shape[0]:
            raise ValueError(f"a step of {self.block_tables.shape[0]} rows cannot split off {d} decode rows")
        decode = PagedAttention(self.block_tables[:d], self.seq_lens[:d], self.block_size)
        chunks = PagedAttention(self.block_tables[d:], self.seq_lens[d:], self.block_size, starts[d:] - d,
                                self.max_query_len)
        return decode, chunks

    def token_rows(self, num_tokens: int) -> torch.Tensor:
        """[T] int64: the row each of the step's tokens belongs to, found on the device (no host sync)."""
        tokens = torch.arange(num_tokens, device=self.seq_lens.device)
        if self.query_start is None:
            return tokens
        rows = torch.searchsorted(self.query_start[1:].contiguous(), tokens, right=True)
        return rows.clamp_(max=self.seq_lens.shape[0] - 1)


@dataclass(frozen=True)
class SamplingColumn:
    """A per-request sampling value, as it travels from ``SamplingParams`` to the device."""

    name: str  # the field of SamplingInputs and of the step's input arena
    dtype: torch.dtype
    param: str  # the attribute of corelib.SamplingParams it comes from
    neutral: float  # its value on padded rows (and on greedy ones): changes nothing
    examples: tuple[float, ...] = ()  # what the op conformance case cycles through; empty: random ints


_COLUMN_DTYPES = {"float32": torch.float32, "int64": torch.int64}

# Every per-request sampling value, one per sampler column of corelib.SamplingParams (its field
# metadata). The input arenas, the packer, the runner and the conformance case iterate over this
# list: a new sampling option is its SamplingParams field, a field of SamplingInputs, and its math
# in corelib/ops/sampling.py.
SAMPLING_COLUMNS: tuple[SamplingColumn, ...] = tuple(
    SamplingColumn(column.name or param, _COLUMN_DTYPES[column.dtype], param, column.neutral, column.examples)
    for param, column in sampler_columns()
)


@dataclass(frozen=True)
class SamplingTable:
    """A per-request table of token ids or values [B, width] (what no scalar column holds), packed from the
    request by ``corelib.engine.packing`` and carried in every step's inputs like the columns."""

    name: str  # the field of SamplingInputs and of the step's input arena
    dtype: torch.dtype
    width: int
    neutral: float  # its value on padded entries and rows: changes nothing


# logit_bias as (token id, bias) pairs, padded with (0, 0.0): adding 0 to token 0 changes nothing; the stop
# ids min_tokens bans until the request has that many outputs, padded with -1 (no token).
SAMPLING_TABLES: tuple[SamplingTable, ...] = (
    SamplingTable("bias_ids", torch.int64, LOGIT_BIAS_WIDTH, 0),
    SamplingTable("bias_values", torch.float32, LOGIT_BIAS_WIDTH, 0.0),
    SamplingTable("stop_ids", torch.int64, MIN_TOKENS_STOP_WIDTH, -1),
)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens each sequence has seen so far, on the device, by state index: what penalties read.

    output_counts [S, V] int32: how often each token was sampled; prompt_counts [S, V] int32: how
    often it occurs in the prompt; states [B] int64: each row's state index (rows of padding
    share the last one). The runner keeps both tables current inside the step, with no host sync.
    """

    output_counts: torch.Tensor
    prompt_counts: torch.Tensor
    states: torch.Tensor


@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling values on the device, [B] (the tables [B, width]): temperature 0 means greedy.

    ``history`` None: no penalties are applied (every penalty neutral).
    """

    presence_penalty: torch.Tensor  # float32, 0: none; minus this for each token already sampled
    frequency_penalty: torch.Tensor  # float32, 0: none; minus this times how often it was sampled
    repetition_penalty: torch.Tensor  # float32, 1: none; divides a seen token's positive logit, multiplies a negative
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32, 1: no cut
    top_k: torch.Tensor  # int64, 0: no cut
    min_p: torch.Tensor  # float32, 0: no cut; tokens less likely than min_p times the likeliest are cut
    min_tokens: torch.Tensor  # int64, 0: none; stop_ids are banned while the row has fewer outputs
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: the position of the sampled token (the counter of the noise)
    history: TokenHistory | None = None
    bias_ids: torch.Tensor | None = None  # [B, LOGIT_BIAS_WIDTH] int64: logit_bias's token ids (None: no bias)
    bias_values: torch.Tensor | None = None  # [B, LOGIT_BIAS_WIDTH] float32: the bias added to each
    stop_ids: torch.Tensor | None = None  # [B, MIN_TOKENS_STOP_WIDTH] int64: banned before min_tokens (-1: none)
    prompt_lens: torch.Tensor | None = None  # [B] int64: outputs so far are positions - prompt_lens (None: 0)
    # Known on the host when the step is packed: False when no row has a temperature above 0, so every row takes
    # the argmax of its processed logits (bias, min_tokens, penalties), what the draw gives such rows, without
    # the draw's noise over the vocabulary. True: rows with a temperature draw.
    draws: bool = True
    # With draws: False when no row has a cut (top-k, top-p below 1, min_p), so nothing is sorted; True is never
    # wrong (a row without cuts keeps every token either way), only slower.
    cuts: bool = True

    @classmethod
    def from_views(
        cls, views: Mapping[str, torch.Tensor], rows: int, positions: torch.Tensor, history: TokenHistory | None = None,
        draws: bool = True, cuts: bool = True,
    ) -> SamplingInputs:
        """The first ``rows`` rows of a step's sampling columns and tables."""
        return cls(**{c.name: views[c.name][:rows] for c in SAMPLING_COLUMNS}, positions=positions, history=history,
                   **{t.name: views[t.name][:rows] for t in SAMPLING_TABLES}, prompt_lens=views["prompt_lens"][:rows],
                   draws=draws, cuts=cuts)

    @classmethod
    def of(
        cls, positions: torch.Tensor, history: TokenHistory | None = None, prompt_lens: torch.Tensor | None = None,
        **columns: torch.Tensor | Sequence[float] | Sequence[Sequence[float]],
    ) -> SamplingInputs:
        """Rows of the given columns and tables (tensors or lists, by name); the others hold their neutral value."""
        device, rows = positions.device, positions.shape[0]
        unknown = sorted(set(columns) - {c.name for c in SAMPLING_COLUMNS} - {t.name for t in SAMPLING_TABLES})
        if unknown:
            raise TypeError(f"SamplingInputs.of: unknown columns {unknown}")
        values = {c.name: torch.as_tensor(columns[c.name], dtype=c.dtype, device=device) if c.name in columns
                  else torch.full((rows,), c.neutral, dtype=c.dtype, device=device) for c in SAMPLING_COLUMNS}
        tables = {t.name: torch.as_tensor(columns[t.name], dtype=t.dtype, device=device) if t.name in columns
                  else torch.full((rows, t.width), t.neutral, dtype=t.dtype, device=device) for t in SAMPLING_TABLES}
        return cls(**values, positions=positions, history=history, **tables, prompt_lens=prompt_lens, draws=True,
                   cuts=True)


class RmsNorm(Protocol):
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H], weight [H]. Without residual: (rms_norm(x) * weight, x).

        With residual [..., H]: h = x + residual, then (rms_norm(h) * weight, h): the sum is
        the next residual. Statistics in float32; output in x's dtype.
        """
        ...


class RopeKvWrite(Protocol):
    def __call__(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k (rotate-half RoPE, as Hugging Face Llama) and write k and v into the paged cache.

        qk [T, nh+nkv, hd] (query heads first; may be a strided view of a fused qkv output),
        v [T, nkv, hd], positions [T] int64, cos_sin [max_len, 2, hd] (cos, sin per position),
        k_cache / v_cache [NB, bs, nkv, hd], slot_mapping [T] int64 (block * bs + offset).
        Returns the rotated qk [T, nh+nkv, hd], contiguous.
        """
        ...


class PagedAttentionOp(Protocol):
    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
    ) -> torch.Tensor:
        """Each row's queries over its cached keys, causal: q [T, nh, hd] -> [T, nh, hd].

        The step's keys and values are already in the cache (written by rope_kv_write): a prefill
        chunk attends to the blocks cached before it and to itself, up to each query's position;
        a decode row (one query) to its whole context. Grouped-query: query head j reads KV head
        j // (nh // nkv). With ``attn.is_decode`` (T = B, one query per row, a captured graph's step)
        it must be graph-safe: no host sync, a launch fixed by the shapes; so with ``attn.captured``.
        """
        ...


class SiluMul(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
        ...


class Sample(Protocol):
    def __call__(self, logits: torch.Tensor, sampling: SamplingInputs | None) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64. None: every row greedy (argmax).

        With sampling: logit_bias and min_tokens' ban, then the penalties of ``sampling.history`` (repetition,
        then frequency and presence, as vLLM applies them); then rows with temperature > 0 sample from
        softmax(logits / temperature) cut to the top_k tokens, then min_p, then to the smallest set whose
        mass reaches top_p (top_p 1: no cut), with Gumbel noise from a counter-based hash of (seed, position,
        token id), ties to the lowest id; other rows take the argmax of the penalized logits.
        """
        ...


class SamplePublish(Protocol):
    def __call__(self, logits: torch.Tensor, sampling: SamplingInputs | None, checked: torch.Tensor,
                 relay: torch.Tensor, relay_slots: torch.Tensor) -> torch.Tensor:
        """A step's last op: ``sample``'s token ids [B] int64, returned and published where they go.

        checked [B] int64 (what the host reads): row i's token, or ``NONFINITE`` (-1) where row i's logits
        hold a NaN or an inf (the composition checks their sum: a row of finite logits whose float32 sum
        overflows, past about 3.4e38 / V a logit, reads NONFINITE too); relay [S] int64 (what the next step's
        inputs read): relay[relay_slots[i]] = row i's token, relay_slots [B] int64 (rows that name one slot,
        the padding rows' own, leave any one of their tokens there). The same as ``sample``, then those two
        writes; a provider may make them in its sampling kernel.
        """
        ...


class RelayInputs(Protocol):
    def __call__(self, input_ids: torch.Tensor, relay: torch.Tensor, states: torch.Tensor, slot_tokens: torch.Tensor,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
        """A step's first op: its input ids [T] int64 with each negative one (a token the host has not seen yet)
        replaced by relay[states[t]] (relay [S] int64: the latest sample of each state index, as
        ``sample_publish`` left it; states [T] int64); returns them and writes them to slot_tokens[slot_mapping[t]]
        too (slot_tokens [NS] int64: the token fed at each KV slot; slot_mapping [T] int64, each a valid slot).
        """
        ...


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype; weight [N, K] as the checkpoint holds it.

        A provider may stream the weight from a layout of its own (made once per weight, outside
        graph capture); the weight the model holds, and the reference sees, stays plain.
        """
        ...


class LinearResidual(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T: x [M, K], weight [N, K], residual [M, N] -> [M, N].

        The product is rounded to the model dtype before the add (as F.linear, then +): the
        o-projection and the down projection with the residual add of the decoder layer. The
        result may be written over ``residual`` and returned (the layer never reads the old
        stream again), which saves a provider that adds in its GEMM's epilogue a copy of it.
        """
        ...


class NormQkvRopeKvWrite(Protocol):
    def __call__(
        self,
        h: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        qkv_weight: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The attention input of a decoder layer: rms_norm, the qkv projection, RoPE and the KV write.

        h [B, H] (the residual stream), norm_weight [H], or None where it is folded into qkv_weight's
        columns (:func:`fold_norm_weight`: a unit weight), qkv_weight [(nh + 2 nkv) hd, H] (query
        rows, then key, then value rows), qkv_bias [(nh + 2 nkv) hd] or None; nkv and hd come from
        the caches [NB, bs, nkv, hd]. k and v go to the cache at slot_mapping [B] (negative: not
        written); returns the rotated queries [B, nh, hd]. The same as rms_norm, linear and
        rope_kv_write one after another.
        """
        ...


class NormQkvAttention(Protocol):
    def __call__(
        self,
        h: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        qkv_weight: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn: PagedAttention,
        scale: float,
    ) -> torch.Tensor:
        """A decoder layer's attention from its residual stream: norm_qkv_rope_kv_write, then paged_attention.

        Takes what the two take (h [T, H] and the step's attn), writes the step's keys and values into
        the caches as the first does, and returns the attention's output [T, nh, hd]. A provider may run the
        step in fewer kernels where the rotated queries need not leave them (a decode step beside a
        library GEMM): the caches as the first op writes them, the output within the dtype's tolerance
        of the two ops one after the other (its softmax may take the newest key on its own).
        """
        ...


class NormGateUpSiluMul(Protocol):
    def __call__(
        self, h: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, gate_up_weight: torch.Tensor
    ) -> torch.Tensor:
        """The MLP input: silu_mul(linear(rms_norm(h) , gate_up_weight)): h [M, H], gate_up [2 I, H] -> [M, I];
        norm_weight [H], or None where it is folded into gate_up_weight's columns (a unit weight)."""
        ...


class NormLogits(Protocol):
    def __call__(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        """float32 logits [M, V] of rms_norm(h) @ weight.T; weight [V, H] (the LM head).

        The reference rounds the product to the model dtype before widening it; a provider may
        keep its float32 accumulation (closer to the exact value), within the dtype's tolerance.
        """
        ...


@dataclass(frozen=True)
class Ops:
    """The ops a model calls, and who provides each one.

    The composed ops (``COMPOSED_OPS``) left as None are built from this container's own ops,
    so they follow whichever provider runs their parts.
    """

    rms_norm: RmsNorm
    rope_kv_write: RopeKvWrite
    paged_attention: PagedAttentionOp
    silu_mul: SiluMul
    sample: Sample
    linear: Linear
    linear_residual: LinearResidual = None  # type: ignore[assignment]
    norm_qkv_rope_kv_write: NormQkvRopeKvWrite = None  # type: ignore[assignment]
    norm_gate_up_silu_mul: NormGateUpSiluMul = None  # type: ignore[assignment]
    norm_logits: NormLogits = None  # type: ignore[assignment]
    norm_qkv_attention: NormQkvAttention = None  # type: ignore[assignment]
    sample_publish: SamplePublish = None  # type: ignore[assignment]
    relay_inputs: RelayInputs = None  # type: ignore[assignment]
    providers: Mapping[str, str] = field(default_factory=lambda: dict.fromkeys(OP_NAMES, "reference"))

    def __post_init__(self) -> None:
        providers = dict(self.providers)
        for op, parts in COMPOSED_PARTS.items():
            if getattr(self, op) is None:
                object.__setattr__(self, op, functools.partial(_COMPOSERS[op], self))
                by_provider = any(providers.get(part, "reference") != "reference" for part in parts)
                providers[op] = COMPOSED if by_provider else "reference"
        object.__setattr__(self, "providers", providers)

    def with_provider(self, name: str, ops: Mapping[str, object]) -> Ops:
        """These ops replaced by ``ops`` (op name -> callable), provided by ``name``.

        A composed op the provider does not offer is composed again from the new container's ops.
        """
        unknown = sorted(set(ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"op provider {name!r} offers unknown ops {unknown}; the ops are {', '.join(OP_NAMES)}")
        providers = dict(self.providers)
        providers.update(dict.fromkeys(ops, name))
        kept = {op: getattr(self, op) for op in OP_NAMES
                if op not in COMPOSED_OPS or providers[op] not in ("reference", COMPOSED)}
        return Ops(**{**kept, **ops}, providers=providers)

    @property
    def fused(self) -> tuple[str, ...]:
        """The ops some provider other than the reference runs (as one op, not composed of others)."""
        return tuple(op for op in OP_NAMES if self.providers.get(op, "reference") not in ("reference", COMPOSED))



class OpProvider(Protocol):
    """What a backend offers: a name, the ops it provides, and how to load them for a device."""

    name: str
    #: its paged_attention reads only each sequence's live blocks (seq_lens), whatever the
    #: block-table width: then one graph captured at the full width serves every batch, with no
    #: KV-width buckets but those ``engine.graph_kv_sizes`` names. False when the kernel reads the
    #: whole width it is given.
    live_blocks_only: bool
    #: its norm_qkv_rope_kv_write and norm_gate_up_silu_mul run faster with the norm's weight folded
    #: into the projection's columns (norm_weight None), which the engine then does once at start
    #: (:func:`fold_norm_weight`): beside a library GEMM, the norm's 1/rms then scales the product in
    #: the kernel after it, and no norm kernel runs before it.
    folded_norms: bool

    def available(self) -> str | None:
        """None when the provider can load here; else why not, in one line (a missing package)."""
        ...

    def op_names(self) -> tuple[str, ...]:
        """The ops ``load`` returns, known without a device (``plan`` shows them)."""
        ...

    def load(self, device: Device) -> Mapping[str, object]:
        """Op name -> callable for ``device``; called once when the engine builds its runner.

        Where the ``pdl`` gate is on (only for a backend declaring the programmatic-launch
        capabilities), the engine calls ``load(device, pdl=True)``: then every kernel the ops
        launch that way waits for its predecessor before it reads or writes anything that one
        may touch, and a kernel that never waits is launched plainly.
        """
        ...


class ProgrammaticLaunchProvider(Protocol):
    """A provider whose backend declares ``capabilities.programmatic_launch_kernels``: load takes ``pdl``."""

    def load(self, device: Device, pdl: bool = False) -> Mapping[str, object]: ...


def load_provider(provider: OpProvider, device: Device, pdl: bool) -> Mapping[str, object]:
    """``provider.load(device)``; with ``pdl`` (the gate holds only where the backend declares its
    provider's kernels PDL-capable) ``load(device, pdl=True)``."""
    if not pdl:
        return provider.load(device)
    return cast(ProgrammaticLaunchProvider, provider).load(device, pdl=True)
