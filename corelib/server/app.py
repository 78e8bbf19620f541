"""The ASGI app: OpenAI routes over the engine bridge, health, models and Prometheus metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, vLLM's ``POST
/tokenize`` and ``POST /detokenize``, and ``GET /metrics`` (these need ``Authorization: Bearer KEY``
when an API key is set), and ``GET /health``, ``GET|POST /ping`` (the same answer) and ``GET
/version`` (open to all: they tell only whether the server takes requests, and corelib's version).
``/metrics`` is behind the key because it tells more than load: its prefix-cache counts move when
any client's prompt shares a prefix with an earlier one, so an open ``/metrics`` would let anyone
test whether someone sent a given prompt. ``/tokenize`` and ``/detokenize`` are behind it because
they spend the server's work (the tokenizer, the chat template's renderers) as a request does,
where vLLM leaves them open. Every error is an OpenAI error object with its status; none carries a
traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from corelib.errors import one_line
from corelib.server.bridge import Call, EngineBridge
from corelib.server.chat import ChatTemplate
from corelib.server.events import EngineInfo, Overloaded, TooLarge, Unavailable
from corelib.server.inputs import (
    Prepared,
    RequestLimits,
    chat_messages,
    check_choices,
    check_tokenize_messages,
    detokenize_ids,
    echo_texts,
    prepare_chat,
    prepare_completion,
    prepares_on_loop,
    render_chat,
    token_text,
    tokenize_chat,
    tokenize_prompt,
)
from corelib.server.messages import Final
from corelib.server.metrics import ServerMetrics
from corelib.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    JsonObject,
    TokenizeRequest,
    parse_body,
)
from corelib.server.render import TemplateRenderer
from corelib.server.responses import DONE, Formatter, event, failure
from corelib.version import __version__

log = logging.getLogger("corelib.server")

Body = TypeVar("Body", CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest)


@dataclass(frozen=True)
class ServerState:
    """What the routes need; built once by :func:`corelib.server.serve.build_state`."""

    bridge: EngineBridge
    metrics: ServerMetrics
    renderer: TemplateRenderer  # the chat template, rendered off the event loop
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_request_tokens: int = 1 << 20  # server.max_request_tokens
    seeds: random.Random | None = None  # server.seed: seeds the requests that send none, in arrival order

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.bridge.capacity, self.max_request_tokens)

    @property
    def template(self) -> ChatTemplate:
        return self.renderer.template


RAW_SEND = "corelib.send"  # the scope key of the server's own send (see build_app)
PARSE_ON_LOOP_BYTES = 16 << 10  # bodies up to this are parsed on the event loop: a thread hop costs more
HEALTH_ASK_S = 1.0  # an idle engine answers at once; one that does not is left to its own checks


class EventStream(Response):
    """An SSE answer: one write per wakeup, holding everything its choices produced since the last one.

    It writes with the server's own ``send``, past the middleware, which only watches the
    messages of a response and has nothing to do once one started. Whatever ends it (done, the
    engine failed, the client hung up), the choices left unfinished are aborted.
    """

    media_type = "text/event-stream"

    def __init__(self, call: Call, formatter: Formatter) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._call = call
        self._formatter = formatter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = scope.get(RAW_SEND, send)
        call, formatter = self._call, self._formatter
        watcher = asyncio.ensure_future(_watch(receive, call))
        started = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            body, done = formatter.start(call.ids), False
            while not done:
                batch = await call.take()
                if not batch:
                    return  # the client hung up
                events, done = formatter.events(batch)
                body += events
                if body or done:
                    await send({"type": "http.response.body", "body": body, "more_body": not done})
                    body = b""
        except OSError:
            pass  # the connection broke while writing: the client is gone
        except Exception as error:
            if not started:
                raise  # the middleware answers 500
            # Past the headers only the stream can say it: an error event, then the end.
            log.error("a stream failed: %s", one_line(error), exc_info=error)
            problem = ApiError(500, f"internal error: {one_line(error)}", "server_error")
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": event(problem.body()) + DONE, "more_body": False})
        finally:
            watcher.cancel()
            call.abort_unfinished()


async def _watch(receive: Receive, call: Call) -> None:
    """Tell ``call`` when its client hangs up (after the body, the server's receive waits for just that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    call.hang_up()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over ``limit`` bytes (before, by its length)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has more than {limit} bytes ({size} so far), the most this server takes "
                         "(server.max_body_mib)", code="request_too_large")


async def finals(call: Call, receive: Receive) -> list[Final] | None:
    """Every choice's last update, in choice order; None if the client hangs up first."""
    got: dict[str, Final] = {}
    watcher = asyncio.ensure_future(_watch(receive, call))
    try:
        while call.unfinished:
            batch = await call.take()
            if not batch:
                return None
            got.update((update.request_id, update) for update in batch if type(update) is Final)
    finally:
        watcher.cancel()
        call.abort_unfinished()
    return [got[i] for i in call.ids]


