"""Structured output: JSON-schema grammars whose matchers mask each sampled token on the device.

The tiny model has random weights, so without the mask its outputs are never JSON: every output
here parsing and matching its schema is the mask at work.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams
from corelib.engine.step_masks import MaskThread
from corelib.engine.structured import GrammarCache, GrammarState, StructuredOutputs
from corelib.models.synthetic import write_text_checkpoint
from corelib.ops.token_mask import apply_token_bitmask, mask_words
from corelib.sampling_params import SamplingError
from corelib.support.structured import StructuredOutputsError, StructuredOutputsParams
from corelib.support.text import Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}


def check_schema(text: str) -> None:
    """``text`` parses and is an instance of SCHEMA (checked field by field)."""
    value = json.loads(text)
    assert isinstance(value, dict) and list(value) == ["name", "age", "role", "ok"], text
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
    assert value["role"] in ("admin", "user", "guest")
    assert isinstance(value["ok"], bool)


# ----------------------------------------------------------------------------- params, quick


def test_params_keep_the_schema_as_compact_json_in_its_order() -> None:
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert a.key == b.key and list(json.loads(a.schema)["properties"]) == ["name", "age", "role", "ok"]
    assert StructuredOutputsParams(json_object=True).schema == '{"type":"object"}'
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert params.structured_outputs == a
    hash(params)  # a schema kept as text keeps the params hashable


@pytest.mark.parametrize(("value", "field", "says"), [
    ({"regex": "a+"}, "structured_outputs.regex", "not supported"),
    ({"choice": ["a"]}, "structured_outputs.choice", "not supported"),
    ({"json": "{nope"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1]}, "structured_outputs.json", "is an object"),
    ({}, "structured_outputs", "exactly one"),
    ({"json": SCHEMA, "json_object": True}, "structured_outputs", "exactly one"),
    ({"jsn": SCHEMA}, "structured_outputs.jsn", "unknown option"),
    ("schema", "structured_outputs", "pass an object"),
])
def test_bad_params_are_one_line_naming_the_field(value: object, field: str, says: str) -> None:
    with pytest.raises(SamplingError) as caught:
        SamplingParams(structured_outputs=value)  # type: ignore[arg-type]
    assert caught.value.field == field and says in str(caught.value) and "\n" not in str(caught.value)


def test_the_device_mask_keeps_exactly_the_allowed_tokens() -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    masks = torch.full((3, mask_words(vocab)), -1, dtype=torch.int32)
    masks[1] = 0
    masks[1, 0] = 1 << 5  # token 5
    masks[1, 2] = 1 << 1  # token 65
    masks[2] = 0
    masks[2, 1] = -(2**31)  # bit 31 of word 1: token 63
    out = apply_token_bitmask(logits, masks)
    assert torch.equal(out[0], logits[0])  # all ones: neutral
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 65]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [63]
    assert out[1].argmax().item() in (5, 65) and torch.equal(out[1, [5, 65]], logits[1, [5, 65]])


def test_a_schema_is_compiled_once_and_a_bad_one_refused_in_one_line() -> None:
    cache = GrammarCache(capacity=2)
    params = StructuredOutputsParams(json=SCHEMA)
    first = cache.grammar(params)
    assert cache.grammar(StructuredOutputsParams(json=json.dumps(SCHEMA))) == first and cache.compiled == 1
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}})
    for _ in range(2):
        with pytest.raises(StructuredOutputsError) as caught:
            cache.grammar(bad)
        assert caught.value.field == "structured_outputs.json" and "\n" not in str(caught.value)
    assert cache.compiled == 2  # the refusal is remembered too


def test_without_llguidance_a_request_is_told_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as when it is not installed
    with pytest.raises(StructuredOutputsError, match=r"pip install 'corelib\[structured\]'"):
        StructuredOutputs(None, 512, [1]).state(StructuredOutputsParams(json_object=True))


@pytest.mark.parametrize("version", ["1.6.1", "0.7.30", "dev"])
def test_an_llguidance_too_old_is_named_with_what_to_install(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    import types

    monkeypatch.setitem(sys.modules, "llguidance", types.SimpleNamespace(__version__=version))
    wanted = rf"llguidance 1\.7 or newer, not {version}: pip install"
    with pytest.raises(StructuredOutputsError, match=wanted) as caught:
        StructuredOutputs(None, 512, [1]).state(StructuredOutputsParams(json_object=True))
    assert "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=8",
                                f"model.path={model_dir}"]) as built:
        yield built


def schema_requests(count: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=80, temperature=0.9 if i % 2 else 0.0, seed=i,
                           structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(count)]


def step_of(grammars: Iterable[GrammarState | None]) -> Any:
    """A step whose rows hold these grammars (None: a plain request's row), as the packer reads it."""
    return SimpleNamespace(seqs=[SimpleNamespace(grammar=grammar) for grammar in grammars])


def test_the_rows_filled_in_parallel_are_the_rows_filled_one_by_one(model_dir: Path) -> None:
    import numpy as np

    from corelib.engine.packing import fill_masks

    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size, [1])
    states = [outputs.state(StructuredOutputsParams(json=SCHEMA)) for _ in range(3)]
    for token in tokenizer.encode('{"name":"ab', add_special_tokens=False):  # row 1 a few tokens in
        assert states[1].advance(token) is None
    words = mask_words(tokenizer.vocab_size)
    together = np.zeros((4, words), dtype=np.int32)  # row 3 has no grammar: every token allowed
    fill_masks(step_of([*states, None]), [0, 1, 2], together)
    alone = np.full((4, words), -1, dtype=np.int32)
    for row, state in enumerate(states):
        state.fill(alone[row].ctypes.data, alone[row].nbytes)
    assert (together == alone).all() and (together[0] != together[1]).any() and (together[3] == -1).all()


