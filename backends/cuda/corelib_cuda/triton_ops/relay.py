# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""A step's input ids from the relay, and the tokens fed at each KV slot: one kernel where torch takes four."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corelib_cuda.triton_ops.common import check

_OP = "relay_inputs"
_BLOCK = 1024


@triton.jit
def _relay_inputs_kernel(ids_ptr, relay_ptr, states_ptr, slot_tokens_ptr, slots_ptr, out_ptr, tokens,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < tokens
    ids = tl.load(ids_ptr + t, mask=ok, other=0)
    relayed = ok & (ids < 0)  # a token the host has not seen: its state's latest sample
    state = tl.load(states_ptr + t, mask=relayed, other=0)
    fed = tl.where(relayed, tl.load(relay_ptr + state, mask=relayed, other=0), ids)
    tl.store(out_ptr + t, fed, mask=ok)
    slot = tl.load(slots_ptr + t, mask=ok, other=-1)
    tl.store(slot_tokens_ptr + slot, fed, mask=ok & (slot >= 0))


def relay_inputs(input_ids: torch.Tensor, relay: torch.Tensor, states: torch.Tensor, slot_tokens: torch.Tensor,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
    # input_ids, states, slot_mapping [T]; relay [S], slot_tokens [NS]; all int64 -> the fed ids [T]
    tokens = input_ids.shape[0]
    vectors = {"input_ids": input_ids, "relay": relay, "states": states, "slot_tokens": slot_tokens,
               "slot_mapping": slot_mapping}
    wrong = [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in vectors.items()
             if t.dim() != 1 or t.dtype != torch.int64 or (name in ("states", "slot_mapping") and len(t) != tokens)]
    check(not wrong, _OP, f"expected int64 vectors, states and slot_mapping as long as input_ids ({tokens}); got "
                          f"{', '.join(wrong)}")
    check(relay.is_contiguous() and slot_tokens.is_contiguous(), _OP, "relay and slot_tokens must be contiguous")
    out = torch.empty((tokens,), dtype=torch.int64, device=input_ids.device)
    if tokens:
        _relay_inputs_kernel[(triton.cdiv(tokens, _BLOCK),)](
            input_ids.contiguous(), relay, states.contiguous(), slot_tokens, slot_mapping.contiguous(), out, tokens,
            BLOCK=_BLOCK, num_warps=4)
    return out