def build_app(state: ServerState) -> ASGIApp:
    """The routes, and the server's own send handed to streams in the scope (see :class:`EventStream`)."""
    # No redirect of /v1/models/ to /v1/models: Starlette builds its Location from the client's Host header.
    app = FastAPI(title="corelib", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    bridge, metrics, renderer = state.bridge, state.metrics, state.renderer

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        metrics.errors.labels(str(error.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.error("%s %s failed: %s", request.method, request.url.path, one_line(error), exc_info=error)
        metrics.errors.labels("500").inc()
        body = ApiError(500, f"internal error: {one_line(error)}", "server_error").body()
        return JSONResponse(body, status_code=500)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            what = "no API key was sent" if not header else "the API key is not valid"
            raise ApiError(401, f"{what}; send the server's key as 'Authorization: Bearer KEY'",
                           "authentication_error", code="invalid_api_key")

    async def body(request: Request, model: type[Body]) -> Body:
        authorize(request)
        raw = await read_body(request, state.max_body_bytes)
        # A large body's JSON and its validation run off the event loop, so /health and the streams wait on none.
        parsed = parse_body(raw, model) if len(raw) <= PARSE_ON_LOOP_BYTES else await asyncio.to_thread(
            parse_body, raw, model)
        if parsed.model is not None and parsed.model != state.model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves {state.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return parsed

    def start(prepared: Prepared, stream: bool) -> Call:
        try:
            return bridge.submit(prepared.requests, final_only=not stream)
        except TooLarge as error:
            raise ApiError(400, str(error), param="n") from None
        except Overloaded as error:
            raise ApiError(429, str(error), "rate_limit_error", code="too_many_requests") from None
        except Unavailable as error:
            raise ApiError(503, str(error), "service_unavailable") from None

    async def answer(request: Request, formatter: Formatter, call: Call, stream: bool) -> Response:
        if stream:
            return EventStream(call, formatter)
        whole = await finals(call, request.receive)
        if whole is None:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        for update in whole:
            problem = failure(update)
            if problem is not None:
                raise problem
        return JSONResponse(formatter.response(whole))

    # Tokenizing and rendering run off the event loop, so a long prompt or a slow template holds no one else; a
    # short prompt of token ids is prepared on it, sooner than a worker thread would get the GIL.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await body(request, CompletionRequest)
        args = (parsed, bridge.info, state.limits, state.seeds)
        prepared = prepare_completion(*args) if prepares_on_loop(parsed) else await asyncio.to_thread(
            prepare_completion, *args)
        echo = echo_texts(parsed, prepared, bridge.info)
        formatter = Formatter(False, state.model_name, prepared, bridge.info.tokenizer is not None,
                              parsed.include_usage, token_str=token_strings(bridge.info), echo=echo)
        return await answer(request, formatter, start(prepared, parsed.stream), parsed.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = await body(request, ChatRequest)
        check_choices(parsed, 1, state.limits)  # before the template is rendered
        text = await render_chat(chat_messages(parsed, bridge.info), renderer, parsed.chat_template_kwargs)
        prepared = await asyncio.to_thread(prepare_chat, parsed, bridge.info, text, state.template, state.limits,
                                           state.seeds)
        formatter = Formatter(True, state.model_name, prepared, True, parsed.include_usage,
                              token_str=token_strings(bridge.info))
        return await answer(request, formatter, start(prepared, parsed.stream), parsed.stream)

    @app.get("/v1/models")
    async def models(request: Request) -> JsonObject:
        authorize(request)
        card: JsonObject = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "corelib",
                            "max_model_len": bridge.info.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JsonObject:
        parsed = await body(request, TokenizeRequest)
        if parsed.messages is not None:
            check_tokenize_messages(parsed)
            chat = ChatRequest.model_construct(messages=parsed.messages)
            text = await render_chat(chat_messages(chat, bridge.info), renderer, parsed.chat_template_kwargs)
            ids = await asyncio.to_thread(tokenize_chat, text, bridge.info, state.template, parsed, state.limits)
        else:
            ids = await asyncio.to_thread(tokenize_prompt, parsed, bridge.info, state.limits)
        reply: JsonObject = {"count": len(ids), "max_model_len": bridge.info.max_model_len, "tokens": ids}
        if parsed.return_token_strs:
            reply["token_strs"] = [token_strings(bridge.info)(token) for token in ids]
        return reply

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JsonObject:
        parsed = await body(request, DetokenizeRequest)
        return {"prompt": await asyncio.to_thread(detokenize_ids, parsed, bridge.info, state.limits)}

    @app.get("/version")
    async def version() -> JsonObject:
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        return await health()

    @app.get("/health")
    async def health() -> JSONResponse:
        if bridge.failure is None and not bridge.draining and bridge.num_live == 0:
            # An idle engine finds a worker that went away only when it next looks (or steps); asking it
            # now makes it look, so /health never says 200 for an engine whose next request would fail.
            with contextlib.suppress(Unavailable):
                await bridge.snapshot(HEALTH_ASK_S)
        if bridge.failure is not None:
            return JSONResponse({"status": "failed", "reason": bridge.failure}, status_code=503)
        if bridge.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        authorize(request)
        try:
            snapshot = await bridge.snapshot()
        except Unavailable:
            metrics.engine_up.set(0)  # the rest keeps its last values
        else:
            metrics.set_gauges(snapshot.waiting, snapshot.running, snapshot.kv_blocks_free, snapshot.kv_blocks_total)
            metrics.occupancy.set(snapshot.occupancy if snapshot.occupancy is not None else float("nan"))
            queried, hits = snapshot.prefix_cache
            metrics.prefix_cache_queried.set(queried)
            metrics.prefix_cache_hits.set(hits)
            metrics.prefix_cache_hit_rate.set(hits / queried if queried else float("nan"))
            metrics.engine_up.set(0 if snapshot.failure else 1)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await app(scope, receive, send)

    return asgi


def token_strings(info: EngineInfo) -> Callable[[int], str]:
    """One token's text for logprobs: the tokenizer's, or ``<id>`` without one."""
    tokenizer = info.tokenizer
    if tokenizer is None:
        return lambda token: token_text([token])
    return lambda token: tokenizer.decode([token])
