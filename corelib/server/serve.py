"""Run the server: the engine (in a process of its own), the app, uvicorn, and an orderly stop.

On SIGTERM (or Ctrl-C) the server stops accepting connections and answers new requests on
open ones with 503; running requests may finish for ``server.shutdown_grace_s`` seconds, then
they are aborted and their clients told why; the engine is closed and its process waited for.
``python -m corelib serve`` then exits 143 (SIGTERM) or 130 (Ctrl-C), like every command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from corelib.config.schema import ServerConfig, checked_api_key
from corelib.errors import ConfigError, CorelibError
from corelib.sampling_params import SEED_LIMIT
from corelib.server.app import ServerState, build_app
from corelib.server.bridge import EngineBridge, Placement
from corelib.server.chat import ChatTemplate
from corelib.server.connections import guarded_protocol
from corelib.server.metrics import ServerMetrics
from corelib.server.render import TemplateRenderer
from corelib.server.served import EngineRecipe
from corelib.support.heap import freeze_startup_heap

log = logging.getLogger("corelib.server")
SHUTDOWN_SLACK_S = 5.0  # beyond the grace period: time for the aborted requests' last events
HTTP_START_TIMEOUT_S = 60.0
HTTP_STOP_TIMEOUT_S = 60.0


def model_name(server: ServerConfig, name: str, path: str | None) -> str:
    """``server.served_model_name``, else the checkpoint directory's name, else the preset's."""
    if server.served_model_name:
        return server.served_model_name
    return Path(path).expanduser().resolve().name if path else name


def early_template(model_path: str | None, server: ServerConfig) -> ChatTemplate:
    """The chat template, read before the engine loads the model: a bad ``server.chat_template`` fails at once."""
    from corelib.trust.hub import resolve_model_path

    return ChatTemplate.load(resolve_model_path(model_path) if model_path else None, server.chat_template)


def build_state(recipe: EngineRecipe, server: ServerConfig, api_key: str | None,
                placement: Placement = "process", template: ChatTemplate | None = None) -> ServerState:
    """Start the engine (built in its own process, or on a thread of this one) and everything the routes need."""
    api_key = checked_api_key(api_key)
    metrics = ServerMetrics()
    bridge = EngineBridge(recipe, server.max_waiting, metrics, placement)
    info = bridge.start()
    if bridge.engine_pid is not None:
        metrics.watch_engine_process(bridge.engine_pid)
    try:
        template = template or ChatTemplate.load(info.model_path, server.chat_template)
        renderer = TemplateRenderer(template, info.max_prompt_chars)
        if info.tokenizer is not None:  # without one, chat is refused before any template is rendered
            renderer.start()
    except BaseException:
        bridge.close()
        raise
    name = model_name(server, info.model_name, info.model_path)
    metrics.name_model(name)
    return ServerState(bridge, metrics, renderer, name, api_key, max_body_bytes=int(server.max_body_mib * 2**20),
                       max_request_tokens=server.max_request_tokens,
                       seeds=random.Random(server.seed) if server.seed is not None else None)


def check_server(server: ServerConfig) -> None:
    """Refuse settings that cannot work, naming the key, before anything is built."""
    if not 0 <= server.port <= 65535:
        raise ConfigError(f"server.port={server.port}: must be in [0, 65535] (0: any free port)")
    if server.max_waiting < 0:
        raise ConfigError(f"server.max_waiting={server.max_waiting}: must be >= 0")
    if not 0 <= server.shutdown_grace_s < float("inf"):
        raise ConfigError(f"server.shutdown_grace_s={server.shutdown_grace_s}: must be a number of seconds >= 0")
    if not 0 < server.max_body_mib < 2**20:
        raise ConfigError(f"server.max_body_mib={server.max_body_mib}: must be a number of MiB > 0")
    if not 0 < server.header_timeout_s < float("inf"):
        raise ConfigError(f"server.header_timeout_s={server.header_timeout_s}: must be a number of seconds > 0")
    if server.max_connections < 1:
        raise ConfigError(f"server.max_connections={server.max_connections}: must be at least 1")
    if server.seed is not None and not 0 <= server.seed < SEED_LIMIT:
        raise ConfigError(f"server.seed={server.seed}: must be in [0, 2**62), or null for a fresh seed per request")
    if server.max_request_tokens < 1:
        raise ConfigError(f"server.max_request_tokens={server.max_request_tokens}: must be at least 1")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, so the port is known (``port=0`` picks a free one) before the app starts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise CorelibError(f"server.host={host}: cannot listen there ({error.strerror or error})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise CorelibError(f"cannot listen on {host}:{port}: {error.strerror or error}; "
                           "choose another port with server.port=N") from None
    sock.set_inheritable(True)
    return sock


FORCED_EXIT = "corelib: interrupted again: running requests are cut off now"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which also drains the engine when a signal asks it to stop.

    A second Ctrl-C while it drains ends the grace period at once and says so in one line: every
    running request is aborted (its client told why), so the streams end, uvicorn stops and the
    engine closes as on any stop, within moments. uvicorn's own forced exit would cancel each
    stream mid-write instead and log every cancellation's traceback. A third Ctrl-C, should
    anything still hold the exit, ends the process on the spot; the engine process then reads
    end-of-file on its command pipe and closes itself.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[float | None], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._interrupts = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts == 2 and self.should_exit:
                _say(FORCED_EXIT)
                self._on_exit(0.0)  # no grace left: abort what runs
                return
            if self._interrupts > 2:
                _say("corelib: interrupted")
                os._exit(130)
        self._on_exit(None)
        super().handle_exit(sig, frame)


def _say(line: str) -> None:
    """One line on stderr from a signal handler (no locks: the handler may interrupt a print)."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())


