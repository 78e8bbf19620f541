# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""Greedy sampling as a two-pass argmax (no sort of the vocabulary), also after the sampler's processing of the
logits where no row draws; rows that draw use the reference.

Pass one: each program takes one chunk of one row and keeps its maximum and where it is.
Pass two: one program per row picks the best chunk. Ties go to the lowest token id in both
passes, as torch.argmax does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from corelib.ops.sampling import processed_logits, sample_rows
from corelib.ops.spec import SamplingInputs
from corelib_cuda.triton_ops.common import check, next_power_of_2

_OP = "sample"
_CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(logits_ptr, best_ptr, where_ptr, vocab, row_stride, CHUNK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # launched early: wait for the kernel before this one before touching anything
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    where = tl.min(tl.where(x == best, cols, vocab), axis=0)  # the first maximum
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, tokens_ptr, chunks, vocab, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < chunks
    best = tl.load(best_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    where = tl.load(where_ptr + row * chunks + c, mask=ok, other=vocab)
    top = tl.max(best, axis=0)
    tl.store(tokens_ptr + row, tl.min(tl.where(ok & (best == top), where, vocab), axis=0).to(tl.int64))


@functools.lru_cache(maxsize=16)
def _chunks(vocab: int) -> tuple[int, int]:
    chunks = triton.cdiv(vocab, _CHUNK)
    return chunks, next_power_of_2(chunks)


def argmax(logits: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    # logits [B, V] -> [B] int64; pdl: both kernels launched with programmatic dependent launch
    rows, vocab = logits.shape
    tokens = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    chunks, chunks_pad = _chunks(vocab)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    launch = {"launch_pdl": True} if pdl else {}
    _chunk_argmax_kernel[(rows, chunks)](logits, best, where, vocab, logits.stride(0), CHUNK=_CHUNK, PDL=pdl,
                                         num_warps=8, **launch)
    _row_argmax_kernel[(rows,)](best, where, tokens, chunks, vocab, CHUNKS_PAD=chunks_pad, PDL=pdl, **launch)
    return tokens


def sample(logits: torch.Tensor, sampling: SamplingInputs | None, *, pdl: bool = False) -> torch.Tensor:
    # logits [B, V] float32 -> token ids [B] int64; sampling None: every row greedy
    check(logits.dim() == 2 and logits.dtype == torch.float32, _OP,
          f"expected float32 logits [B, V]; got {logits.dtype} {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if sampling is None:
        return argmax(logits, pdl)
    if not sampling.draws:  # every row greedy: the argmax of the processed logits, as the reference takes it
        return argmax(processed_logits(logits, sampling), pdl)
    # Sampled rows need the sorted vocabulary for top-p; the reference does that, with the same noise.
    return sample_rows(logits, sampling)