def test_a_steps_masks_allow_every_token_on_the_rows_without_a_grammar(model_dir: Path) -> None:
    # The arena is reused: whatever an earlier step left in the rows of a plain request or of the padding must
    # not reach their sampling, and a grammar's row is its mask whatever was there.
    import numpy as np

    from corelib.engine.packing import fill_masks
    from corelib.ops.token_mask import ALL_ALLOWED

    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size, [1])
    grammars = [outputs.state(StructuredOutputsParams(json=SCHEMA)) for _ in range(2)]
    for token in tokenizer.encode('{"na', add_special_tokens=False):
        assert grammars[1].advance(token) is None
    words = mask_words(tokenizer.vocab_size)
    expected = np.zeros((2, words), dtype=np.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill(expected[row].ctypes.data, expected[row].nbytes)
    step: Any = SimpleNamespace(seqs=[SimpleNamespace(grammar=grammars[0]), SimpleNamespace(grammar=None),
                                      SimpleNamespace(grammar=grammars[1])])
    masks = np.zeros((4, words), dtype=np.int32)  # row 1 a plain request's, row 3 the padding's
    fill_masks(step, [0, 2], masks)
    assert (masks[[1, 3]] == ALL_ALLOWED).all()
    assert (masks[[0, 2]] == expected).all() and (expected[0] != expected[1]).any()
    every = np.zeros((2, words), dtype=np.int32)
    fill_masks(SimpleNamespace(seqs=[step.seqs[0], step.seqs[2]]), [0, 1], every)  # type: ignore[arg-type]
    assert (every == expected).all()


def test_a_grammar_hands_out_copies_of_independent_matchers_in_turn(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Copies of one matcher share its lexer, which llguidance lets one mask at a time use: the rows of a step
    # are written in parallel only when their matchers come from different ones.
    import llguidance
    import numpy as np

    from corelib.engine.packing import fill_masks

    made = []
    original = llguidance.LLMatcher

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(*args, **kwargs)

    counting.grammar_from_json_schema = original.grammar_from_json_schema  # type: ignore[attr-defined]
    counting.validate_grammar_with_warnings = original.validate_grammar_with_warnings  # type: ignore[attr-defined]

    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size, [1])
    outputs.templates_per_grammar = 3
    params = StructuredOutputsParams(json=SCHEMA)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    states = [outputs.state(params) for _ in range(7)]
    assert len(made) == 3 and outputs.templates(params) == 3
    assert len({id(state.matcher) for state in states}) == 7  # each request's own copy
    words = mask_words(tokenizer.vocab_size)
    masks = np.zeros((7, words), dtype=np.int32)
    fill_masks(step_of(states), list(range(7)), masks)
    assert (masks == masks[0]).all()  # the same grammar whichever matcher a copy came from


@pytest.mark.slow
def test_every_output_parses_and_matches_its_schema(engine: Engine) -> None:
    plain = engine.generate(["Hello, my name is"] * 2, [SamplingParams(max_tokens=20, seed=i) for i in range(2)])
    outputs = engine.generate(["Hello, my name is"] * 12 + ["The capital of France is"] * 2 + ["Hello"] * 2,
                              schema_requests(12) + [SamplingParams(max_tokens=10, seed=9)] * 2
                              + [SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                                                structured_outputs={"json_object": True}) for i in range(2)])
    for output in outputs[:12]:
        assert output.outputs[0].finish_reason == "stop", output
        check_schema(output.outputs[0].text)
    for output in outputs[14:]:
        assert output.outputs[0].finish_reason == "stop", output
        assert isinstance(json.loads(output.outputs[0].text), dict)
    # The random model alone writes no JSON, and plain requests beside structured ones are unmasked.
    assert not any(o.outputs[0].text.startswith("{") for o in plain)
    assert [len(o.outputs[0].token_ids) for o in outputs[12:14]] == [10, 10]


