"""``python -m MODULE ARGS`` for the tests, forked from an interpreter that has already imported torch.

A CLI test pays for a fresh interpreter, and two of a CLI run's three seconds are ``import
torch``. Each test process (each xdist worker) starts one server that imports torch and nothing
of corelib, then forks it once per run: the child takes the run's working directory,
environment, ``sys.path`` (``PYTHONPATH`` as a fresh interpreter would place it) and ``argv``,
runs the module as ``__main__`` with its stdout and stderr on files, and exits as the
interpreter would (non-daemon threads joined, atexit run, the exit code of ``SystemExit``, 1
and a traceback for an uncaught exception, death by SIGINT for an uncaught KeyboardInterrupt).
corelib itself is imported in the child, fresh, every time.

Only ``-m`` is forked (``eligible``); anything else runs in a fresh interpreter. Variables read
before a module's ``main`` (``PYTHON*`` but ``PYTHONPATH`` / ``PYTHONUNBUFFERED``, torch's and
the thread libraries') are the server's: a run whose values of them differ is forked from a
server started with its values. ``CORELIB_TEST_FRESH=1`` sends every run to a fresh interpreter.

Forking after ``import torch`` is what torch's own DataLoader does on Linux by default; the
server runs no torch op, so no thread pool exists to be lost in the fork.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

FRESH_VARIABLE = "CORELIB_TEST_FRESH"
# Read while the interpreter or torch starts, before a module's main runs: a run whose value of
# one of these differs from the server's needs a fresh interpreter.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC", "CUDA", "NVIDIA")
EMULATED = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
START_TIMEOUT_S = 120.0

SERVER = r"""
import os, pickle, runpy, signal, struct, sys, threading, traceback, atexit, importlib
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # what corelib sets before it imports torch
import torch  # noqa: F401  the point of the server
base_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
site_path = sys.path[1 + len(base_pythonpath):]  # after sys.path[0] and the server's own PYTHONPATH
inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
sys.stdout = sys.stderr  # nothing but the protocol on the pipe

def send(message):
    data = pickle.dumps(message)
    outbox.write(struct.pack("<I", len(data)) + data)
    outbox.flush()

def child(request):
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *pythonpath, *site_path]
    importlib.invalidate_caches()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    module, args = request["module"], request["args"]
    sys.argv = ["-m", *args]  # as python -m leaves it; runpy puts the module's file first
    code = 0
    try:
        runpy._run_module_as_main(module, alter_argv=True)  # what python -m calls
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # the interpreter's report: its hook, this frame left out
        error.with_traceback(error.__traceback__.tb_next if error.__traceback__ else None)
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)

send({"ready": os.getpid()})
while True:
    header = inbox.read(4)
    if len(header) < 4:
        break
    request = pickle.loads(inbox.read(struct.unpack("<I", header)[0]))
    pid = os.fork()
    if pid == 0:
        inbox.close()
        try:
            child(request)
        finally:
            os._exit(70)
    send({"pid": pid})
    _, status = os.waitpid(pid, 0)
    send({"status": os.waitstatus_to_exitcode(status)})
"""


class _Server:
    """One forking server per test process, started at its first run, stopped at exit."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.lock = threading.Lock()
        self.outputs = Path(tempfile.mkdtemp(prefix="corelib-forkrun-"))
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            cwd=self.outputs,  # an empty directory: nothing there can shadow what torch imports
        )
        self.receive(START_TIMEOUT_S, "to import torch")

    def receive(self, timeout: float, what: str) -> dict[str, int]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        header = self._read(4, deadline, what)
        message = pickle.loads(self._read(struct.unpack("<I", header)[0], deadline, what))
        assert isinstance(message, dict)
        return message

    def _read(self, size: int, deadline: float, what: str) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        chunks = b""
        while len(chunks) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the test's forking server (pid {self.process.pid}) did not answer {what}")
            chunk = os.read(fd, size - len(chunks))
            if not chunk:
                raise RuntimeError(f"the test's forking server (pid {self.process.pid}) exited "
                                   f"(code {self.process.poll()}) {what}")
            chunks += chunk
        return chunks

    def run(self, module: str, args: Sequence[str], cwd: Path, env: Mapping[str, str],
            stdout: Path, stderr: Path, timeout: float) -> int:
        assert self.process.stdin is not None
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": dict(env),
                   "stdout": str(stdout), "stderr": str(stderr)}
        data = pickle.dumps(request)
        self.process.stdin.write(struct.pack("<I", len(data)) + data)
        self.process.stdin.flush()
        pid = self.receive(30.0, "with the pid of its fork")["pid"]
        try:
            return self.receive(timeout, f"with the exit of python -m {module} (pid {pid})")["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self.receive(30.0, f"after python -m {module} (pid {pid}) was killed")
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout) from None

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
        shutil.rmtree(self.outputs, ignore_errors=True)


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}  # by the startup variables they were started with
_guard = threading.Lock()
MAX_SERVERS = 3


def _startup_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in EMULATED))


def _stop_all() -> None:
    for server in _servers.values():
        server.stop()
    _servers.clear()


def eligible(args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``python ARGS`` in ``env`` can be forked.

    ``-m MODULE`` only, forking not turned off, and torch's autoload of vendor extensions off (as
    corelib sets it): with it on, what ``import torch`` does depends on the run's ``PYTHONPATH``.
    """
    return (os.environ.get(FRESH_VARIABLE) != "1" and len(args) >= 2 and args[0] == "-m"
            and env.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "0") == "0")


def server_for(env: Mapping[str, str]) -> _Server:
    """The server started with ``env``'s startup variables: a run with others gets its own."""
    key = _startup_key(env)
    with _guard:
        server = _servers.get(key)
        if server is None:
            if not _servers:
                atexit.register(_stop_all)
            if len(_servers) >= MAX_SERVERS:
                _servers.pop(next(iter(_servers))).stop()
            server = _servers[key] = _Server({k: v for k, v in env.items() if k != "PYTHONPATH"})
        return server


def run_module(args: Sequence[str], cwd: Path, env: Mapping[str, str],
               timeout: float) -> tuple[int, str, str]:
    """``python -m MODULE ...`` forked; (exit code, stdout, stderr) as ``subprocess.run`` gives them."""
    server = server_for(env)
    with server.lock:
        stamp = time.monotonic_ns()
        stdout, stderr = server.outputs / f"{stamp}.out", server.outputs / f"{stamp}.err"
        code = server.run(args[1], args[2:], cwd, env, stdout, stderr, timeout)
    try:
        return code, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    finally:
        stdout.unlink(missing_ok=True)
        stderr.unlink(missing_ok=True)
