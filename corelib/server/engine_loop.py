"""The engine's side of the server: take commands, step the engine, send one frame per step.

This loop owns the engine and runs on the one thread that drives it: a thread of the server's
process, or the main thread of an engine process. Between two steps it takes every command
waiting (submit, abort, drain, snapshot, stop); while anything is live it steps, and sends the
step's new tokens of every request in one :class:`~corelib.server.messages.StepFrame`.

Every request it accepts ends with exactly one :class:`~corelib.server.messages.Final`: the
engine's output, or the reason the server ended it (shutdown, or an engine failure).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.errors import one_line
from corelib.server.events import SHUTDOWN, Snapshot
from corelib.server.messages import (
    Abort,
    Ask,
    Command,
    Delta,
    Drain,
    Final,
    Frame,
    LogprobDelta,
    SnapshotFrame,
    StepFrame,
    Submit,
)
from corelib.server.served import ServedEngine

log = logging.getLogger("corelib.server")
IDLE_CHECK_S = 1.0  # with nothing to do, how often the loop asks whether the engine can still run steps


@dataclass
class _Live:
    final_only: bool  # a whole response: only the last update is sent
    started: bool = False
    ended_by: str | None = None


class EngineLoop:
    """Drives one engine for the server until a :class:`~corelib.server.messages.Stop`."""

    def __init__(self, engine: ServedEngine, inbox: queue.SimpleQueue[Command], emit: Callable[[Frame], None]) -> None:
        self._engine = engine
        self._inbox = inbox
        self._emit = emit
        self._live: dict[str, _Live] = {}
        self._deadline: float | None = None
        self._stopping = False
        self.failure: str | None = None
        self._failure_sent = False

    def run(self) -> None:
        """Serve commands until told to stop and nothing is live; a bug here still ends every request."""
        try:
            self._serve()
        except BaseException as error:
            log.exception("the engine loop failed")
            self.failure = one_line(error)
            self._end_all(f"the engine stopped after an error: {self.failure}", server_error=True)
            raise

    def _serve(self) -> None:
        tracker = DeltaTracker(self._engine.tokenizer)
        while True:
            # Told to stop and nothing left: return before waiting for a command that may never come.
            if self._stopping and not self._live:
                return
            for command in self._commands(block=not self._live):
                self._handle(command)
            if self._stopping and not self._live:
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._deadline = None
                self._abort_all(SHUTDOWN)
            if self._live:
                deltas = self._step(tracker)
                self._deliver(deltas)
                if not deltas and self._live and not self._engine.has_unfinished:
                    # Cannot happen while the engine keeps its word; never spin on requests it forgot.
                    self._end_all("the engine lost track of the request", server_error=True)

    def _commands(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        while block and not commands:
            try:
                commands.append(self._inbox.get(timeout=IDLE_CHECK_S))
            except queue.Empty:
                self._check_idle_engine()
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _check_idle_engine(self) -> None:
        """With nothing to do: a worker or node that went away fails the engine now, as a failed step would.

        Run every IDLE_CHECK_S while idle, and before an idle engine answers a snapshot or takes
        requests, so that neither /health nor a new request learns of a dead worker only by failing.
        """
        if self.failure is not None:
            return
        try:
            self._engine.check_alive()
        except Exception as error:  # noqa: BLE001 - the server and /health hear why; new requests get 503
            self.failure = one_line(error)
            log.error("the engine stopped: %s", self.failure)
            self._send([], [])

    def _handle(self, command: Command) -> None:
        engine = self._engine
        if isinstance(command, Submit):
            if not self._live:
                self._check_idle_engine()  # a worker gone while nothing ran: refuse these, rather than fail them
            ids = [request_id for request_id, _, _ in command.requests]
            for request_id in ids:
                self._live[request_id] = _Live(command.final_only)
            if self.failure is not None or self._stopping:
                self._end(ids, self._refusal(), server_error=False)  # never started: unavailable, not failed
                return
            for group in _by_prompt(command.requests):
                group_ids = [request_id for request_id, _, _ in group]
                try:
                    if len(group) == 1:
                        engine.add_request(group[0][1], group[0][2], group_ids[0])
                    else:  # n choices of one prompt: prefilled once, its blocks shared
                        engine.add_request_group(group[0][1], [sampling for _, _, sampling in group], group_ids)
                except Exception as error:  # noqa: BLE001 - the engine refuses every request (closed or failed)
                    self._end(group_ids, one_line(error), server_error=True)
        elif isinstance(command, Abort):
            for request_id in command.request_ids:
                if request_id in self._live and self.failure is None:
                    engine.abort(request_id)
        elif isinstance(command, Drain):
            self._deadline = min(command.deadline, self._deadline or command.deadline)  # the earliest ask wins
        elif isinstance(command, Ask):
            if not self._live:
                self._check_idle_engine()  # /health asks an idle engine: what it says must be true now
            self._emit(SnapshotFrame(command.token, self._snapshot()))
        else:
            self._stopping = True
            self._abort_all(command.why)

    def _refusal(self) -> str:
        return f"the engine stopped after an error: {self.failure}" if self.failure is not None else SHUTDOWN

    def _snapshot(self) -> Snapshot:
        free, total = self._engine.kv_blocks()
        running = sum(1 for live in self._live.values() if live.started)
        return Snapshot(len(self._live) - running, running, free, total, self._engine.occupancy(), self.failure,
                        self._engine.prefix_cache())

    def _abort_all(self, why: str) -> None:
        if self.failure is not None:
            return  # the engine already ended every request with its error
        for request_id, live in self._live.items():
            live.ended_by = why
            self._engine.abort(request_id)

    def _step(self, tracker: DeltaTracker) -> list[TokenDelta]:
        if self.failure is not None:
            self._end_all(self._refusal(), server_error=True)
            return []
        try:
            return self._engine.step_tokens(tracker)
        except Exception as error:  # noqa: BLE001 - any step failure ends the engine; clients hear why
            # The engine ended every request it held with an error; hand those back, then refuse more.
            self.failure = one_line(error)
            log.error("the engine stopped: %s", self.failure)
            try:
                return self._engine.step_tokens(tracker)
            except Exception:  # noqa: BLE001 - the first error is the one reported
                return []

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        running: list[Delta | LogprobDelta] = []
        finals: list[Final] = []
        for delta in deltas:
            live = self._live.get(delta.request_id)
            if live is None:
                continue  # not ours (cannot happen) or already ended
            if delta.token_ids:
                live.started = True
            output = delta.output
            if output is None and self.failure is None:
                if not live.final_only:
                    if delta.logprobs is None:
                        running.append((delta.request_id, delta.token_ids, delta.text))
                    else:
                        running.append(LogprobDelta(delta.request_id, delta.token_ids, delta.text, delta.logprobs))
                continue
            ended_by = live.ended_by if output is not None and output.finish_reason == "abort" else None
            server_error = output is None or (self.failure is not None and output.finish_reason == "error")
            if server_error:
                ended_by = self._refusal()
                # One that had no token yet never started: refused (503, to retry elsewhere), not failed. A
                # worker may die in the moment between the idle engine's look and its first step.
                server_error = live.started or bool(delta.token_ids)
            finals.append(Final(delta.request_id, delta.token_ids, delta.text, output, ended_by, server_error))
            del self._live[delta.request_id]
        self._send(running, finals)
        if self.failure is not None and self._live:
            self._end_all(self._refusal(), server_error=True)

    def _end(self, request_ids: list[str], why: str, server_error: bool) -> None:
        finals = [Final(request_id, [], "", None, why, server_error) for request_id in request_ids
                  if self._live.pop(request_id, None) is not None]
        self._send([], finals)

    def _end_all(self, why: str, server_error: bool) -> None:
        self._end(list(self._live), why, server_error)

    def _send(self, running: list[Delta | LogprobDelta], finals: list[Final]) -> None:
        news = self.failure is not None and not self._failure_sent
        if running or finals or news:
            self._failure_sent = self._failure_sent or news
            self._emit(StepFrame(running, finals, self.failure))


Submitted = tuple[str, list[int], SamplingParams]  # request id, prompt, sampling


def _by_prompt(requests: list[Submitted]) -> list[list[Submitted]]:
    """Runs of consecutive requests with the same prompt (the choices of one prompt), in order."""
    groups: list[list[Submitted]] = []
    for request in requests:
        if groups and groups[-1][0][1] == request[1]:
            groups[-1].append(request)
        else:
            groups.append([request])
    return groups
