"""Chat templates rendered in worker processes, with a time, memory and length budget the OS enforces.

A checkpoint's template is code from elsewhere. Jinja's sandbox keeps it from reaching Python,
not from looping: two nested ``range(100000)`` loops, a recursive macro, ``'x' * 10**12`` or
``tojson(indent=10**9)`` each fit the sandbox's rules, and on the event loop they would hold
every other request, ``/health`` and SIGTERM with it. So the server renders in a few processes of
their own (``python -I``, an address-space limit), one conversation at a time each; a render
that outlasts its time is ended by killing its process, which is started again. Whatever goes
wrong (the template's own refusal, its failure, the budget) is a :class:`ChatTemplateError`,
which the routes answer with a 400.

The pool probes the template once at start with a one-message conversation, so a template
that cannot render at all is a one-line error before the server accepts anyone.

The protocol is one JSON line each way: the settings first (answered ``{"ready": true}``), then
``{"messages": [...], "kwargs": {...}}`` answered ``{"text": ...}`` or ``{"error": ...}``. A request's
``chat_template_kwargs`` travel as ``kwargs``, into the same worker under the same budget: a
variable cannot buy a template more time, memory or text than a message can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from corelib.errors import ConfigError, one_line
from corelib.server.chat import ChatTemplate, ChatTemplateError, check_template_kwargs
from corelib.support.faults import maybe_fail
from corelib.trust.isolation import worker_command, worker_environment

MODULE = "corelib.server.render"
NUM_WORKERS = 2  # renders at once; a hostile template holds one until its time is up
RENDER_TIMEOUT_S = 5.0  # one render; real templates take about a millisecond
MEMORY_BYTES = 1 << 30  # a worker's address space: Python, Jinja and the conversation, with room to spare
STARTUP_TIMEOUT_S = 120.0  # a worker's start (an interpreter importing Jinja on a busy machine)
PROBE = ({"role": "user", "content": "Hello"},)

Messages = Sequence[Mapping[str, object]]


class _Worker:
    """One render process and its pipes."""

    def __init__(self, template: ChatTemplate, max_chars: int) -> None:
        self.process = subprocess.Popen(worker_command(MODULE), env=worker_environment(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buffer = b""
        settings = {"source": template.source, "origin": template.origin, "bos_token": template.bos_token,
                    "eos_token": template.eos_token, "max_chars": max_chars, "memory_bytes": MEMORY_BYTES}
        try:
            reply = self.ask(settings, time.monotonic() + STARTUP_TIMEOUT_S, what="start")
        except BaseException:
            self.kill()
            raise
        if reply.get("ready") is not True:
            self.kill()
            raise ConfigError(str(reply.get("error")))

    def ask(self, message: Mapping[str, object], deadline: float, what: str = "render",
            timeout_s: float = RENDER_TIMEOUT_S) -> dict[str, object]:
        """Send one line, wait (until ``deadline``) for one line back; ChatTemplateError if none comes."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None, "Popen was asked for both pipes"
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
            stdin.flush()
        except OSError:
            raise ChatTemplateError(f"the chat template's renderer ended ({self._ended()})") from None
        if what == "render":
            maybe_fail("render")  # a test holds a render here, in progress, to see the server answer meanwhile
        fd = stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise ChatTemplateError(f"the chat template did not {what} within {timeout_s:g} s"
                                        if what == "render" else f"the chat template's renderer did not {what}")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise ChatTemplateError(f"the chat template's renderer ended ({self._ended()}), most likely out of "
                                        f"its {MEMORY_BYTES >> 20} MiB")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        assert isinstance(reply, dict), "the renderer answers JSON objects"
        return reply

    def _ended(self) -> str:
        code = self.process.poll()
        return "still running" if code is None else f"exit code {code}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


