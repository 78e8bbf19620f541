"""One client of ``bench-serve``: a streamed request, checked and timed as the client saw it.

Every request streams with ``ignore_eos`` and ``max_tokens=output_len``, so its length is
known: an answer counts as completed with exactly one finished choice, one ``[DONE]`` and
usage equal to what was asked. TTFT is send to first text, TPOT the time after the first text
per remaining token. Streams go through :class:`~corelib.loadtest.sse_client.SseClient`, cheap
per event; /v1/models and /metrics through httpx.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from corelib.config.schema import Endpoint, ServeBenchConfig
from corelib.errors import CorelibError
from corelib.loadtest.sse_client import ResponseError, SseClient

TPOT_HISTOGRAM = "corelib_time_per_output_token_seconds"
ENGINE_RSS = "corelib_engine_process_resident_memory_bytes"  # when the engine runs in a process of its own
PREFIX_QUERIED = "corelib_prefix_cache_queried_tokens"
PREFIX_HITS = "corelib_prefix_cache_hit_tokens"


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: str = "incomplete"  # completed, disconnected, refused (429/503 before any answer), failed, incomplete
    error: str | None = None
    completion_tokens: int = 0
    pieces: int = 0  # chunks that carried text
    finishes: int = 0  # choices that reported a finish_reason
    done_markers: int = 0  # [DONE] lines
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between two text chunks: the inter-token latencies seen

    @property
    def duplicated(self) -> bool:
        return self.finishes > 1 or self.done_markers > 1


class Client:
    """Streams through :class:`~corelib.loadtest.sse_client.SseClient` (cheap per event); the rest through httpx."""

    def __init__(self, spec: ServeBenchConfig) -> None:
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.http = httpx.AsyncClient(base_url=spec.url.rstrip("/"), headers=headers,
                                      timeout=httpx.Timeout(spec.timeout_s, connect=30.0))
        self.sse = SseClient(spec.url, headers, spec.timeout_s, connect_timeout_s=30.0)
        self.path = "/v1/chat/completions" if spec.endpoint is Endpoint.chat else "/v1/completions"
        self.output_len = spec.output_len

    async def aclose(self) -> None:
        await self.sse.aclose()
        await self.http.aclose()

    async def request(self, payload: dict[str, object], hang_up: int | None) -> Outcome:
        outcome = Outcome()
        sent = time.perf_counter()
        first = last = None
        try:
            async with self.sse.post(self.path, payload) as response:
                if response.status != 200:
                    body = (await response.read()).decode(errors="replace")
                    refused = response.status in (429, 503)
                    outcome.status = "refused" if refused else "failed"
                    outcome.error = f"HTTP {response.status}: {_message(body)}"
                    return outcome
                async for data in response.events():
                    if data == b"[DONE]":
                        outcome.done_markers += 1
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        outcome.error = _message(data.decode(errors="replace"))
                        continue
                    if chunk.get("usage"):
                        outcome.completion_tokens = int(chunk["usage"]["completion_tokens"])
                    for choice in chunk.get("choices", []):
                        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if piece:
                            now = time.perf_counter()
                            if last is not None:
                                outcome.gaps_s.append(now - last)
                            first = first or now
                            last = now
                            outcome.pieces += 1
                        if choice.get("finish_reason"):
                            outcome.finishes += 1
                    if hang_up is not None and outcome.pieces >= hang_up:
                        outcome.status = "disconnected"
                        return outcome  # leaving the block closes the connection mid-stream
        except (ResponseError, json.JSONDecodeError, OSError, TimeoutError) as error:
            outcome.status, outcome.error = "failed", f"{type(error).__name__}: {error}"
            return outcome
        outcome.latency_s = time.perf_counter() - sent
        if first is not None:
            outcome.ttft_s = first - sent
            if last is not None and outcome.completion_tokens > 1:
                outcome.tpot_s = (last - first) / (outcome.completion_tokens - 1)
        complete = outcome.finishes == 1 and outcome.done_markers == 1 and outcome.error is None
        if complete and outcome.completion_tokens == self.output_len:
            outcome.status = "completed"
        elif outcome.error is not None:
            outcome.status = "failed"
        return outcome

    async def metrics(self) -> dict[str, float]:
        """The server's gauges that tell whether it is back to idle."""
        response = await self.http.get("/metrics")
        response.raise_for_status()
        wanted = {"corelib_kv_blocks_free", "corelib_kv_blocks_total", "corelib_requests_running",
                  "corelib_requests_waiting", "process_resident_memory_bytes", ENGINE_RSS, f"{TPOT_HISTOGRAM}_sum",
                  f"{TPOT_HISTOGRAM}_count", PREFIX_QUERIED, PREFIX_HITS}
        figures: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in wanted:
                    figures[sample.name] = sample.value
        return figures

    async def model(self) -> str:
        response = await self.http.get("/v1/models")
        if response.status_code != 200:
            raise CorelibError(f"{self.http.base_url}/v1/models answered {response.status_code}: "
                               f"{_message(response.text)}")
        return str(response.json()["data"][0]["id"])


def _message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return body[:200]
