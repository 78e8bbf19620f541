"""The engine in a process of its own, so that streaming never competes with it for one GIL.

The server starts ``python -I`` on this module (:func:`corelib.trust.isolation.worker_command`, the
controlled environment of :func:`~corelib.trust.isolation.worker_environment`) with an
:class:`EngineProcessArgs` on stdin. Two pipes join them: commands to the engine, and from it
one frame per step holding every request's new tokens (:mod:`corelib.server.messages`).

Who stops whom, so that no engine process is ever left behind:

- the server sends :class:`~corelib.server.messages.Stop`, waits ``stop_timeout_s`` for the
  process to end, then kills it;
- the engine process ignores SIGINT and SIGTERM: Ctrl-C and a service manager signal the
  whole group, and the server decides how running requests end (the grace period);
- when the server process goes away (crash, SIGKILL), the engine process reads end-of-file
  on its command pipe: it aborts what runs, closes the engine and exits, and exits anyway
  ``stop_timeout_s`` later should closing hang;
- when the engine process goes away, the server reads end-of-file on the frame pipe and ends
  every open request with an error that names the process and how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import fcntl
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corelib.errors import CorelibError, one_line
from corelib.server.commands import CommandWriter
from corelib.server.events import EngineFacts
from corelib.server.messages import Command, Decoder, Failed, Frame, Ready, Stop, encode
from corelib.support.text import Tokenizer
from corelib.trust.isolation import worker_command, worker_environment

log = logging.getLogger("corelib.server")
MODULE = "corelib.server.engine_process"
PIPE_BYTES = 1 << 20  # a step's frame is a few kB; room for many keeps the engine from ever waiting on a write
READ_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031  # Linux fcntl


@dataclass(frozen=True)
class EngineProcessArgs:
    recipe: object  # corelib.server.served.EngineRecipe; typed loosely so this module imports no engine code
    command_fd: int  # read commands here
    frame_fd: int  # write frames here
    server_pid: int
    stop_timeout_s: float
    write_timeout_s: float  # the longest the server may leave a frame unread


def _grow_pipe(fd: int) -> None:
    with contextlib.suppress(OSError):  # a smaller pipe works too; the kernel may refuse more than its limit
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)


def _exit_status(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


# ---------------------------------------------------------------------- the server's side
class EngineProcess:
    """The server's handle on its engine process: start, commands in, frames out, stop."""

    def __init__(self, recipe: object, startup_timeout_s: float, stop_timeout_s: float,
                 write_timeout_s: float = 60.0) -> None:
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._decoder = Decoder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._build_failed = False
        command_read, self._command_fd = os.pipe()
        self._frame_fd, frame_write = os.pipe()
        for fd in (command_read, frame_write):
            _grow_pipe(fd)
        try:
            args = pickle.dumps(EngineProcessArgs(recipe, command_read, frame_write, os.getpid(), stop_timeout_s,
                                                  write_timeout_s))
            self.process = subprocess.Popen(worker_command(MODULE), env=worker_environment(), stdin=subprocess.PIPE,
                                            pass_fds=(command_read, frame_write))
        except BaseException:
            for fd in (command_read, frame_write, self._command_fd, self._frame_fd):
                os.close(fd)
            raise
        os.close(command_read)  # so that the end of either process shows as end-of-file to the other
        os.close(frame_write)
        assert self.process.stdin is not None, "Popen was asked for a stdin pipe"
        with contextlib.suppress(BrokenPipeError):  # it died at once: start() says how
            self.process.stdin.write(args)
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        self._commands = CommandWriter(self._command_fd)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def name(self) -> str:
        return f"the engine process (pid {self.process.pid})"

    def start(self) -> EngineFacts:
        """Wait (bounded) until the engine is built; its build error is raised here, the process stopped."""
        try:
            return self._await_ready()
        except BaseException:
            # A build that failed ends its process on its own; one still building (Ctrl-C, a
            # timeout) would only read a Stop once built, and has nothing to drain: kill it.
            self._abandon(wait_s=10.0 if self._build_failed else 0.0)
            raise

    def _abandon(self, wait_s: float) -> None:
        self._stopped = True
        self._commands.end()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        self._commands.close(5.0)
        with contextlib.suppress(OSError):
            os.close(self._frame_fd)

    def _await_ready(self) -> EngineFacts:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CorelibError(f"{self.name} did not finish building the engine within "
                                   f"{self._startup_timeout_s:g} s")
            readable, _, _ = select.select([self._frame_fd], [], [], min(left, 1.0))
            if not readable:
                continue
            data = os.read(self._frame_fd, READ_BYTES)
            if not data:
                raise CorelibError(f"{self.name} {self._ended()} before the engine was built; its output above "
                                   "says why")
            for message in self._decoder.feed(data):
                if isinstance(message, Failed):
                    self._build_failed = True
                    raise message.error
                if isinstance(message, Ready):
                    return message.facts
                raise CorelibError(f"{self.name} sent a {type(message).__name__} before saying it was ready")

    def _ended(self, wait_s: float = 5.0) -> str:
        """How the process ended; it closed its pipe, so it is gone or about to be."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(wait_s)
        code = self.process.poll()
        return "is still running but closed its pipe" if code is None else _exit_status(code)

    def why_gone(self) -> str | None:
        """None while the process runs (or was stopped on purpose); else how it ended."""
        if self._stopped:
            return None
        code = self.process.poll()
        return None if code is None else f"{self.name} {_exit_status(code)}"

    # ------------------------------------------------------------------ commands
    def send(self, command: Command) -> None:
        """Send a command, at once where the pipe takes it (see :class:`CommandWriter`). Never blocks; safe from any
        thread and from a signal handler."""
        self._commands.send(command)

    # ------------------------------------------------------------------ frames
    def attach(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[Frame], None],
               on_gone: Callable[[str], None]) -> None:
        """Read frames on ``loop`` from now on; ``on_gone`` once the process ended without being stopped."""
        self._loop = loop
        os.set_blocking(self._frame_fd, False)

        def readable() -> None:
            try:
                data = os.read(self._frame_fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""  # the same as end-of-file: nothing more will come
            if not data:
                loop.remove_reader(self._frame_fd)
                if not self._stopped:
                    on_gone(f"{self.name} {self._ended(wait_s=1.0)}")
                return
            for message in self._decoder.feed(data):
                on_frame(message)  # type: ignore[arg-type]

        loop.add_reader(self._frame_fd, readable)

    # ------------------------------------------------------------------ stopping
    def stop(self, why: str = "the server is shutting down") -> None:
        """Ask the engine to stop and wait for it (bounded), else kill it. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        running = self.process.poll() is None
        self.send(Stop(why))
        self._commands.end()
        waited = self._stop_timeout_s
        try:
            self.process.wait(waited)
        except subprocess.TimeoutExpired:
            self.process.kill()  # it ignores SIGTERM (see the module doc)
            self.process.wait()
            raise CorelibError(f"{self.name} did not stop within {waited:g} s of being asked; it was killed") from None
        finally:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):  # the loop may be another thread's, or stopping
                    self._loop.remove_reader(self._frame_fd)
            self._close_pipes()
        code = self.process.returncode
        if running and code != 0:
            raise CorelibError(f"{self.name} {_exit_status(code)} while stopping; its output above says why")

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()


