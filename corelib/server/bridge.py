"""The server's side of the engine: requests in, each HTTP request's updates out, on the event loop.

The engine loop (:mod:`corelib.server.engine_loop`) runs in an engine process of its own (the
default: it never holds this process's GIL) or on a thread of this process. Either way it
sends one frame per step with every request's new tokens; the frame is taken apart here, on
the event loop, and each HTTP request's :class:`Call` keeps what arrived for it and wakes its
handler once, however many tokens came since the handler last looked. The event loop never
touches the engine.

Every request the bridge accepts ends with exactly one :class:`~corelib.server.messages.Final`:
the engine's output, or the reason the server ended it (shutdown, or an engine failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from corelib.engine.sequence import SamplingParams
from corelib.errors import CorelibError
from corelib.server.engine_loop import EngineLoop
from corelib.server.engine_process import EngineProcess, load_tokenizer
from corelib.server.events import SHUTDOWN, EngineFacts, EngineInfo, Overloaded, Snapshot, TooLarge, Unavailable
from corelib.server.messages import (
    Abort,
    Ask,
    Command,
    Drain,
    Final,
    Frame,
    SnapshotFrame,
    StepFrame,
    Stop,
    Submit,
    Update,
)
from corelib.server.metrics import ServerMetrics
from corelib.server.served import EngineRecipe
from corelib.support.text import Tokenizer

log = logging.getLogger("corelib.server")

Placement = Literal["process", "thread"]
STARTUP_TIMEOUT_S = 1800.0  # building an engine loads weights and captures graphs: minutes for a large model
STOP_TIMEOUT_S = 60.0  # the engine closes: in-flight steps drain, workers stop


class Call:
    """One HTTP request's choices: their updates as they arrive, and aborting those left unfinished."""

    def __init__(self, bridge: EngineBridge, ids: list[str]) -> None:
        self.ids = ids
        self.unfinished = set(ids)
        self.gone = False  # the client hung up
        self._bridge = bridge
        self._pending: list[Update] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, update: Update) -> None:
        self._pending.append(update)
        self._wake()

    def hang_up(self) -> None:
        self.gone = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Update]:
        """Every update since the last take (at least one); [] once the client has hung up."""
        while not self._pending and not self.gone:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.gone:
            return []
        batch, self._pending = self._pending, []
        for update in batch:
            if type(update) is Final:
                self.unfinished.discard(update.request_id)
        return batch

    def abort_unfinished(self) -> None:
        if self.unfinished:
            self._bridge.abort(sorted(self.unfinished))
            self.unfinished = set()


class _Link(Protocol):
    """Where the engine loop runs: an engine process, or a thread of this process."""

    tokenizer: Tokenizer | None  # the engine's, once started

    @property
    def pid(self) -> int | None: ...

    def start(self) -> EngineFacts: ...

    def send(self, command: Command) -> None: ...

    def attach(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[Frame], None],
               on_gone: Callable[[str], None]) -> None: ...

    def why_gone(self) -> str | None: ...

    def stop(self, why: str) -> None: ...