@pytest.mark.slow
def test_async_handoff_on_equals_off(engine: Engine, model_dir: Path) -> None:
    prompts = ["Hello, my name is"] * 6
    ran_ahead = engine.generate(prompts, schema_requests(6))
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=off", "engine.max_num_seqs=8",
                                f"model.path={model_dir}"]) as sync:
        synchronous = sync.generate(prompts, schema_requests(6))
    assert [o.outputs[0].token_ids for o in ran_ahead] == [o.outputs[0].token_ids for o in synchronous]


STRUCTURED_REASON = "a request in the batch has structured output (its grammar needs each token before the next mask)"
CHAOS = ["backend.emulator.chaos=0.3", "backend.emulator.chaos_max_ms=0.3"]


def mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    """Structured rows (greedy and sampled) beside plain ones, prompts of several lengths: steps with chunks and
    decode steps, each holding structured rows."""
    prompts = ["Hello, my name is", "The capital of France is a city that " * 3, "Hi", "A list: " * 5] * 3
    params = [*schema_requests(8), *[SamplingParams(max_tokens=12, seed=i, temperature=0.7 * (i % 2),
                                                    ignore_eos=True) for i in range(4)]]
    return prompts, params


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["decode-graphs", "two-ahead", "mixed-graphs", "prompt-logprobs", "mask-thread",
                                   "masks-on-the-loop"])
