"""The public engine: build once from a config, generate, close.

    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on"]) as engine:
        outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))

With a checkpoint that has a tokenizer, prompts may be text and outputs carry text:

    with Engine.from_overrides(["model.path=/models/qwen3-0.6b"]) as engine:
        engine.add_request("The capital of France is", SamplingParams(max_tokens=32))
        for delta in engine.stream_tokens():
            print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from omegaconf import DictConfig

from corelib.device import Device, MemoryStats
from corelib.engine.block_manager import BlockManager
from corelib.engine.core import EngineCore
from corelib.engine.outputs import RequestOutput, output_of
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import Scheduler, SchedulerLimits
from corelib.engine.sequence import FinishReason, SamplingParams
from corelib.engine.sequence import Sequence as Seq
from corelib.engine.stops import StopChecker
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.errors import ConcurrentUse, ConfigError, RequestError
from corelib.features import Plan
from corelib.observe.trace import NULL_TRACER, TimelineTracer, Tracer
from corelib.startup import Startup
from corelib.step.build import ModelFactory, load_model
from corelib.step.layout import EngineLayout
from corelib.step.pipeline import StepPipeline
from corelib.step.runner import ModelRunner
from corelib.text import Tokenizer
from corelib.transport.executor import InprocExecutor
from corelib.transport.factory import EXECUTORS

log = logging.getLogger("corelib.engine")


Prompt = str | Sequence[int]  # text needs the checkpoint's tokenizer


def _token_ids(prompt: object) -> list[int]:
    """A prompt of token ids as plain ints (numpy and 0-d tensor integers too); a RequestError names a bad one."""
    if isinstance(prompt, (bytes, bytearray, memoryview, Mapping, set, frozenset)):
        raise RequestError(f"the prompt is {type(prompt).__name__}; pass token ids (a list of int) or text (str)")
    if not isinstance(prompt, Iterable):
        raise RequestError(f"the prompt is {type(prompt).__name__}; pass token ids (a list of int) or text")
    ids = []
    for position, token in enumerate(prompt):
        try:
            ids.append(operator.index(token))
        except TypeError:
            raise RequestError(f"prompt token {token!r} at position {position} is not an integer token id") from None
    return ids


def _cut_at_stop(text: str, seq: Seq) -> str:
    """A request stopped by a stop string returns the text before it."""
    if seq.finish_reason is not FinishReason.stop or not seq.sampling.stop_strings:
        return text
    cuts = [i for i in (text.find(s) for s in seq.sampling.stop_strings) if i >= 0]
    return text[: min(cuts)] if cuts else text


class Engine:
    """A decode engine on one device (or one set of SHM workers). It owns threads and device memory until closed.

    An Engine is driven by one thread at a time: a call from a second thread while another is
    inside the engine raises :class:`~corelib.errors.ConcurrentUse` (the server runs the
    engine on a thread of its own and hands it requests). Callbacks may re-enter it.
    """

    def __init__(self, startup: Startup, model_factory: ModelFactory = load_model) -> None:
        self.startup = startup
        self.plan: Plan = startup.plan
        cfg = startup.config
        engine_cfg, model_cfg = cfg.engine, cfg.model
        self.options = startup.options
        self._ids = itertools.count()
        self._closed = False
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        self._owner: str | None = None
        self._backlog: dict[str, tuple[Seq, RequestOutput]] = {}  # finished, not yet returned to their caller
        self._live_ids: set[str] = set()
        self.layout = EngineLayout.of(cfg)
        self.tokenizer = Tokenizer.from_directory(model_cfg.path)  # before the weights: a bad file fails fast
        self.vocab_size = model_cfg.vocab_size
        layout = self.layout
        self.builder = InputBuilder(layout.rows, layout.max_blocks, layout.block_size, layout.pad_slot)
        self.buckets = self.layout.buckets(self.options, startup.spec.capabilities.graph_param_update)
        eos = frozenset({model_cfg.eos_token_id, *model_cfg.extra_eos_token_ids})
        self.scheduler = Scheduler(
            SchedulerLimits(self.layout.rows, engine_cfg.max_num_batched_tokens, model_cfg.max_model_len),
            BlockManager(self.layout.num_blocks, self.layout.block_size),
            num_slots=self.layout.rows,
            stops=StopChecker(model_cfg.max_model_len, eos, self.tokenizer.decode if self.tokenizer else None),
        )
        executor = EXECUTORS[self.options.transport](startup, self.options, self.layout, model_factory)
        self.notices: list[str] = list(executor.notices)  # things the user should hear about, said once at start
        self.core = EngineCore(
            self.scheduler, self.builder, self.buckets, executor, StepPipeline(self.options.pipeline_depth),
            self.options.step_check, engine_cfg.timeout_s, engine_cfg.metrics_window,
        )
        self.tracer: Tracer = NULL_TRACER
        if engine_cfg.trace:
            # Device spans come from the events of an in-process runner; over SHM only host spans.
            local = executor.steps.handoff if isinstance(executor, InprocExecutor) else None
            self.tracer = TimelineTracer.for_handoff(local) if local is not None else TimelineTracer()
            self.core.attach_tracer(self.tracer)

    @property
    def async_handoff(self) -> bool:
        return self.options.async_handoff

    @property
    def materialization(self) -> str:
        return self.options.materialization

    @property
    def local_runner(self) -> ModelRunner:
        """The in-process runner (benchmarks look at its graphs); with engine.transport=shm the workers own theirs."""
        executor = self.core.executor
        if not isinstance(executor, InprocExecutor):
            raise RuntimeError("engine.transport=shm: the model runs in the worker processes")
        return executor.steps.runner

    @property
    def local_device(self) -> Device:
        """The in-process device; with engine.transport=shm the workers own theirs."""
        executor = self.core.executor
        if not isinstance(executor, InprocExecutor):
            raise RuntimeError("engine.transport=shm: the device belongs to the worker processes")
        return executor.device

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_overrides(cls, overrides: Sequence[str] = ()) -> Engine:
        """Compose corelib's config with Hydra-style overrides and build an engine."""
        from corelib.compose import compose_config, prepare_config_store
        from corelib.plugins import PluginRegistry
        from corelib.startup import start

        registry = PluginRegistry()
        prepare_config_store(registry)
        return cls(start(compose_config(overrides), registry))

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Engine:
        """Build from an already composed config (e.g. inside your own @hydra.main)."""
        from corelib.compose import prepare_config_store
        from corelib.plugins import PluginRegistry
        from corelib.startup import start

        registry = PluginRegistry()
        prepare_config_store(registry)
        return cls(start(cfg, registry))

    # ------------------------------------------------------------------ one driving thread
    @contextmanager
    def _driving(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUse(
                f"Engine.{what} was called from thread {threading.current_thread().name!r} while thread "
                f"{self._owner!r} is inside this engine; an Engine is driven by one thread at a time "
                "(run it on one thread and hand it requests, as `corelib serve` does)"
            )
        outer = self._owner
        self._owner = threading.current_thread().name
        try:
            yield
        finally:
            self._owner = outer
            self._lock.release()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; text needs the checkpoint's tokenizer."""
        if not isinstance(prompt, str):
            return _token_ids(prompt)
        if self.tokenizer is None:
            path = self.startup.config.model.path
            where = f"model.path={path} has no tokenizer.json" if path else "model.path is not set"
            raise ConfigError(f"a text prompt needs a tokenizer, but {where}; pass token ids instead")
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        multimodal: bool = False,
    ) -> str:
        """Queue a request (token ids, or text). An invalid one is finished at once with finish_reason 'error'.

        ``request_id`` must not name a request that is still unfinished or not yet returned.
        """
        with self._driving("add_request"):
            self._check_open()
            if request_id is not None and (not isinstance(request_id, str) or not request_id):
                raise RequestError(f"request_id={request_id!r}: must be a non-empty str")
            if request_id is not None and request_id in self._live_ids:
                raise RequestError(f"request_id={request_id!r} is already in use by an unfinished request; "
                                   "give each request its own id")
            sampling = sampling or SamplingParams()
            problem: RequestError | None = None
            try:
                prompt_token_ids = self.encode(prompt)
            except RequestError as error:
                prompt_token_ids, problem = [], error
            number = next(self._ids)
            if request_id is None:
                request_id = str(number)
                while request_id in self._live_ids:
                    request_id = f"{number}-{next(self._ids)}"
            seq = Seq(number, request_id, prompt_token_ids, sampling, multimodal=multimodal,
                      arrival_time=time.perf_counter())
            self._live_ids.add(request_id)
            try:
                if problem is not None:
                    raise problem
                self._validate(seq)
            except RequestError as error:
                self.scheduler.finish(seq, FinishReason.error, error=str(error))
                self.core.add_finished(seq)
                return seq.request_id
            self.scheduler.add(seq)
            return seq.request_id

    def _validate(self, seq: Seq) -> None:
        limit = self.startup.config.model.max_model_len
        if not seq.prompt_token_ids:
            raise RequestError("the prompt is empty")
        if len(seq.prompt_token_ids) >= limit:
            raise RequestError(
                f"the prompt has {len(seq.prompt_token_ids)} tokens; model.max_model_len={limit} leaves no room "
                "for output"
            )
        bad = [t for t in seq.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        seq.sampling.validate(self.vocab_size)
        room = limit - len(seq.prompt_token_ids)
        if seq.sampling.max_tokens > room:
            overlong = (f"max_tokens={seq.sampling.max_tokens} with a prompt of {len(seq.prompt_token_ids)} tokens "
                        f"exceeds model.max_model_len={limit}")
            if self.startup.config.engine.refuse_overlong:
                raise RequestError(f"{overlong}; ask for at most {room} tokens (engine.refuse_overlong=true)")
            log.warning("request %s: %s; it ends after at most %d tokens (engine.refuse_overlong=true refuses it "
                        "instead)", seq.request_id, overlong, room)

    def abort(self, request_id: str) -> bool:
        """End a request now (finish_reason 'abort'): its KV blocks go back, tokens in flight are dropped.

        Returns False when no unfinished request has that id. The aborted request's output is
        returned by the next ``step``/``take_finished`` like any other.
        """
        with self._driving("abort"):
            self._check_open()
            for seq in (*self.scheduler.running, *self.scheduler.waiting):
                if seq.request_id == request_id:
                    self.scheduler.finish(seq, FinishReason.abort)
                    self.core.add_finished(seq)
                    return True
            return False

    @property
    def has_unfinished(self) -> bool:
        if self._failure is not None:
            return False  # every request was ended with the error; steps still in flight carry none
        return self.scheduler.has_unfinished or self.core.num_in_flight > 0

    def step(self) -> list[RequestOutput]:
        """Advance the loop once; returns requests that finished meanwhile."""
        with self._driving("step"):
            self._advance()
            return self.take_finished()

    def _advance(self) -> None:
        self._check_open()
        try:
            self.core.iterate()
        except BaseException as error:
            self._fail(error)
            raise

    def take_finished(self) -> list[RequestOutput]:
        """Requests that finished and were not returned yet."""
        return [output for _, output in self._take_finished()]

    def _take_finished(self) -> list[tuple[Seq, RequestOutput]]:
        taken = list(self._backlog.values())
        self._backlog.clear()
        for seq in self.core.take_finished():
            taken.append((seq, output_of(seq, self._final_text(seq))))
        for _, output in taken:
            self._live_ids.discard(output.request_id)
        return taken

    def _final_text(self, seq: Seq) -> str | None:
        if self.tokenizer is None:
            return seq.text or None
        return _cut_at_stop(self.tokenizer.decode(seq.output_token_ids), seq)

    def stream(self) -> Iterator[RequestOutput]:
        """Run until every queued request is done, yielding each as it finishes."""
        yield from self.take_finished()
        while self.has_unfinished:
            yield from self.step()

    def step_tokens(self, tracker: DeltaTracker) -> list[TokenDelta]:
        """Advance the loop once (when anything is unfinished); each request's new tokens and text.

        ``tracker`` (``DeltaTracker(engine.tokenizer)``) remembers what was already reported; a
        request's last delta carries its RequestOutput.
        """
        with self._driving("step_tokens"):
            deltas = tracker.finished(self._take_finished())
            if self.has_unfinished:
                self._advance()
                deltas += tracker.running(self.scheduler.running)
                deltas += tracker.finished(self._take_finished())
            return deltas

    def stream_tokens(self) -> Iterator[TokenDelta]:
        """Run until every queued request is done, yielding each request's new tokens (and text) as they come.

        A request's last delta carries its RequestOutput. Costs nothing when unused: the plain loop
        (``stream``, ``step``) never looks at deltas.
        """
        tracker = DeltaTracker(self.tokenizer)
        yield from self.step_tokens(tracker)
        while self.has_unfinished:
            yield from self.step_tokens(tracker)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        multimodal: Sequence[bool] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Requests added by others (``add_request``, a callback re-entering ``generate``) that finish
        meanwhile are kept for them, never returned here or dropped.
        """
        with self._driving("generate"):
            params = list(sampling) if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(prompts)
            if len(params) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling settings")
            flags = list(multimodal) if multimodal is not None else [False] * len(prompts)
            ids = [self.add_request(prompt, p, multimodal=flag)
                   for prompt, p, flag in zip(prompts, params, flags, strict=True)]
            wanted, results = set(ids), dict[str, RequestOutput]()
            while len(results) < len(wanted):
                new = [self._backlog.pop(i)[1] for i in wanted - results.keys() if i in self._backlog]
                if not new:
                    taken = self._take_finished()
                    if not taken:
                        if not self.has_unfinished:
                            raise RuntimeError(f"the engine has nothing left to run, but requests "
                                               f"{sorted(wanted - results.keys())} never finished")
                        self._advance()
                        taken = self._take_finished()
                    for seq, output in taken:
                        if output.request_id in wanted and output.request_id not in results:
                            new.append(output)
                        else:
                            self._backlog[output.request_id] = (seq, output)
                            self._live_ids.add(output.request_id)
                for output in new:
                    results[output.request_id] = output
                    self._live_ids.discard(output.request_id)
                if on_finish is not None:
                    for output in new:
                        on_finish(output)
            return [results[i] for i in ids]

    def write_trace(self, path: str | Path) -> Path:
        """Write the timeline of the steps so far as Chrome trace JSON (needs ``engine.trace=true``)."""
        if not isinstance(self.tracer, TimelineTracer):
            raise ConfigError("this engine records no trace: build it with engine.trace=true")
        cfg = self.startup.config
        spec = self.startup.spec
        return self.tracer.write(path, {
            "backend": spec.backend,
            "runtime": spec.runtime.value,
            "model": cfg.model.name,
            "async_token_handoff": self.options.async_handoff,
            "graphs": self.options.graphs,
            "max_num_seqs": cfg.engine.max_num_seqs,
        })

    def memory_stats(self) -> list[MemoryStats]:
        """Bytes each device of the engine holds (device, pinned, registered), one entry per rank.

        With ``engine.transport=shm`` every worker answers between two steps, so the figures
        can be sampled while requests run.
        """
        with self._driving("memory_stats"):
            self._check_open()
            return self.core.memory_stats()

    def check_alive(self) -> None:
        """Raise, ending every request, when the engine's workers (or, across nodes, another node) are gone.

        A step finds that out by itself; an engine with nothing to do calls this now and then
        (the server does, every second), so that it stops without waiting for a request.
        """
        with self._driving("check_alive"):
            self._check_open()
            try:
                self.core.executor.check_alive()
            except BaseException as error:
                self._fail(error)
                raise

    def metrics(self, wall_s: float) -> dict[str, Any]:
        """Run-level figures over every request added so far (percentiles: the latest engine.metrics_window)."""
        return self.core.metrics_summary(wall_s)

    # ------------------------------------------------------------------ shutdown
    def _fail(self, error: BaseException) -> None:
        """A step failed: end every request and stop; close() still releases everything."""
        self._failure = error
        for seq in self.scheduler.abort_all(FinishReason.error, error="the engine stopped after a device error"):
            self.core.add_finished(seq)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self._failure is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._failure!r}") from self._failure

    def close(self) -> None:
        """Drain in-flight steps (bounded), stop threads and workers, release device memory. Safe to call twice."""
        if self._closed:
            return
        with self._driving("close"):
            self._closed = True
            try:
                self.core.cancel_in_flight()
            except Exception:
                if self._failure is None:
                    raise  # a new error; one already reported to the caller is not raised twice
            finally:
                self.core.close()  # stops the workers, releases the runner and the device

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