class _EngineThread:
    """The engine loop on a thread of this process: frames reach the event loop by call_soon_threadsafe."""

    pid = None

    def __init__(self, recipe: EngineRecipe, startup_timeout_s: float, stop_timeout_s: float) -> None:
        self._recipe = recipe
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="corelib-engine", daemon=True)
        self._ready = threading.Event()
        self._facts: EngineFacts | None = None
        self._start_error: BaseException | None = None
        self._close_error: BaseException | None = None
        self._lock = threading.Lock()
        self._early: list[Frame] = []  # sent before an event loop was attached
        self._deliver: Callable[[Frame], None] | None = None
        self._stopped = False
        self.tokenizer: Tokenizer | None = None

    def start(self) -> EngineFacts:
        self._thread.start()
        if not self._ready.wait(self._startup_timeout_s):
            self._inbox.put(Stop(SHUTDOWN))  # taken once it is built; the thread is a daemon
            raise CorelibError(f"the engine thread did not finish building the engine within "
                               f"{self._startup_timeout_s:g} s")
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        assert self._facts is not None, "the engine thread reported ready without the engine's facts"
        return self._facts

    def _run(self) -> None:
        try:
            engine = self._recipe.build()
            self.tokenizer = engine.tokenizer
            self._facts = engine.facts()
        except BaseException as error:  # noqa: BLE001 - raised again by start(), on the caller's thread
            self._start_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            EngineLoop(engine, self._inbox, self._emit).run()
        except BaseException:  # noqa: BLE001 - logged by the loop; every request was ended with the error
            pass
        finally:
            try:
                engine.close()
            except Exception as error:  # noqa: BLE001 - raised again by stop(), on the caller's thread
                self._close_error = error

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def _emit(self, frame: Frame) -> None:
        with self._lock:
            deliver = self._deliver
            if deliver is None:
                self._early.append(frame)
                return
        deliver(frame)

    def attach(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[Frame], None],
               on_gone: Callable[[str], None]) -> None:
        def deliver(frame: Frame) -> None:
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody is left to read it
                loop.call_soon_threadsafe(on_frame, frame)

        with self._lock:
            self._deliver = deliver
            early, self._early = self._early, []
        for frame in early:
            deliver(frame)

    def why_gone(self) -> str | None:
        return None if self._stopped or self._thread.is_alive() else "the engine thread has stopped"

    def stop(self, why: str) -> None:
        if not self._stopped and self._thread.is_alive():
            self._inbox.put(Stop(why))
            self._thread.join(self._stop_timeout_s)
            if self._thread.is_alive():
                raise CorelibError(f"the engine thread did not stop within {self._stop_timeout_s:g} s")
        self._stopped = True
        error, self._close_error = self._close_error, None
        if error is not None:
            raise error


class _Process(EngineProcess):
    def __init__(self, recipe: EngineRecipe, startup_timeout_s: float, stop_timeout_s: float) -> None:
        super().__init__(recipe, startup_timeout_s, stop_timeout_s)
        self.tokenizer: Tokenizer | None = None

    def start(self) -> EngineFacts:
        facts = super().start()
        try:
            self.tokenizer = load_tokenizer(facts)
        except BaseException:
            self.stop()
            raise
        return facts


