# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""Sampling as a two-pass argmax over the vocabulary: of the logits (greedy), of the processed logits where no
row draws, and of the scaled logits plus the reference's Gumbel noise where rows draw. Only cuts (top-k, top-p,
min_p) sort, in torch (the reference's ``cut_thresholds``); the kernel keeps what they keep by its threshold.

Pass one: each program takes one chunk of one row and keeps its maximum and where it is.
Pass two: one program per row picks the best chunk. Ties go to the lowest token id in both
passes, as torch.argmax does.

The noise is the reference's splitmix64 hash of (seed, position, token id) in int64, the temperature a
correctly rounded division and the logarithm libdevice's (the one torch's CUDA kernels call), so a row draws
the reference's token on the GPU; Triton's interpreter has no libdevice and takes its own logarithm.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from corelib.ops import NONFINITE as _NONFINITE
from corelib.ops.composed import publish_tokens
from corelib.ops.sampling import NOISE_CONSTANTS, add_token_bias_, cut_thresholds, scaled_logits
from corelib.ops.spec import SamplingInputs
from corelib_cuda.triton_ops.common import check, next_power_of_2

_OP = "sample"
_CHUNK = 4096
# the reference's hash constants (signed int64), as compile-time constants of the kernel
_GOLDEN, _MIX1, _MIX2, _POSITION_KEY = (tl.constexpr(value) for value in NOISE_CONSTANTS)
NONFINITE = tl.constexpr(_NONFINITE)


@triton.jit
def _chunk_argmax_kernel(logits_ptr, best_ptr, where_ptr, bad_ptr, vocab, row_stride, CHUNK: tl.constexpr,
                         CHECK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early: wait for the kernel before this one before touching anything
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    where = tl.min(tl.where(x == best, cols, vocab), axis=0)  # the first maximum
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)
    if CHECK:  # the chunk's NaNs and infs (|NaN| < inf is false)
        tl.store(bad_ptr + out, tl.sum(tl.where(inside & ~(tl.abs(x) < float("inf")), 1, 0), axis=0))


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, tokens_ptr, bad_ptr, checked_ptr, relay_ptr, slots_ptr, chunks, vocab,
                       CHUNKS_PAD: tl.constexpr, PUBLISH: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < chunks
    best = tl.load(best_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * chunks + c, mask=ok, other=vocab)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(ok & (best == top), where, vocab), axis=0)
    # A row holding NaN equals no maximum: it still gets a valid id (the finite check fails its request; the id
    # may be fed to the next step before the host has read that).
    token = tl.minimum(token, vocab - 1).to(tl.int64)
    tl.store(tokens_ptr + row, token)
    if PUBLISH:  # sample_publish: the host's copy (NONFINITE where a chunk held a NaN or an inf) and the relay's
        bad = tl.sum(tl.load(bad_ptr + row * chunks + c, mask=ok, other=0), axis=0)
        tl.store(checked_ptr + row, tl.where(bad == 0, token, NONFINITE))
        tl.store(relay_ptr + tl.load(slots_ptr + row), token)


