"""The reference paged attention computes the written formula for query lengths of 1 or more.

Each query, one at a time in float64, against the keys of its row up to its own position, read
block by block through the block table: the oracle the conformance suite's chunk cases rest on.
"""

from __future__ import annotations

import pytest
import torch

from corelib.ops import PagedAttention, reference
from corelib.ops.reference import decode_attention, paged_attention
from corelib.testing.op_cases import F32, CapturedChunkCase, ChunkCase, DecodeCase, case_id
from corelib.testing.op_conformance import CAPTURED_CASES, CHUNK_CASES, CHUNK_SWEEP


def written(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, case: ChunkCase, tables: torch.Tensor,
            scale: float) -> torch.Tensor:
    bs, group = case.block_size, case.group
    out = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for row, (cached, queries) in enumerate(case.rows):
        for j in range(queries):
            position = cached + j  # the query's own position: it sees keys 0..position
            keys = torch.stack([kc[int(tables[row, p // bs]), p % bs] for p in range(position + 1)]).double()
            values = torch.stack([vc[int(tables[row, p // bs]), p % bs] for p in range(position + 1)]).double()
            for head in range(q.shape[1]):
                scores = keys[:, head // group] @ q[token, head].double() * scale  # [position + 1]
                out[token, head] = scores.softmax(0) @ values[:, head // group]
            token += 1
    return out


@pytest.mark.parametrize("case", [c for c in [*CHUNK_CASES, *CHUNK_SWEEP] if c.dtype == F32][:5],
                         ids=lambda c: "-".join(f"{a}+{b}" for a, b in c.rows))
def test_each_query_sees_its_cached_context_and_the_chunk_up_to_itself(case: ChunkCase) -> None:
    q, kc, vc, attn, scale, _ = case.build(0, torch.device("cpu"))
    assert isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    assert isinstance(attn, PagedAttention) and isinstance(scale, float)
    got = paged_attention(q, kc, vc, attn, scale)
    expected = written(q, kc, vc, case, attn.block_tables, scale)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_one_query_per_row_is_the_decode_attention() -> None:
    q, kc, vc, attn, scale, _ = DecodeCase(F32, 5, 2, 64, 16, lengths=(15, 16, 17, 33, 1)).build(0, torch.device("cpu"))
    args = (q, kc, vc, attn, scale)
    assert torch.equal(paged_attention(*args), decode_attention(*args))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", [c for c in CAPTURED_CASES if c.dtype == F32], ids=case_id)
def test_a_captured_step_is_each_tokens_formula_and_zero_past_the_steps_tokens(case: CapturedChunkCase,
                                                                               seed: int) -> None:
    q, kc, vc, attn, scale, _ = case.build(seed, torch.device("cpu"))
    assert isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    assert isinstance(attn, PagedAttention) and isinstance(scale, float) and attn.captured
    rows = case.steps[seed % len(case.steps)]
    total = sum(queries for _, queries in rows)
    step = ChunkCase(case.dtype, case.group, case.head_dim, case.block_size, rows, case.kv_heads)
    got = paged_attention(q, kc, vc, attn, scale)
    expected = written(q[:total], kc, vc, step, attn.block_tables, scale)
    torch.testing.assert_close(got[:total].double(), expected, atol=1e-5, rtol=1e-5)
    assert not got[total:].any(), "the tokens past the step's belong to no row: 0"


def test_a_captured_step_bounds_what_it_gathers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    case = CAPTURED_CASES[0]
    q, kc, vc, attn, scale, _ = case.build(0, torch.device("cpu"))
    args = (q, kc, vc, attn, scale)
    whole = paged_attention(*args)  # type: ignore[arg-type]
    monkeypatch.setattr(reference, "CAPTURED_GATHER_ELEMENTS", 1)  # one token at a time
    torch.testing.assert_close(paged_attention(*args), whole)  # type: ignore[arg-type]