def test_structured_steps_run_ahead_and_give_the_synchronous_tokens(model_dir: Path, shape: str) -> None:
    """structured_overlap under chaos: each step is queued before its grammar mask and sampled once the mask is
    written, and the tokens are those of the synchronous path (which waits for each token before the next mask).
    Writing the mask before the previous step's tokens were taken by the grammars breaks the equality (or the
    grammar refuses a token); queuing a step while another owes its mask is refused by the runner. The masks are
    computed on the mask thread while the next step is packed, or on the loop's thread (both set apart here; the
    other shapes take the machine's default)."""
    prompts, params = mixed_requests()
    if shape == "prompt-logprobs":  # steps with prompt logprobs run eagerly, forward and sampling alike
        params = [dataclasses.replace(p, prompt_logprobs=2) if i % 3 == 0 else p for i, p in enumerate(params)]
    common = [f"model.path={model_dir}", "engine.max_num_seqs=8", "engine.max_num_batched_tokens=24",
              "engine.chunked_prefill=on", "backend=npu"]
    extra = {"mixed-graphs": ["engine.mixed_graphs=on"], "two-ahead": ["engine.run_ahead=2"]}.get(shape, [])
    with Engine.from_overrides([*common, *CHAOS, *extra, "engine.async_token_handoff=on"]) as ahead:
        if shape in ("mask-thread", "masks-on-the-loop"):  # else the default: by the machine's CPUs
            ahead.core.masks_beside_packing = shape == "mask-thread"
        ran_ahead = ahead.generate(prompts, params)
        summary = ahead.metrics(1.0)
    with Engine.from_overrides([*common, *extra, "engine.async_token_handoff=off"]) as sync:
        synchronous = sync.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ran_ahead] == [o.outputs[0].token_ids for o in synchronous]
    for output in ran_ahead[:8]:
        check_schema(output.outputs[0].text)
    assert summary["steps_async"] == summary["steps"], summary["sync_step_reasons"]
    assert summary["graph_steps"] > 0
    assert summary["eager_steps"] > 0 or shape == "mixed-graphs"  # chunks run eagerly unless they have graphs


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_structured_steps_run_ahead_with_the_synchronous_tokens(model_dir: Path) -> None:
    """The same on CUDA itself, in float32, every graph captured at start: forward-only decode graphs, token-bucket
    forwards, the masks copied behind them on the compute stream."""
    prompts, params = mixed_requests()
    common = ["backend=cuda", "backend.runtime=native", "model.dtype=float32", f"model.path={model_dir}",
              "engine.max_num_seqs=8", "engine.max_num_batched_tokens=24", "engine.chunked_prefill=on",
              "engine.mixed_graphs=on", "engine.graph_capture=upfront"]
    with Engine.from_overrides([*common, "engine.async_token_handoff=on"]) as ahead:
        ran_ahead = ahead.generate(prompts, params)
        summary = ahead.metrics(1.0)
    with Engine.from_overrides([*common, "engine.async_token_handoff=off"]) as sync:
        synchronous = sync.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ran_ahead] == [o.outputs[0].token_ids for o in synchronous]
    for output in ran_ahead[:8]:
        check_schema(output.outputs[0].text)
    assert summary["steps_async"] == summary["steps"] and summary["graph_steps"] > 0


@pytest.mark.slow
def test_where_no_step_replays_a_graph_greedy_rows_are_masked_without_the_sampler(model_dir: Path) -> None:
    """The cpu backend runs every step eagerly: a greedy structured row is masked in its greedy sampling (no sort
    over the vocabulary), and gives the tokens of the npu's run ahead, whose greedy rows take a masked argmax."""
    prompts = ["Hello, my name is", "Hi", "A list: " * 5]
    params = [SamplingParams(max_tokens=80, seed=i, structured_outputs={"json": SCHEMA}) for i in range(3)]
    common = [f"model.path={model_dir}", "engine.max_num_seqs=4"]
    with Engine.from_overrides(["backend=cpu", *common]) as cpu:
        eager = cpu.generate(prompts, params)
        assert not cpu.options.graphs and cpu.core.builder.eager_only
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on", *common]) as npu:
        ran_ahead = npu.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in eager] == [o.outputs[0].token_ids for o in ran_ahead]
    for output in eager:
        check_schema(output.outputs[0].text)


@pytest.mark.slow
def test_with_the_overlap_off_structured_steps_run_synchronously(model_dir: Path) -> None:
    prompts, params = mixed_requests()
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on", "engine.structured_overlap=off",
                                f"model.path={model_dir}", "engine.max_num_seqs=8"]) as engine:
        outputs = engine.generate(prompts[:4], params[:4])
        summary = engine.metrics(1.0)
        plan = engine.plan.decisions["structured_overlap"]
    assert STRUCTURED_REASON in summary["sync_step_reasons"] and not plan.enabled
    for output in outputs:
        check_schema(output.outputs[0].text)