@triton.jit
def _mix64(x):
    # the reference's splitmix64 finaliser: wrapping int64 arithmetic, arithmetic shifts
    x = x + _GOLDEN
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _chunk_draw_kernel(logits_ptr, temperature_ptr, seeds_ptr, positions_ptr, cut_value_ptr, cut_id_ptr, best_ptr,
                       where_ptr, vocab, row_stride, CUTS: tl.constexpr, CHUNK: tl.constexpr,
                       LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:  # a drawing row: the scaled logits plus the noise, over what its cuts keep
        scaled = tl.math.div_rn(x, tl.maximum(temperature, 1e-5))
        key = _mix64(tl.load(seeds_ptr + row) * _POSITION_KEY + tl.load(positions_ptr + row))
        bits = _mix64(key ^ cols.to(tl.int64))
        uniform = (((bits >> 40) & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # the reference's uniform_of
        if LIBDEVICE:  # noqa: SIM108 - a compile-time branch: the interpreter cannot trace libdevice
            noise = -libdevice.log(-libdevice.log(uniform))
        else:
            noise = -tl.log(-tl.log(uniform))
        x = scaled + noise
        if CUTS:
            value = tl.load(cut_value_ptr + row)
            kept = (scaled > value) | ((scaled == value) & (cols <= tl.load(cut_id_ptr + row)))
            x = tl.where(kept, x, float("-inf"))
        x = tl.where(inside, x, float("-inf"))
    best = tl.max(x, axis=0)
    where = tl.min(tl.where(inside & (x == best), cols, vocab), axis=0)  # the first maximum
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)


@triton.jit
def _penalty_kernel(logits_ptr, output_counts_ptr, prompt_counts_ptr, states_ptr, repetition_ptr, frequency_ptr,
                    presence_ptr, vocab, row_stride, CHUNK: tl.constexpr):
    # In place, the reference's order: repetition where the token was seen, then frequency and presence over the
    # sampled counts. A row whose three penalties are neutral is left as it is (the reference's arithmetic leaves
    # it exactly so) without reading its counts.
    row = tl.program_id(0).to(tl.int64)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    if (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0):
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        inside = cols < vocab
        state = tl.load(states_ptr + row).to(tl.int64)
        x = tl.load(logits_ptr + row * row_stride + cols, mask=inside)
        sampled = tl.load(output_counts_ptr + state * vocab + cols, mask=inside, other=0).to(tl.float32)
        prompt = tl.load(prompt_counts_ptr + state * vocab + cols, mask=inside, other=0)
        seen = (sampled > 0) | (prompt > 0)
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
        x = x - frequency * sampled  # two roundings, as the reference's (no fused multiply-add: see the launch)
        x = x - presence * (sampled > 0).to(tl.float32)
        tl.store(logits_ptr + row * row_stride + cols, x, mask=inside)


def processed_logits(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    # The reference's processed_logits, bit for bit, in one copy: logit_bias and min_tokens' ban added in place
    # (a few entries a row), then the penalties in one pass over the penalized rows only.
    out = logits.clone()
    add_token_bias_(out, sampling)
    history = sampling.history
    rows, vocab = out.shape
    if history is not None and rows:
        _penalty_kernel[(rows, _chunks(vocab)[0])](
            out, history.output_counts, history.prompt_counts, history.states, sampling.repetition_penalty,
            sampling.frequency_penalty, sampling.presence_penalty, vocab, out.stride(0), CHUNK=_CHUNK, num_warps=8,
            enable_fp_fusion=False)
    return out


@functools.lru_cache(maxsize=16)
def _chunks(vocab: int) -> tuple[int, int]:
    chunks = triton.cdiv(vocab, _CHUNK)
    return chunks, next_power_of_2(chunks)


def _scratch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    rows, vocab = logits.shape
    chunks, chunks_pad = _chunks(vocab)
    tokens = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    return tokens, best, where, chunks, chunks_pad


def argmax(logits: torch.Tensor, pdl: bool = False,
           publish: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    # logits [B, V] -> [B] int64; pdl: both kernels launched with programmatic dependent launch;
    # publish: (checked, relay, relay_slots) of sample_publish, written by the second kernel
    rows, vocab = logits.shape
    tokens, best, where, chunks, chunks_pad = _scratch(logits)
    if rows == 0:
        return tokens
    launch = {"launch_pdl": True} if pdl else {}
    bad = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device) if publish else where  # unused: where
    checked, relay, slots = publish or (tokens, tokens, tokens)  # unused without publish
    _chunk_argmax_kernel[(rows, chunks)](logits, best, where, bad, vocab, logits.stride(0), CHUNK=_CHUNK,
                                         CHECK=publish is not None, PDL=pdl, num_warps=8, **launch)
    _row_argmax_kernel[(rows,)](best, where, tokens, bad, checked, relay, slots, chunks, vocab, CHUNKS_PAD=chunks_pad,
                                PUBLISH=publish is not None, PDL=pdl, **launch)
    return tokens


def draw(logits: torch.Tensor, sampling: SamplingInputs, pdl: bool = False) -> torch.Tensor:
    # processed logits [B, V] -> [B] int64: drawing rows' noisy argmax over what their cuts keep, others' argmax
    rows, vocab = logits.shape
    tokens, best, where, chunks, chunks_pad = _scratch(logits)
    if rows == 0:
        return tokens
    temperature = sampling.temperature.to(torch.float32)
    cut_value, cut_id = (cut_thresholds(scaled_logits(logits, temperature), sampling) if sampling.cuts
                         else (temperature, sampling.seeds))  # unread without cuts
    launch = {"launch_pdl": True} if pdl else {}
    seeds, positions = sampling.seeds.to(torch.int64), sampling.positions.to(torch.int64)
    _chunk_draw_kernel[(rows, chunks)](
        logits, temperature, seeds, positions, cut_value, cut_id, best, where, vocab, logits.stride(0),
        CUTS=sampling.cuts, CHUNK=_CHUNK, LIBDEVICE=logits.is_cuda, PDL=pdl, num_warps=8, **launch)
    _row_argmax_kernel[(rows,)](best, where, tokens, where, tokens, tokens, tokens, chunks, vocab,
                                CHUNKS_PAD=chunks_pad, PUBLISH=False, PDL=pdl, **launch)
    return tokens


def sample(logits: torch.Tensor, sampling: SamplingInputs | None, *, pdl: bool = False) -> torch.Tensor:
    # logits [B, V] float32 -> token ids [B] int64; sampling None: every row greedy
    check(logits.dim() == 2 and logits.dtype == torch.float32, _OP,
          f"expected float32 logits [B, V]; got {logits.dtype} {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if sampling is None:
        return argmax(logits, pdl)
    logits = processed_logits(logits, sampling)
    if not sampling.draws:  # every row greedy: the argmax of the processed logits, as the reference takes it
        return argmax(logits, pdl)
    return draw(logits, sampling, pdl)


def sample_publish(logits: torch.Tensor, sampling: SamplingInputs | None, checked: torch.Tensor, relay: torch.Tensor,
                   relay_slots: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    # sample, with the host's copy and the relay written by the argmax's second kernel where no row is processed
    # (the check reads the logits the argmax reads); else sample, then the composition's check and writes
    if sampling is not None:
        return publish_tokens(logits, sample(logits, sampling, pdl=pdl), checked, relay, relay_slots)
    check(logits.dim() == 2 and logits.dtype == torch.float32, _OP,
          f"expected float32 logits [B, V]; got {logits.dtype} {tuple(logits.shape)}")
    rows = logits.shape[0]
    check(checked.shape == (rows,) and checked.dtype == torch.int64 and checked.is_contiguous()
          and relay.dtype == torch.int64 and relay.dim() == 1 and relay.is_contiguous()
          and relay_slots.shape == (rows,) and relay_slots.dtype == torch.int64, "sample_publish",
          f"expected checked [{rows}], relay [S] and relay_slots [{rows}] int64; got {tuple(checked.shape)} "
          f"{checked.dtype}, {tuple(relay.shape)} {relay.dtype}, {tuple(relay_slots.shape)} {relay_slots.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return argmax(logits, pdl, (checked, relay, relay_slots.contiguous()))
