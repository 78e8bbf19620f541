"""One thread drives an engine: a second is refused clearly, callbacks may re-enter, nothing is lost."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from support import EngineFactory, local_weights

from corelib.engine import Engine, RequestOutput, SamplingParams
from corelib.engine.sequence import Sequence
from corelib.errors import ConcurrentUse

PROMPTS = [[2, 3, 4], [5, 6], [7, 8, 9, 10]]


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine.from_overrides(["backend=cpu"]) as built:
        yield built


def test_a_second_thread_is_refused_and_the_first_caller_is_unharmed(engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
    inside = threading.Event()
    refused: list[BaseException] = []

    def callback(_: RequestOutput) -> None:
        inside.set()

    def intruder() -> None:
        inside.wait(30)
        try:
            engine.generate([[11, 12]], SamplingParams(max_tokens=2))
        except BaseException as error:  # noqa: BLE001 - inspected below
            refused.append(error)

    thread = threading.Thread(target=intruder)
    thread.start()
    slow = [SamplingParams(max_tokens=1, ignore_eos=True), params, params, params]
    outputs = engine.generate([[1, 1], *PROMPTS], slow, on_finish=callback)
    thread.join(30)
    assert [o.output_token_ids for o in outputs[1:]] == alone
    assert len(refused) == 1 and isinstance(refused[0], ConcurrentUse)
    assert "one thread at a time" in str(refused[0])


def test_a_callback_that_re_enters_generate_steals_nothing(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = {tuple(p): o.output_token_ids for p, o in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True)}
    inner: list[list[RequestOutput]] = []

    def reenter(output: RequestOutput) -> None:
        if not inner:
            inner.append(engine.generate([[20, 21]], SamplingParams(max_tokens=3, ignore_eos=True)))

    outer = engine.generate(PROMPTS, params, on_finish=reenter)
    assert {tuple(o.prompt_token_ids): o.output_token_ids for o in outer} == alone
    assert len(inner) == 1 and [o.prompt_token_ids for o in inner[0]] == [[20, 21]]
    assert engine.take_finished() == [], "every output went to the call that asked for it"


def test_a_callback_that_raises_loses_no_other_request(engine: Engine) -> None:
    other = engine.add_request([30, 31], SamplingParams(max_tokens=30, ignore_eos=True))

    def explode(output: RequestOutput) -> None:
        raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed"):
        engine.generate([[2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), on_finish=explode)
    finished = {o.request_id: o for o in engine.stream()}
    assert other in finished and len(finished[other].output_token_ids) == 30


def test_duplicate_request_ids_and_loose_prompts_are_refused(engine: Engine) -> None:
    engine.add_request([2, 3], request_id="a")
    with pytest.raises(Exception, match="already in use"):
        engine.add_request([4, 5], request_id="a")
    for prompt in (b"\x02\x03", {"a": 1}, {2, 3}):
        rid = engine.add_request(prompt)  # type: ignore[arg-type]
        (failed,) = [o for o in engine.take_finished() if o.request_id == rid]
        assert failed.finish_reason == "error" and "pass token ids" in (failed.error or "")


def test_non_finite_logits_fail_their_request_alone(engine: Engine) -> None:
    weights = local_weights(engine)
    good = engine.generate([[5, 6]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    poison = 7
    weights.embed[poison] = float("nan")
    bad, fine = engine.generate([[poison, 6], [5, 6]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert bad.finish_reason == "error" and "not finite" in (bad.error or "")
    assert fine.output_token_ids == good
    assert torch.isnan(weights.embed[poison]).all()


def test_an_engines_weights_are_its_own(make_engine: EngineFactory) -> None:
    """Random weights are cached on the host between engines; changing one engine's must not reach the next."""
    first = make_engine(["backend=cpu"])
    local_weights(first).embed.fill_(float("nan"))
    second = make_engine(["backend=cpu"])
    out = second.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and torch.isfinite(local_weights(second).embed).all()


@pytest.mark.parametrize("early", ["shorter", "aborted", "invalid"])
def test_generate_returns_when_an_added_request_finishes_before_its_own(
    engine: Engine, early: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # generate must advance the engine each time it finds nothing of its own: count the looks per step,
    # so a loop that keeps finding the other caller's output again fails here instead of spinning forever.
    looks = {"finished": 0, "steps": 0}
    core = engine.core
    take, iterate = core.take_finished, core.iterate

    def counted_take() -> list[Sequence]:
        looks["finished"] += 1
        assert looks["finished"] <= 3 * (looks["steps"] + 1), "generate looks for outputs without stepping"
        return take()

    def counted_iterate() -> bool:
        looks["steps"] += 1
        return iterate()

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    other = engine.add_request([30, 31] if early != "invalid" else [], SamplingParams(max_tokens=1, ignore_eos=True))
    if early == "aborted":
        assert engine.abort(other)
    monkeypatch.setattr(core, "take_finished", counted_take)
    monkeypatch.setattr(core, "iterate", counted_iterate)
    outputs = engine.generate(PROMPTS, params)
    monkeypatch.undo()
    assert [len(o.output_token_ids) for o in outputs] == [8, 8, 8]
    kept = engine.take_finished()
    assert [o.request_id for o in kept] == [other], "the added request's output must wait for its caller"
    assert kept[0].finish_reason == {"shorter": "length", "aborted": "abort", "invalid": "error"}[early]
