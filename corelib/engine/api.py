"""The public engine: build once from a config, generate, close.

    with Engine.from_overrides(["backend=npu", "engine.async_token_handoff=on"]) as engine:
        outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))

With a checkpoint that has a tokenizer, prompts may be text and outputs carry text:

    with Engine.from_overrides(["model.path=/models/qwen3-0.6b"]) as engine:
        engine.add_request("The capital of France is", SamplingParams(max_tokens=32))
        for delta in engine.stream_tokens():
            print(delta.text, end="", flush=True)

Long: this is the engine's one public face (requests in, outputs out, streaming, stats, shutdown,
one driving thread); its parts live beside it (:mod:`corelib.step.build` assembles the loop,
:mod:`corelib.engine.requests` checks requests, :mod:`corelib.engine.outputs` holds results).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from omegaconf import DictConfig

from corelib.config.features import Plan
from corelib.engine.build import build_engine_core
from corelib.engine.core import EngineStats
from corelib.engine.outputs import RequestOutput, output_of
from corelib.engine.requests import Prompt, check_request, cut_at_stop, token_ids
from corelib.engine.sequence import FinishReason, SamplingParams
from corelib.engine.sequence import Sequence as Seq
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.engine.structured import StructuredOutputs
from corelib.errors import ConcurrentUse, ConfigError, RequestError
from corelib.observe.trace import NULL_TRACER, TimelineTracer, Tracer
from corelib.platform.device import Device, MemoryStats
from corelib.sampling_params import choices
from corelib.startup.start import Startup
from corelib.step.build import ModelFactory, load_model
from corelib.step.layout import EngineLayout
from corelib.step.runner import GraphSummary, ModelRunner
from corelib.support.heap import freeze_startup_heap, thaw_startup_heap
from corelib.support.text import Tokenizer
from corelib.transport.executor import InprocExecutor
from corelib.transport.factory import EXECUTORS


class Engine:
    """A decode engine on one device (or one set of SHM workers). It owns threads and device memory until closed.

    An Engine is driven by one thread at a time: a call from a second thread while another is
    inside the engine raises :class:`~corelib.errors.ConcurrentUse` (the server runs the
    engine on a thread of its own and hands it requests). Callbacks may re-enter it.
    """

    def __init__(self, startup: Startup, model_factory: ModelFactory = load_model) -> None:
        started = time.perf_counter()
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
        self._last_id = ""  # the id the latest _sequence gave out
        self.layout = EngineLayout.of(cfg)
        self.tokenizer = Tokenizer.from_directory(model_cfg.path)  # before the weights: a bad file fails fast
        self.vocab_size = model_cfg.vocab_size
        # Structured output's grammars and the tokenizer as they see it, made on the first such request.
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size,
                                            [model_cfg.eos_token_id, *model_cfg.extra_eos_token_ids])
        executor = EXECUTORS[self.options.transport](startup, self.options, self.layout, model_factory)
        self.layout = executor.layout or self.layout  # its KV pool sized from memory once the model was loaded
        self.notices: list[str] = list(executor.notices)  # things the user should hear about, said once at start
        try:
            self.core = build_engine_core(cfg, self.options, self.layout, executor, self.tokenizer,
                                          startup.spec.capabilities.graph_param_update)
        except BaseException:
            executor.close(engine_cfg.timeout_s)
            raise
        self.scheduler = self.core.scheduler
        # What startup built lives as long as the engine: a full collection would walk it (some 200 k objects)
        # between two steps, a pause of tens of milliseconds for every running request. vLLM's engine core does
        # the same once it is up; close gives it back.
        freeze_startup_heap()
        #: how long building the engine took (weights, KV cache, graphs), and the graphs captured in process
        self.startup_s = time.perf_counter() - started
        self.graphs: GraphSummary | None = (executor.steps.runner.graph_summary()
                                            if isinstance(executor, InprocExecutor) else None)
        self.notices.append(f"engine ready in {self.startup_s:.1f} s"
                            + (f": {self.graphs.describe()}" if self.graphs is not None and self.graphs.capture_s
                               else ""))
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
        from corelib.startup.compose import compose_config

        return cls._started(lambda: compose_config(overrides))

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Engine:
        """Build from an already composed config (e.g. inside your own @hydra.main)."""
        return cls._started(lambda: cfg)

    @classmethod
    def _started(cls, config: Callable[[], DictConfig]) -> Engine:
        from corelib.plugins import PluginRegistry
        from corelib.startup.compose import prepare_config_store
        from corelib.startup.start import start

        registry = PluginRegistry()
        prepare_config_store(registry)  # the plugins' config groups, before the config is composed
        return cls(start(config(), registry))

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
            return token_ids(prompt)
        if self.tokenizer is None:
            model = self.startup.config.model
            where = (f"model.path={model.path} has no tokenizer.json" if model.path else
                     f"model={model.name} is a preset with random weights and no tokenizer")
            raise ConfigError(f"a text prompt needs a tokenizer, but {where}: pass token ids, or use a checkpoint "
                              "(a directory or a hub id such as Qwen/Qwen3-0.6B)")
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
            self.core.wake_if_idle()
            seq = self._sequence(prompt, sampling or SamplingParams(), request_id, multimodal)
            if seq is not None:
                self.core.add(seq)
            return self._last_id

    def add_requests_sharing_prompt(
        self,
        prompt: Prompt,
        samplings: Sequence[SamplingParams],
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Queue one request per ``samplings`` entry on the same prompt (an API's ``n``), sharing its KV blocks.

        The first request prefills the prompt; the others take its blocks once it has (each computes
        only the prompt's last token, then samples on its own; a block one of them writes into is
        copied first). Where the model keeps a recurrent state they run as separate requests. Each
        request finishes, streams and aborts on its own; invalid ones finish at once with 'error'.
        """
        with self._driving("add_requests_sharing_prompt"):
            self._check_open()
            self.core.wake_if_idle()
            ids = list(request_ids) if request_ids is not None else [None] * len(samplings)
            if len(ids) != len(samplings):
                raise RequestError(f"{len(samplings)} sampling settings but {len(ids)} request ids")
            if len({i for i in ids if i is not None}) != sum(1 for i in ids if i is not None):
                raise RequestError("request_ids: give each request its own id")
            text = prompt if isinstance(prompt, str) else None
            encoded: Prompt = prompt
            if isinstance(prompt, str):
                with contextlib.suppress(RequestError):  # else each request finishes with the error at once
                    encoded = self.encode(prompt)
            group, out = [], []
            for sampling, request_id in zip(samplings, ids, strict=True):
                seq = self._sequence(encoded, sampling, request_id, False, text)
                out.append(self._last_id)
                if seq is not None:
                    group.append(seq)
            if group:
                self.core.add_group(group)
            return out

    def _sequence(self, prompt: Prompt, sampling: SamplingParams, request_id: str | None,
                  multimodal: bool, text: str | None = None) -> Seq | None:
        """A checked sequence for the scheduler, or None when it was finished at once with the error."""
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise RequestError(f"request_id={request_id!r}: must be a non-empty str")
        if request_id is not None and request_id in self._live_ids:
            raise RequestError(f"request_id={request_id!r} is already in use by an unfinished request; "
                               "give each request its own id")
        problem: RequestError | None = None
        try:
            prompt_token_ids = self.encode(prompt)
            if sampling.n != 1:
                raise RequestError(f"n={sampling.n}: a request is one sample; Engine.generate and LLM.generate "
                                   "run n of them")
        except RequestError as error:
            prompt_token_ids, problem = [], error
        number = next(self._ids)
        if request_id is None:
            request_id = str(number)
            while request_id in self._live_ids:
                request_id = f"{number}-{next(self._ids)}"
        seq = Seq(number, request_id, prompt_token_ids, sampling, multimodal=multimodal,
                  arrival_time=time.perf_counter(), prompt=prompt if isinstance(prompt, str) else text)
        self._live_ids.add(request_id)
        self._last_id = request_id
        try:
            if problem is not None:
                raise problem
            config = self.startup.config
            check_request(seq, config.model, self.vocab_size, config.engine.refuse_overlong)
            if sampling.structured_outputs is not None:
                seq.grammar = self.structured.state(sampling.structured_outputs)
        except RequestError as error:
            self.core.finish(seq, FinishReason.error, str(error))
            return None
        return seq

    def abort(self, request_id: str) -> bool:
        """End a request now (finish_reason 'abort'): its KV blocks go back, tokens in flight are dropped.

        Returns False when no unfinished request has that id. The aborted request's output is
        returned by the next ``step``/``take_finished`` like any other.
        """
        with self._driving("abort"):
            self._check_open()
            for seq in self.scheduler.unfinished():
                if seq.request_id == request_id:
                    self.core.finish(seq, FinishReason.abort)
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
        """Every output not returned yet: those kept for their caller, then those the core finished since."""
        taken = list(self._backlog.values())
        self._backlog.clear()
        for _, output in taken:
            self._live_ids.discard(output.request_id)
        return taken + self._take_new()

    def _take_new(self) -> list[tuple[Seq, RequestOutput]]:
        """The outputs the core finished since the last look (not those kept for their caller)."""
        taken = [(seq, output_of(seq, self._final_text(seq), self._token_text)) for seq in self.core.take_finished()]
        for _, output in taken:
            self._live_ids.discard(output.request_id)
        return taken

    @functools.cached_property
    def _token_text(self) -> Callable[[int], str] | None:
        """One token's text for a logprob's ``decoded_token`` (special tokens kept, as vLLM shows them), cached:
        the same few thousand tokens come back in every request's alternatives."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        return functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode_special([token]))

    def _final_text(self, seq: Seq) -> str | None:
        if self.tokenizer is None:
            return seq.text or None
        if not seq.sampling.detokenize:
            return ""
        return cut_at_stop(self.tokenizer.decode(seq.output_token_ids, seq.sampling.skip_special_tokens), seq)

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
        """Run every prompt to completion; outputs come back in prompt order, one per prompt.

        ``SamplingParams(n=...)`` runs that many samples of a prompt, gathered in its output's
        ``outputs``. Requests added by others (``add_request``, a callback re-entering
        ``generate``) that finish meanwhile are kept for them, never returned here or dropped.
        """
        with self._driving("generate"):
            params = list(sampling) if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(prompts)
            if len(params) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling settings")
            flags = list(multimodal) if multimodal is not None else [False] * len(prompts)
            samples = [choices(p) for p in params]  # n single-sample requests per prompt
            ids = [self.add_requests_sharing_prompt(prompt, chosen) if len(chosen) > 1 and not flag
                   else [self.add_request(prompt, choice, multimodal=flag) for choice in chosen]
                   for prompt, chosen, flag in zip(prompts, samples, flags, strict=True)]
            results = self._run_until_done([i for group in ids for i in group], on_finish)
            return [results[group[0]] if len(group) == 1 else RequestOutput.grouped([results[i] for i in group])
                    for group in ids]

    def _run_until_done(
        self, ids: list[str], on_finish: Callable[[RequestOutput], None] | None
    ) -> dict[str, RequestOutput]:
        wanted, results = set(ids), dict[str, RequestOutput]()
        while len(results) < len(wanted):
            new: list[RequestOutput] = []
            if self._backlog:  # outputs kept back for their caller; most steps have none to look through
                new = [self._backlog.pop(i)[1] for i in wanted - results.keys() if i in self._backlog]
            if not new:
                # Only what finished since: the backlog holds others' outputs, which would be found again
                # on every look, and the loop would never step.
                taken = self._take_new()
                if not taken:
                    if not self.has_unfinished:
                        raise RuntimeError(f"the engine has nothing left to run, but requests "
                                           f"{sorted(wanted - results.keys())} never finished")
                    self._advance()
                    taken = self._take_new()
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
        return results

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

    def stats(self, since_step: int | None = None) -> EngineStats:
        """Requests running and waiting, KV blocks, steps so far; with ``since_step`` (an earlier
        ``stats().num_steps``) also each step since and the device's busy and idle time over them."""
        return self.core.stats(since_step)

    def metrics(self, wall_s: float) -> dict[str, Any]:
        """Run-level figures over every request added so far (percentiles: the latest engine.metrics_window)."""
        return self.core.metrics_summary(wall_s)

    # ------------------------------------------------------------------ shutdown
    def _fail(self, error: BaseException) -> None:
        """A step failed: end every request and stop; close() still releases everything."""
        self._failure = error
        self.core.finish_all(FinishReason.error, "the engine stopped after a device error")

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
                try:
                    self.core.close()  # stops the workers, releases the runner and the device
                finally:
                    thaw_startup_heap()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