def load_tokenizer(facts: EngineFacts) -> Tokenizer | None:
    """The tokenizer the engine decodes with, loaded again on the server's side to encode prompts."""
    return Tokenizer(Path(facts.tokenizer_path)) if facts.tokenizer_path else None


# ---------------------------------------------------------------------- the engine's side
class _Output:
    """Frames to the server; a server that stops reading for ``timeout_s`` is taken for gone."""

    def __init__(self, fd: int, timeout_s: float, inbox: queue.SimpleQueue[Command]) -> None:
        self._fd = fd
        self._timeout_s = timeout_s
        self._inbox = inbox
        self.gone: str | None = None
        os.set_blocking(fd, False)

    def send(self, frame: Frame) -> None:
        if self.gone is not None:
            return
        data = memoryview(encode(frame))
        deadline = time.monotonic() + self._timeout_s
        try:
            while data:
                try:
                    data = data[os.write(self._fd, data):]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._lost(f"the server did not read the engine's frames for {self._timeout_s:g} s")
                        return
                    select.select([], [self._fd], [], left)
        except OSError as error:
            self._lost(f"the server closed its end of the frame pipe ({error.strerror})")

    def _lost(self, why: str) -> None:
        self.gone = why
        log.warning("%s; stopping the engine", why)
        self._inbox.put(Stop(why))


def _read_commands(fd: int, inbox: queue.SimpleQueue[Command], stop_timeout_s: float) -> None:
    """Commands from the server until end-of-file; then stop, and make sure this process ends."""
    decoder = Decoder()
    while True:
        try:
            data = os.read(fd, READ_BYTES)
        except OSError:
            data = b""
        if not data:
            break
        for command in decoder.feed(data):
            inbox.put(command)  # type: ignore[arg-type]
    inbox.put(Stop("the server process is gone"))
    time.sleep(stop_timeout_s)
    print(f"corelib: engine process: the server process is gone and closing the engine took over "
          f"{stop_timeout_s:g} s; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (a ConfigError keeps its meaning and exit code), else its line."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - anything that does not round-trip is sent as text
        return CorelibError(one_line(error))
    return error


def main() -> None:
    """Entry point: ``python -I`` on this module with pickled EngineProcessArgs on stdin."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the server decides when the engine stops (see the module doc)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    logging.basicConfig(level=logging.WARNING, format="corelib: engine process: %(message)s")
    args: EngineProcessArgs = pickle.loads(sys.stdin.buffer.read())
    from corelib.server.engine_loop import EngineLoop
    from corelib.server.served import EngineRecipe

    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    output = _Output(args.frame_fd, args.write_timeout_s, inbox)
    reader = threading.Thread(target=_read_commands, args=(args.command_fd, inbox, args.stop_timeout_s),
                              name="corelib-commands", daemon=True)
    reader.start()
    recipe = args.recipe
    assert isinstance(recipe, EngineRecipe), f"expected an EngineRecipe, got {type(recipe).__name__}"
    try:
        engine = recipe.build()
        facts = engine.facts()
    except BaseException as error:  # noqa: BLE001 - raised again in the server, as the server's own error
        output.send(Failed(_portable(error)))
        sys.exit(1)
    output.send(Ready(facts))
    status = 0
    try:
        EngineLoop(engine, inbox, output.send).run()
    except BaseException:  # noqa: BLE001 - logged by the loop; the clients were told
        status = 1
    finally:
        try:
            engine.close()
        except Exception as error:  # noqa: BLE001 - the server sees the exit code; this line says why
            log.error("closing the engine failed: %s", one_line(error))
            status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