class TemplateRenderer:
    """Renders a chat template off the event loop: in worker processes for a checkpoint's template, in a thread
    for corelib's own fallback."""

    def __init__(self, template: ChatTemplate, max_chars: int, workers: int = NUM_WORKERS,
                 timeout_s: float | None = None, setting: str = "server.chat_template") -> None:
        self.template = template
        self.max_chars = max_chars
        self.setting = setting  # how the caller passes another template (setting=FILE), named when one is refused
        self.timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
        self._isolated = not template.is_fallback
        self._size = workers if self._isolated else 1
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._threads = ThreadPoolExecutor(self._size, thread_name_prefix="corelib-render")
        self._closed = False

    def start(self) -> None:
        """Start the workers and render the probe: a template that cannot render one message is a ConfigError."""
        fix = f"fix it or pass another with {self.setting}=FILE"
        try:
            for _ in range(self._size if self._isolated else 0):
                self._workers.append(_Worker(self.template, self.max_chars))
            for worker in self._workers:
                self._idle.put(worker)
            self.render_blocking(PROBE)
        except ChatTemplateError as error:
            self.close()
            raise ConfigError(f"the chat template from {self.template.origin} fails on a one-message conversation "
                              f"({error}); {fix}") from None
        except ConfigError as error:  # it does not compile, or exploded as it did, in the worker
            self.close()
            raise ConfigError(f"{error}; {fix}") from None
        except BaseException:
            self.close()
            raise

    async def render(self, messages: Messages, kwargs: Mapping[str, object] | None = None) -> str:
        """The prompt text of ``messages``; ChatTemplateError for anything that goes wrong, the budget included.

        ``kwargs``: more template variables (:meth:`ChatTemplate.render`), checked first (ValueError).
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.render_blocking, messages, kwargs)

    def render_blocking(self, messages: Messages, kwargs: Mapping[str, object] | None = None) -> str:
        kwargs = check_template_kwargs(kwargs or {})
        if not self._isolated:
            return self.template.render(messages, self.max_chars, kwargs)
        worker = self._idle.get()  # a busy pool frees a worker within timeout_s at the latest
        if worker is None or self._closed:
            self._idle.put(None)
            raise ChatTemplateError("the server is shutting down")
        deadline = time.monotonic() + self.timeout_s
        try:
            if not worker.alive:
                worker = self._replace(worker)
            reply = worker.ask({"messages": list(messages), "kwargs": dict(kwargs)}, deadline, timeout_s=self.timeout_s)
        except ChatTemplateError:
            if not worker.alive:
                worker = self._replace(worker)
            raise
        finally:
            self._idle.put(worker)
        if "error" in reply:
            raise ChatTemplateError(str(reply["error"]))
        return str(reply["text"])

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        if self._closed:
            return worker  # the server is stopping: no new process
        fresh = _Worker(self.template, self.max_chars)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        self._closed = True
        self._idle.put(None)
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.kill()


# ---------------------------------------------------------------------- the worker's side
def _die_with(parent: int) -> None:
    """End this process the moment the server does, even in the middle of a render that would never end."""
    try:
        watched = os.pidfd_open(parent)
    except OSError:
        return  # the server is gone already: the first read of stdin ends this process

    def watch() -> None:
        select.select([watched], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="corelib-render-watch", daemon=True).start()


def _serve() -> None:
    _die_with(os.getppid())
    settings = json.loads(sys.stdin.buffer.readline())
    limit = int(settings["memory_bytes"])
    with contextlib.suppress(ValueError, OSError):  # a lower hard limit than ours: keep it
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    try:
        template = ChatTemplate(settings["source"], settings["origin"], settings["bos_token"], settings["eos_token"])
    except ConfigError as error:
        out.write(json.dumps({"error": str(error)}) + "\n")
        out.flush()
        return
    max_chars = int(settings["max_chars"])
    try:
        template.compiled()  # here, under the memory limit and the start's time limit
    except ChatTemplateError as error:
        out.write(json.dumps({"error": f"the chat template from {template.origin}: {error}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply: dict[str, object] = {"text": template.render(request["messages"], max_chars, request.get("kwargs"))}
        except (ChatTemplateError, ValueError) as error:
            reply = {"error": str(error)}
        except Exception as error:  # noqa: BLE001 - the server hears every failure as one line
            reply = {"error": f"the chat template failed: {one_line(error)}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