@pytest.mark.slow
def test_a_bad_schema_fails_its_request_alone(engine: Engine) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(((("}}}})
    outputs = engine.generate(["Hello"] * 2, [bad, schema_requests(1)[0]])
    assert outputs[0].outputs[0].finish_reason == "error"
    check_schema(outputs[1].outputs[0].text)


def mask_threads_since(before: set[threading.Thread]) -> list[str]:
    """The mask threads alive now that were not in ``before`` (another engine of the module may hold one)."""
    return [t.name for t in set(threading.enumerate()) - before if t.name.startswith(MaskThread.NAME) and t.is_alive()]


def test_the_mask_thread_runs_a_job_names_itself_when_late_and_stops_on_close() -> None:
    before = set(threading.enumerate())
    thread, release, ran = MaskThread(), threading.Event(), []
    done = thread.start(lambda: ran.append(1), 10.0, "the grammar masks of step 1")
    thread.result(done, 10.0, "the grammar masks of step 1")
    assert ran == [1] and mask_threads_since(before)

    def stuck_job() -> None:
        release.wait(30.0)

    stuck = thread.start(stuck_job, 10.0, "the grammar masks of step 2")
    with pytest.raises(TimeoutError, match=r"^the grammar masks of step 2 were not written within 0.01 s \(thread "
                                           r"corelib-grammar-masks\)$"):
        thread.result(stuck, 0.01, "the grammar masks of step 2")
    with pytest.raises(TimeoutError, match=r"corelib-grammar-masks thread's job did not end within 0\.01 s$"):
        thread.close(0.01)
    release.set()
    stuck.result(10.0)
    idle = MaskThread()
    idle.close(10.0)
    deadline = time.monotonic() + 10.0
    while mask_threads_since(before) and time.monotonic() < deadline:  # the stuck job's thread ends after it
        time.sleep(0.01)
    assert not mask_threads_since(before)


@pytest.mark.slow
def test_the_next_step_is_packed_while_a_steps_masks_are_written(model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop packs the next step while the mask thread writes the masks a step owes, and queues the step's
    sampling only once they are written. The first mask job waits for the next step's packing (which a loop
    writing each step's masks before it packs the next never gets to) and for the loop to wait for it (a loop
    that queued the sampling without waiting would hand over unwritten masks). Closing the engine stops the
    mask thread."""
    from corelib.engine.packing import InputBuilder
    from corelib.engine.step_masks import StepMasks
    from corelib.transport.executor import _InprocFuture

    first_owing: list[int] = []
    packed_next, loop_waits = threading.Event(), threading.Event()
    waited: list[bool] = []
    computing: set[int] = set()  # the arenas whose grammar rows are being computed
    supplied: list[tuple[int, bool]] = []
    fill, compute = InputBuilder.fill, StepMasks.compute
    result, supply_mask = MaskThread.result, _InprocFuture.supply_mask

    def packing(self: InputBuilder, step_id: int, *args: Any) -> Any:
        if first_owing and step_id > first_owing[0]:
            packed_next.set()
        fi = fill(self, step_id, *args)
        if fi.mask_deferred and not first_owing:
            first_owing.append(step_id)
        return fi

    def masking(self: StepMasks) -> None:
        computing.add(self.out.data_ptr())
        if not waited:
            waited.append(packed_next.wait(5.0) and loop_waits.wait(5.0))
        compute(self)
        computing.discard(self.out.data_ptr())

    def waiting(self: MaskThread, *args: Any) -> Any:
        loop_waits.set()
        return result(self, *args)

    def supplying(self: _InprocFuture, masks: torch.Tensor | None) -> None:
        if masks is not None:  # None: a step cancelled at close samples anything, its tokens dropped
            supplied.append((self._handle.step_id, masks.data_ptr() not in computing))
        supply_mask(self, masks)

    monkeypatch.setattr(InputBuilder, "fill", packing)
    monkeypatch.setattr(StepMasks, "compute", masking)
    monkeypatch.setattr(MaskThread, "result", waiting)
    monkeypatch.setattr(_InprocFuture, "supply_mask", supplying)
    before = set(threading.enumerate())
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=8",
                                f"model.path={model_dir}", *CHAOS]) as engine:
        engine.core.masks_beside_packing = True  # the default only where the machine has more than two CPUs
        outputs = engine.generate(["Hello, my name is"] * 4, schema_requests(4))
        assert engine.core.metrics.num_steps > 3 and mask_threads_since(before)
    assert waited == [True]
    assert len(supplied) > 3 and all(done for _, done in supplied), supplied
    for output in outputs:
        check_schema(output.outputs[0].text)
    assert not mask_threads_since(before)


@pytest.mark.slow
def test_a_grammar_failing_on_the_mask_thread_ends_its_request_alone(model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask job that fails names its request, which ends with the error; the step's other rows get their masks
    (written again on the loop's thread) and the engine goes on. Closing it with steps in flight, each owing its
    masks, stops the mask thread too."""
    from corelib.engine import step_masks, structured

    def failing(states: Any, *args: Any) -> None:
        raise RuntimeError("the pool failed")

    broken: list[structured.GrammarState] = []
    fill = structured.GrammarState.fill

    def row_by_row(self: structured.GrammarState, address: int, nbytes: int) -> None:
        if self in broken:
            raise RuntimeError("this grammar broke")
        fill(self, address, nbytes)

    monkeypatch.setattr(step_masks, "compute_rows", failing)
    monkeypatch.setattr(structured.GrammarState, "fill", row_by_row)
    before = set(threading.enumerate())
    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=8",
                                f"model.path={model_dir}"]) as engine:
        assert engine.plan.decisions["structured_overlap"].enabled
        engine.core.masks_beside_packing = True
        ids = [engine.add_request("Hello, my name is", params) for params in schema_requests(3)]
        engine.step()
        grammar = next(seq.grammar for seq in engine.scheduler.running if seq.request_id == ids[0])
        assert grammar is not None
        broken.append(grammar)
        outputs: dict[str, RequestOutput] = {}
        while engine.has_unfinished:
            outputs.update((output.request_id, output) for output in engine.step())
        assert outputs[ids[0]].outputs[0].finish_reason == "error"
        assert "this grammar broke" in (outputs[ids[0]].outputs[0].error or "")
        for request_id in ids[1:]:
            check_schema(outputs[request_id].outputs[0].text)
        for _ in range(3):  # steps in flight when it closes
            engine.add_request("Hello, my name is", schema_requests(1)[0])
        engine.step()
        engine.step()
    assert not mask_threads_since(before)


def test_a_model_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_directory(None)
    with pytest.raises(StructuredOutputsError, match="tokenizer"):
        StructuredOutputs(tokenizer, 512, [1]).state(StructuredOutputsParams(json_object=True))


def test_the_slices_corelib_gives_llguidance_change_no_mask(model_dir: Path) -> None:
    # The slices only spare walking tokens the grammar allows whole: inside a bounded string, at its bound and past
    # it, every mask equals the one llguidance computes with no slices at all.
    import numpy as np

    from corelib.engine.structured import grammar_of, llguidance_module, parser_limits

    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    params = StructuredOutputsParams(json=SCHEMA)
    ours = StructuredOutputs(tokenizer, tokenizer.vocab_size, [1]).state(params)
    ll = llguidance_module()
    walked = ll.LLMatcher(ll.LLTokenizer(tokenizer.path.read_text(), n_vocab=tokenizer.vocab_size, eos_token=[1],
                                         slices=[]), grammar_of(params), limits=parser_limits())
    words = mask_words(tokenizer.vocab_size)
    tokens = tokenizer.encode('{"name":"the do","age":7,"role":"user","ok":true}', add_special_tokens=False)
    assert any(len(tokenizer.decode([token])) > 1 for token in tokens), "the vocabulary has words, not bytes only"
    for token in tokens:
        mine, theirs = np.zeros(words, np.int32), np.zeros(words, np.int32)
        ours.fill(mine.ctypes.data, mine.nbytes)
        walked.unsafe_compute_mask_ptr(theirs.ctypes.data, theirs.nbytes)
        assert (mine == theirs).all()
        assert ours.advance(token) in (None, "done") and walked.consume_token(token)
