"""The ASGI app: OpenAI routes over the engine bridge, health, models and Prometheus metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
need ``Authorization: Bearer KEY`` when an API key is set), ``GET /health`` and ``GET
/metrics``. Every error is an OpenAI error object with its status; none carries a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from corelib.errors import one_line
from corelib.server.bridge import EngineBridge
from corelib.server.chat import ChatTemplate
from corelib.server.events import Overloaded, TooLarge, Unavailable, Update
from corelib.server.inputs import Prepared, prepare_chat, prepare_completion
from corelib.server.metrics import ServerMetrics
from corelib.server.protocol import ApiError, ChatRequest, CompletionRequest, JsonObject, parse_body
from corelib.server.responses import Formatter, failure

log = logging.getLogger("corelib.server")

Body = TypeVar("Body", CompletionRequest, ChatRequest)


@dataclass(frozen=True)
class ServerState:
    """What the routes need; built once by :func:`corelib.server.serve.build_state`."""

    bridge: EngineBridge
    metrics: ServerMetrics
    template: ChatTemplate
    model_name: str
    api_key: str | None = None


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: complete, failed, or the client gone."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class _Call:
    """One HTTP request's choices in the engine: their updates, and aborting those left unfinished."""

    def __init__(self, bridge: EngineBridge, prepared: Prepared, stream: bool) -> None:
        self.bridge = bridge
        self.sink: asyncio.Queue[Update] = asyncio.Queue()
        self.ids = bridge.submit(prepared.requests, self.sink, final_only=not stream)
        self.unfinished = set(self.ids)

    async def updates(self) -> AsyncIterator[Update]:
        while self.unfinished:
            update = await self.sink.get()
            if update.finished:
                self.unfinished.discard(update.request_id)
            yield update

    def abort_unfinished(self) -> None:
        self.bridge.abort(sorted(self.unfinished))

    async def finals(self, request: Request) -> list[Update]:
        """Every choice's last update, in choice order; ClientGone if the client hangs up first."""
        finals: dict[str, Update] = {}
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while self.unfinished:
                getter = asyncio.ensure_future(self.sink.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    raise ClientGone
                update = getter.result()
                if update.finished:
                    self.unfinished.discard(update.request_id)
                    finals[update.request_id] = update
        finally:
            gone.cancel()
            self.abort_unfinished()
        return [finals[i] for i in self.ids]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="corelib", docs_url=None, redoc_url=None, openapi_url=None)
    bridge, metrics = state.bridge, state.metrics

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
        parsed = parse_body(await request.body(), model)
        if parsed.model is not None and parsed.model != state.model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves {state.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return parsed

    def start(prepared: Prepared, stream: bool) -> _Call:
        try:
            return _Call(bridge, prepared, stream)
        except TooLarge as error:
            raise ApiError(400, str(error), param="n") from None
        except Overloaded as error:
            raise ApiError(429, str(error), "rate_limit_error", code="too_many_requests") from None
        except Unavailable as error:
            raise ApiError(503, str(error), "service_unavailable") from None

    async def answer(request: Request, formatter: Formatter, call: _Call, stream: bool) -> Response:
        if stream:
            return EventStream(formatter.stream(call.ids, call.updates()), call.abort_unfinished)
        try:
            finals = await call.finals(request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        for update in finals:
            problem = failure(update)
            if problem is not None:
                raise problem
        return JSONResponse(formatter.response(finals))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await body(request, CompletionRequest)
        prepared = prepare_completion(parsed, bridge.info)
        formatter = Formatter(False, state.model_name, prepared, bridge.info.tokenizer is not None,
                              parsed.include_usage)
        return await answer(request, formatter, start(prepared, parsed.stream), parsed.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = await body(request, ChatRequest)
        prepared = prepare_chat(parsed, bridge.info, state.template)
        formatter = Formatter(True, state.model_name, prepared, True, parsed.include_usage)
        return await answer(request, formatter, start(prepared, parsed.stream), parsed.stream)

    @app.get("/v1/models")
    async def models(request: Request) -> JsonObject:
        authorize(request)
        card: JsonObject = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "corelib",
                            "max_model_len": bridge.info.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if bridge.failure is not None:
            return JSONResponse({"status": "failed", "reason": bridge.failure}, status_code=503)
        if bridge.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        snapshot = await bridge.snapshot()
        metrics.waiting.set(snapshot.waiting)
        metrics.running.set(snapshot.running)
        metrics.kv_blocks_free.set(snapshot.kv_blocks_free)
        metrics.kv_blocks_total.set(snapshot.kv_blocks_total)
        metrics.occupancy.set(snapshot.occupancy if snapshot.occupancy is not None else float("nan"))
        metrics.engine_up.set(0 if snapshot.failure else 1)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
