"""The engine on a thread of its own, and the bridge between it and the server's event loop.

An Engine is driven by one thread. Here that thread builds it, takes commands from a queue
(submit, abort, snapshot, drain, stop), steps it while anything is live, and hands each
request's new tokens to the asyncio queue of the HTTP request that asked for it, one
``call_soon_threadsafe`` per event loop and step. The event loop never touches the engine.

Every request the bridge accepts ends with exactly one finished :class:`Update`: the engine's
output, or the reason the server ended it (shutdown, or an engine failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.errors import one_line
from corelib.server.events import SHUTDOWN, EngineInfo, Overloaded, Snapshot, TooLarge, Unavailable, Update
from corelib.server.metrics import ServerMetrics

log = logging.getLogger("corelib.server")

@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[Update]
    final_only: bool  # a whole response: only the last update is sent
    started: bool = False
    ended_by: str | None = None


@dataclass(frozen=True)
class _Submit:
    requests: list[tuple[str, list[int], SamplingParams]]
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[Update]
    final_only: bool


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Drain:
    deadline: float


@dataclass(frozen=True)
class _Snapshot:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Snapshot]


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Drain | _Snapshot | _Stop


def _kv_blocks(engine: Engine) -> tuple[int, int]:
    """(free, usable) KV blocks; block 0 is the null block and never handed out."""
    blocks = engine.scheduler.blocks
    return blocks.num_free_blocks, blocks.num_blocks - 1


@dataclass
class _Counters:
    live: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class EngineBridge:
    """Owns the engine thread. Build with a factory; the engine is built on that thread."""

    def __init__(self, build: Callable[[], Engine], max_waiting: int, metrics: ServerMetrics) -> None:
        self._build = build
        self._max_waiting = max_waiting
        self._metrics = metrics
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._counters = _Counters()
        self._capacity = 0
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._close_error: BaseException | None = None
        self._info: EngineInfo | None = None
        self._thread = threading.Thread(target=self._run, name="corelib-engine", daemon=True)
        self.draining = False
        self.failure: str | None = None
        # Engine-thread state.
        self._live: dict[str, _Live] = {}
        self._deadline: float | None = None
        self._stopping = False
        self._started_at = time.perf_counter()

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> EngineInfo:
        """Start the thread and wait until the engine is built; its build error is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        assert self._info is not None, "the engine thread reported ready without the engine's facts"
        return self._info

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine is not built yet: call start() first")
        return self._info

    def submit(
        self, requests: Sequence[tuple[list[int], SamplingParams]], sink: asyncio.Queue[Update],
        final_only: bool = False,
    ) -> list[str]:
        """Queue requests whose updates (only the last ones, with ``final_only``) go to ``sink``; all or none."""
        if self.failure is not None:
            raise Unavailable(f"the engine stopped after an error: {self.failure}")
        if self.draining or self._stopping:
            raise Unavailable(SHUTDOWN)
        if len(requests) > self._capacity:
            raise TooLarge(f"the request asks for {len(requests)} choices (prompts x n); this server holds at most "
                           f"{self._capacity} requests at once (engine.max_num_seqs + server.max_waiting)")
        with self._counters.lock:
            if self._counters.live + len(requests) > self._capacity:
                raise Overloaded(
                    f"the server has {self._counters.live} requests in progress and queues at most {self._capacity} "
                    f"(engine.max_num_seqs + server.max_waiting); retry later"
                )
            self._counters.live += len(requests)
        ids = [f"req-{next(self._ids)}" for _ in requests]
        batch = [(request_id, prompt, sampling) for request_id, (prompt, sampling) in zip(ids, requests, strict=True)]
        self._inbox.put(_Submit(batch, asyncio.get_running_loop(), sink, final_only))
        return ids

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests at the next step (a client went away); finished ones are left alone."""
        if request_ids:
            self._inbox.put(_Abort(list(request_ids)))

    async def snapshot(self, timeout_s: float = 10.0) -> Snapshot:
        """The engine's state, read on its thread between two steps."""
        if not self._thread.is_alive():
            raise Unavailable("the engine has stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Snapshot] = loop.create_future()
        self._inbox.put(_Snapshot(loop, future))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise Unavailable(f"the engine thread did not answer within {timeout_s:.0f} s") from None

    @property
    def num_live(self) -> int:
        with self._counters.lock:
            return self._counters.live

    def drain(self, grace_s: float) -> None:
        """Refuse new requests; those running may finish for ``grace_s`` seconds, then they are aborted.

        Safe to call from a signal handler: it only sets a flag and queues a command.
        """
        self.draining = True
        self._inbox.put(_Drain(time.monotonic() + grace_s))

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, close the engine and join its thread. Safe to call twice."""
        if not self._thread.is_alive():
            self._raise_close_error()
            return
        self._inbox.put(_Stop())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout_s:.0f} s")
        self._raise_close_error()

    def _raise_close_error(self) -> None:
        error, self._close_error = self._close_error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            engine = self._build()
        except BaseException as error:  # noqa: BLE001 - raised again by start(), on the caller's thread
            self._start_error = error
            self._ready.set()
            return
        try:
            cfg = engine.startup.config
            self._info = EngineInfo(engine.tokenizer, engine.vocab_size, cfg.model.max_model_len,
                                    cfg.engine.max_num_seqs, cfg.model.name, cfg.model.path, tuple(engine.notices))
            self._capacity = cfg.engine.max_num_seqs + self._max_waiting
            self._metrics.kv_blocks_total.set(_kv_blocks(engine)[1])
        except BaseException as error:  # noqa: BLE001 - raised again by start(), on the caller's thread
            self._start_error = error
            engine.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(engine)
        except BaseException as error:  # a bug here must not leave clients waiting forever
            log.exception("the engine thread failed")
            self.failure = one_line(error)
            self._end_all(self.failure, server_error=True)
        finally:
            try:
                engine.close()
            except Exception as error:  # noqa: BLE001 - raised again by close(), on the caller's thread
                self._close_error = error

    def _serve(self, engine: Engine) -> None:
        tracker = DeltaTracker(engine.tokenizer)
        while True:
            for command in self._commands(block=not self._live):
                self._handle(engine, command)
            if self._stopping and not self._live:
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._deadline = None
                self._abort_all(engine, SHUTDOWN)
            if self._live:
                deltas = self._step(engine, tracker)
                self._deliver(deltas)
                if not deltas and self._live and not engine.has_unfinished:
                    # Cannot happen while the engine keeps its word; never spin on requests it forgot.
                    self._end_all("the engine lost track of the request", server_error=True)

    def _commands(self, block: bool) -> list[_Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, engine: Engine, command: _Command) -> None:
        if isinstance(command, _Submit):
            for request_id, _, _ in command.requests:
                self._live[request_id] = _Live(command.loop, command.sink, command.final_only)
            if self.failure is not None or self._stopping:
                why = self.failure or SHUTDOWN
                self._end([request_id for request_id, _, _ in command.requests], why, self.failure is not None)
                return
            for request_id, prompt, sampling in command.requests:
                try:
                    engine.add_request(prompt, sampling, request_id)
                except Exception as error:  # noqa: BLE001 - the engine refuses every request (closed or failed)
                    self._end([request_id], one_line(error), server_error=True)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if request_id in self._live and self.failure is None:
                    engine.abort(request_id)
        elif isinstance(command, _Drain):
            self._deadline = min(command.deadline, self._deadline or command.deadline)  # the earliest ask wins
        elif isinstance(command, _Snapshot):
            snapshot = self._snapshot(engine)
            command.loop.call_soon_threadsafe(_resolve, command.future, snapshot)
        else:
            self._stopping = True
            self._abort_all(engine, SHUTDOWN)

    def _snapshot(self, engine: Engine) -> Snapshot:
        free, total = _kv_blocks(engine)
        running = sum(1 for live in self._live.values() if live.started)
        occupancy = engine.metrics(time.perf_counter() - self._started_at).get("occupancy")
        return Snapshot(len(self._live) - running, running, free, total,
                        occupancy if isinstance(occupancy, float) else None, self.failure)

    def _abort_all(self, engine: Engine, why: str) -> None:
        if self.failure is not None:
            return  # the engine already ended every request with its error
        for request_id, live in self._live.items():
            live.ended_by = why
            engine.abort(request_id)

    def _step(self, engine: Engine, tracker: DeltaTracker) -> list[TokenDelta]:
        if self.failure is not None:
            self._end_all(self.failure, server_error=True)
            return []
        try:
            return engine.step_tokens(tracker)
        except Exception as error:  # noqa: BLE001 - any step failure ends the engine; clients hear why
            # The engine ended every request it held with an error; hand those back, then refuse more.
            self.failure = one_line(error)
            log.error("the engine stopped: %s", self.failure)
            try:
                return engine.step_tokens(tracker)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                return []

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Update], Update]]] = defaultdict(list)
        finished = 0
        for delta in deltas:
            live = self._live.get(delta.request_id)
            if live is None:
                continue  # not ours (cannot happen) or already ended
            if delta.token_ids:
                live.started = True
            output = delta.output
            ended_by = live.ended_by if output is not None and output.finish_reason == "abort" else None
            if output is None and self.failure is None:
                if not live.final_only:
                    update = Update(delta.request_id, delta.token_ids, delta.text)
                    batches[live.loop].append((live.sink, update))
                continue
            if output is not None:
                self._metrics.finished(output)
            server_error = output is None or (self.failure is not None and output.finish_reason == "error")
            if server_error:
                ended_by = f"the engine stopped after an error: {self.failure}"
            update = Update(delta.request_id, delta.token_ids, delta.text, output, ended_by, server_error)
            batches[live.loop].append((live.sink, update))
            del self._live[delta.request_id]
            finished += 1
        self._release(finished)
        self._send(batches)
        if self.failure is not None and self._live:
            self._end_all(f"the engine stopped after an error: {self.failure}", server_error=True)

    def _end(self, request_ids: list[str], why: str, server_error: bool) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Update], Update]]] = defaultdict(list)
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is not None:
                batches[live.loop].append((live.sink, Update(request_id, [], "", None, why, server_error)))
        self._release(sum(len(b) for b in batches.values()))
        self._send(batches)

    def _end_all(self, why: str, server_error: bool) -> None:
        self._end(list(self._live), why, server_error)

    def _release(self, count: int) -> None:
        if count:
            with self._counters.lock:
                self._counters.live -= count

    @staticmethod
    def _send(batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Update], Update]]]) -> None:
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody is left to read these
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Update], Update]]) -> None:
    for sink, update in items:
        sink.put_nowait(update)


def _resolve(future: asyncio.Future[Snapshot], snapshot: Snapshot) -> None:
    if not future.done():
        future.set_result(snapshot)