class EngineBridge:
    """The engine as the routes see it; everything here runs on the event loop unless it says otherwise."""

    def __init__(self, recipe: EngineRecipe, max_waiting: int, metrics: ServerMetrics,
                 placement: Placement = "process", startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._recipe = recipe
        self._max_waiting = max_waiting
        self._metrics = metrics
        self._placement = placement
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._link: _Link | None = None
        self._info: EngineInfo | None = None
        self.capacity = 0  # requests held at once: engine.max_num_seqs running, server.max_waiting queued
        self._ids = itertools.count()
        self._asks = itertools.count()
        self._calls: dict[str, Call] = {}
        self._answers: dict[int, asyncio.Future[Snapshot]] = {}
        self._live = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: str | None = None
        self._closed = False
        self.draining = False

    # ------------------------------------------------------------------ start and facts
    def start(self) -> EngineInfo:
        """Build the engine (in its process, or on its thread) and wait, bounded, until it is ready."""
        link: _Link
        if self._placement == "process":
            link = _Process(self._recipe, self._startup_timeout_s, self._stop_timeout_s)
        else:
            link = _EngineThread(self._recipe, self._startup_timeout_s, self._stop_timeout_s)
        self._link = link
        facts = link.start()
        self._info = EngineInfo(link.tokenizer, facts.vocab_size, facts.max_model_len, facts.max_num_seqs,
                                facts.model_name, facts.model_path, facts.notices, facts.sampling_defaults)
        self.capacity = facts.max_num_seqs + self._max_waiting
        self._metrics.kv_blocks_total.set(facts.kv_blocks_total)
        return self._info

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine is not built yet: call start() first")
        return self._info

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id; None when the engine runs on a thread of this process."""
        return self._link.pid if self._link is not None else None

    @property
    def failure(self) -> str | None:
        """Why the engine no longer serves (it failed, or its process ended); None while it does."""
        if self._failure is None and self._link is not None and not self._closed:
            self._failure = self._link.why_gone()
        return self._failure

    @property
    def num_live(self) -> int:
        return self._live

    # ------------------------------------------------------------------ requests
    def submit(self, requests: Sequence[tuple[list[int], SamplingParams]], final_only: bool = False) -> Call:
        """Queue requests (all or none); their updates (only the last ones, with ``final_only``) go to the Call."""
        failure = self.failure
        if failure is not None:
            raise Unavailable(f"the engine stopped after an error: {failure}")
        if self.draining or self._closed:
            raise Unavailable(SHUTDOWN)
        if len(requests) > self.capacity:
            raise TooLarge(f"the request asks for {len(requests)} choices (prompts x n); this server holds at most "
                           f"{self.capacity} requests at once (engine.max_num_seqs + server.max_waiting)")
        if self._live + len(requests) > self.capacity:
            raise Overloaded(
                f"the server has {self._live} requests in progress and queues at most {self.capacity} "
                f"(engine.max_num_seqs + server.max_waiting); retry later"
            )
        link = self._attached()
        ids = [f"req-{next(self._ids)}" for _ in requests]
        call = Call(self, ids)
        for request_id in ids:
            self._calls[request_id] = call
        self._live += len(ids)
        batch = [(request_id, prompt, sampling) for request_id, (prompt, sampling) in zip(ids, requests, strict=True)]
        link.send(Submit(batch, final_only))
        return call

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests at the next step (a client went away); finished ones are left alone."""
        if request_ids and self._link is not None:
            self._link.send(Abort(list(request_ids)))

    async def snapshot(self, timeout_s: float = 10.0) -> Snapshot:
        """The engine's state, read by the engine loop between two steps."""
        failure = self.failure
        if self._link is None or self._closed or (failure is not None and self._link.why_gone() is not None):
            raise Unavailable(f"the engine has stopped: {failure or 'the server is shut down'}")
        link = self._attached()
        token = next(self._asks)
        future = self._answers[token] = asyncio.get_running_loop().create_future()
        link.send(Ask(token))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            where = "the engine thread" if link.pid is None else f"the engine process (pid {link.pid})"
            raise Unavailable(f"{where} did not answer within {timeout_s:g} s") from None
        finally:
            self._answers.pop(token, None)

    def _attached(self) -> _Link:
        if self._link is None:
            raise RuntimeError("the engine is not built yet: call start() first")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("an EngineBridge serves one event loop; this is another")
            self._loop = loop
            self._link.attach(loop, self._on_frame, self._on_gone)
        return self._link

    # ------------------------------------------------------------------ frames, on the event loop
    def _on_frame(self, frame: Frame) -> None:
        if type(frame) is StepFrame:
            calls = self._calls
            for delta in frame.deltas:
                call = calls.get(delta[0])
                if call is not None:
                    call.push(delta)
            for final in frame.finals:
                self._finished(final)
            if frame.failure is not None and self._failure is None:
                self._failure = frame.failure
        elif type(frame) is SnapshotFrame:
            future = self._answers.get(frame.token)
            if future is not None and not future.done():
                future.set_result(frame.snapshot)
        else:
            log.warning("the engine sent a %s frame after it was ready; ignored", type(frame).__name__)

    def _finished(self, final: Final) -> None:
        if final.output is not None:
            self._metrics.finished(final.output)
        call = self._calls.pop(final.request_id, None)
        if call is not None:
            self._live -= 1
            call.push(final)

    def _on_gone(self, why: str) -> None:
        """The engine process ended on its own: every open request ends with why, nothing more is taken."""
        if self._failure is None:
            self._failure = why
        log.error("%s; the requests in progress end with this error", why)
        ended = f"the engine stopped after an error: {why}"
        for request_id in list(self._calls):
            self._finished(Final(request_id, [], "", None, ended, True))
        for future in self._answers.values():
            if not future.done():
                future.set_exception(Unavailable(why))

    # ------------------------------------------------------------------ stopping
    def drain(self, grace_s: float) -> None:
        """Refuse new requests; those running may finish for ``grace_s`` seconds, then they are aborted.

        Safe from any thread and from a signal handler: it sets a flag and queues a command.
        """
        self.draining = True
        if self._link is not None:
            self._link.send(Drain(time.monotonic() + grace_s))

    def close(self) -> None:
        """Abort what is left, close the engine, and end its process or thread (bounded). Safe to call twice."""
        if self._closed or self._link is None:
            return
        self._closed = True
        self._link.stop(SHUTDOWN)
