"""Async token handoff gives exactly the synchronous path's greedy tokens, under chaos.

The mixed workload has arrivals while steps are in flight, different lengths, EOS,
max_tokens=1 and a KV pool small enough to force preemption.

Async runs the same requests in other batches than sync (a request that ends frees its row a step
later), and a GPU kernel's summation order follows the batch size: where two logits tie to within
float32's rounding the two paths may break the tie differently. Such a request is compared up to
that token, which the plain reference must show as a tie; a token taken out of order is never one.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from support import EngineFactory, local_weights

from corelib.engine import Engine, SamplingParams
from corelib.errors import PlanRefused
from corelib.models.reference import reference_logits

POOL = ["engine.max_num_seqs=6", "engine.num_kv_blocks=24", "model.max_model_len=160"]


def mixed_requests(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randint(1, 40))]
        max_tokens = 1 if i % 9 == 0 else rng.randint(2, 100)
        requests.append((prompt, SamplingParams(max_tokens=max_tokens)))
    return requests


def run_with_arrivals(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add a third of the requests up front, the rest a few at a time while steps are in flight."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(requests))
    first = len(pending) // 3
    for index, (prompt, sampling) in pending[:first]:
        engine.add_request(prompt, sampling, request_id=str(index))
    pending = pending[first:]
    iterations = 0
    while pending or engine.has_unfinished:
        if pending and iterations % 7 == 0:
            for index, (prompt, sampling) in pending[:2]:
                engine.add_request(prompt, sampling, request_id=str(index))
            pending = pending[2:]
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
        iterations += 1
    return outputs


#: two logits within this share of the largest one are a tie that a row's batch may break either way (float32)
TIE = 1e-5


def assert_same_tokens(got: dict[str, list[int]], expected: dict[str, list[int]], engine: Engine,
                       requests: list[tuple[list[int], SamplingParams]]) -> None:
    """``got`` is ``expected``, but where a request's first different token ties with the expected one in the
    plain reference's logits (then the rest of that request is not compared); a few such requests at most."""
    assert got.keys() == expected.keys()
    ties = []
    for request_id in sorted(expected, key=int):
        want, have = expected[request_id], got[request_id]
        if want == have:
            continue
        at = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
        assert at is not None, f"request {request_id}: {len(have)} tokens where sync gave {len(want)}: {have} {want}"
        logits = reference_logits(local_weights(engine), [*requests[int(request_id)][0], *want[:at]]).double()
        scale, top = float(logits.abs().max()), float(logits.max())
        behind = top - min(float(logits[want[at]]), float(logits[have[at]]))
        assert behind <= TIE * scale, (
            f"request {request_id}, token {at}: async {have[at]}, sync {want[at]}; the reference's logits "
            f"{float(logits[have[at]]):.6f} and {float(logits[want[at]]):.6f} (largest {top:.6f}) are no tie")
        ties.append(request_id)
    assert len(ties) <= max(1, len(expected) // 100), f"near ties in {len(ties)} requests: {ties}"


def frequent_token(make_engine: EngineFactory, requests: list[tuple[list[int], SamplingParams]]) -> int:
    probe = make_engine(["backend=cpu", *POOL])
    outs = probe.generate([p for p, _ in requests[:20]], SamplingParams(max_tokens=30, ignore_eos=True))
    counts = Counter(t for o in outs for t in o.output_token_ids)
    return counts.most_common(1)[0][0]


TARGETS = [
    pytest.param("cuda", "emulated", id="cuda-emulated-chaos"),
    pytest.param("npu", "emulated", id="npu-emulated-chaos"),
    pytest.param("mlu", "emulated", id="mlu-emulated-chaos"),
    pytest.param("cuda", "native", id="cuda-native", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(("backend", "runtime"), TARGETS)
def test_async_matches_sync_under_chaos(make_engine: EngineFactory, backend: str, runtime: str) -> None:
    requests = mixed_requests(330, seed=7)  # 2000+ steps of decode rows alone, with chunked prefill
    eos = frequent_token(make_engine, requests)
    common = [*POOL, f"model.eos_token_id={eos}", f"backend={backend}", f"backend.runtime={runtime}"]
    sync = make_engine([*common, "engine.async_token_handoff=off"])
    expected = run_with_arrivals(sync, requests)
    chaos = ["backend.emulator.chaos=0.2", "backend.emulator.chaos_max_ms=0.5"] if runtime == "emulated" else []
    engine = make_engine([*common, *chaos, "engine.async_token_handoff=on"])
    got = run_with_arrivals(engine, requests)
    assert_same_tokens(got, expected, engine, requests)
    summary = engine.metrics(1.0)
    assert summary["steps_decode"] >= 2000, summary["steps_decode"]
    assert summary["steps_async"] == summary["steps"], "every step should take the async path"
    assert engine.scheduler.num_preemptions > 0, "the workload was meant to force preemption"
    stopped_by_eos = sum(1 for ids in got.values() if ids and ids[-1] == eos)
    assert stopped_by_eos > 5 and sum(1 for ids in got.values() if len(ids) == 1) > 5


def test_per_step_fallback_runs_flagged_batches_synchronously(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=npu", "engine.async_token_handoff=on"])
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    stops = SamplingParams(max_tokens=12, ignore_eos=True, stop="<never>")
    outs = engine.generate(prompts, [plain, stops, plain], multimodal=[False, False, False])
    summary = engine.metrics(1.0)
    assert summary["steps_sync"] > 0 and summary["steps_sync"] == summary["steps"]
    assert "a request in the batch needs host-side stop-string checks" in summary["sync_step_reasons"]
    later = engine.generate(prompts, plain, multimodal=[False, True, False])
    assert [o.output_token_ids for o in later] == [o.output_token_ids for o in outs]
    summary = engine.metrics(1.0)
    assert "a multimodal request is in the batch" in summary["sync_step_reasons"]
    final = engine.generate(prompts, plain)
    assert [o.output_token_ids for o in final] == [o.output_token_ids for o in outs]
    assert engine.metrics(1.0)["steps_async"] > 0


def test_hybrid_model_is_refused_under_on_and_disabled_under_auto(make_engine: EngineFactory) -> None:
    with pytest.raises(PlanRefused, match="recurrent"):
        make_engine(["backend=npu", "model=hybrid-tiny", "engine.async_token_handoff=on"])
    engine = make_engine(["backend=npu", "model=hybrid-tiny"])
    decision = engine.plan.decisions["async_token_handoff"]
    assert not decision.enabled and any("recurrent" in r for r in decision.reasons)
    assert not engine.async_handoff