def _uvicorn(state: ServerState, server: ServerConfig) -> _Uvicorn:
    freeze_startup_heap()  # a full collection (a body of many small lists, say) must not walk it while /health waits
    config = uvicorn.Config(
        build_app(state), log_level=server.log_level.value, access_log=server.access_log, lifespan="off",
        timeout_graceful_shutdown=int(server.shutdown_grace_s + SHUTDOWN_SLACK_S) + 1,
        http=guarded_protocol(server.header_timeout_s, server.max_connections),
    )
    return _Uvicorn(config, on_exit=lambda grace_s: state.bridge.drain(
        server.shutdown_grace_s if grace_s is None else grace_s))


def serve(state: ServerState, server: ServerConfig, sock: socket.socket,
          announce: Callable[[str], None] = print) -> None:
    """Serve on ``sock`` (from :func:`bind`) until a signal stops it; the engine is closed on the way out."""
    try:
        host, port = sock.getsockname()[:2]
        for notice in state.bridge.info.notices:
            announce(notice)
        chat = (f"chat template: {state.template.origin}" if state.bridge.info.tokenizer is not None
                else "no tokenizer: prompts are token ids, and /v1/chat/completions is refused")
        engine = state.bridge.engine_pid
        pids = f"pid {os.getpid()}" + (f", engine process pid {engine}" if engine is not None else "")
        announce(f"serving {state.model_name!r} at http://{host}:{port}/v1 ({pids}); {chat}")
        _uvicorn(state, server).run(sockets=[sock])
    finally:
        state.renderer.close()
        state.bridge.close()


@dataclass
class RunningServer:
    """A server on a background thread (tests, notebooks): ``url``, then ``stop()``."""

    state: ServerState
    url: str
    _server: _Uvicorn
    _thread: threading.Thread

    def stop(self, grace_s: float | None = None) -> None:
        """Drain like SIGTERM does (``grace_s`` overrides the configured grace), stop uvicorn, close the engine."""
        if grace_s is not None:
            self.state.bridge.drain(grace_s)
        self._server.handle_exit(0, None)
        self._thread.join(HTTP_STOP_TIMEOUT_S)
        self.state.renderer.close()
        self.state.bridge.close()
        if self._thread.is_alive():
            raise CorelibError(f"the HTTP server thread did not stop within {HTTP_STOP_TIMEOUT_S:g} s")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(engine: Sequence[str] | EngineRecipe, server: ServerConfig | None = None,
                    api_key: str | None = None, placement: Placement = "process") -> RunningServer:
    """Serve an engine (overrides, or a recipe) on a background thread (``server.port=0``: a free port)."""
    server = server or ServerConfig(port=0)
    check_server(server)
    recipe = engine if isinstance(engine, EngineRecipe) else EngineRecipe.of_overrides(engine)
    sock = bind(server.host, server.port)
    try:
        state = build_state(recipe, server, api_key, placement)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    uv = _uvicorn(state, server)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="corelib-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + HTTP_START_TIMEOUT_S
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    if not uv.started:
        uv.should_exit = True
        state.renderer.close()
        state.bridge.close()
        raise CorelibError(f"the HTTP server on {host}:{port} did not start within {HTTP_START_TIMEOUT_S:g} s; "
                           "its log says why")
    return RunningServer(state, f"http://{host}:{port}", uv, thread)
