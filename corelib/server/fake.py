"""A stand-in engine without a model: one token for every running request each ``step_ms``.

The server's own cost per streamed token is what is left when the engine costs nothing, so
the streaming benchmark (:mod:`corelib.loadtest.streambench`) serves this instead of a model. A
step waits out ``step_ms`` from its start (the device's time, with the GIL free), of which it
spends ``host_ms`` busy in Python (the engine's host work, holding the GIL), then hands out one
token per running request. Requests run ``max_tokens`` tokens and end with ``length``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.errors import RequestError
from corelib.server.events import EngineFacts
from corelib.support.text import Tokenizer


@dataclass(frozen=True)
class FakeSpec:
    """How the stand-in behaves; picklable, so an engine process can build it."""

    step_ms: float = 2.0  # one step, start to start, when nothing else holds it up
    host_ms: float = 0.0  # of which busy in Python, holding the GIL
    max_num_seqs: int = 64  # requests decoding at once; more wait
    vocab_size: int = 32000
    max_model_len: int = 4096
    num_blocks: int = 1024  # what /metrics reports: all free unless requests run

    def __post_init__(self) -> None:
        if not 0 <= self.host_ms <= self.step_ms:
            raise ValueError(f"host_ms={self.host_ms} must be in [0, step_ms={self.step_ms}]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    number: int
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: list[int] = field(default_factory=list)
    sent: int = 0


class FakeEngine:
    """Implements :class:`corelib.server.served.ServedEngine` with no model."""

    tokenizer: Tokenizer | None = None

    def __init__(self, spec: FakeSpec) -> None:
        self.spec = spec
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._ended: list[TokenDelta] = []  # aborted: reported at the next step
        self._count = 0
        self._steps = 0
        self._busy_s = 0.0
        self._started = time.perf_counter()

    def facts(self) -> EngineFacts:
        spec = self.spec
        notice = f"a stand-in engine: one token per request every {spec.step_ms:g} ms, no model"
        return EngineFacts(spec.vocab_size, spec.max_model_len, spec.max_num_seqs, "fake", None, None,
                           spec.num_blocks, (notice,))

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> None:
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise RequestError(f"request id {request_id!r} is already in use")
        self._count += 1
        wanted = sampling.max_tokens  # None: up to the context, as the engine takes it
        limit = wanted if wanted is not None else max(1, self.spec.max_model_len - len(prompt))
        self._waiting.append(_Request(request_id, list(prompt), limit, self._count))

    def add_request_group(self, prompt: list[int], samplings: list[SamplingParams], request_ids: list[str]) -> None:
        for sampling, request_id in zip(samplings, request_ids, strict=True):
            self.add_request(prompt, sampling, request_id)

    def abort(self, request_id: str) -> bool:
        request = self._running.pop(request_id, None)
        if request is None:
            for waiting in self._waiting:
                if waiting.request_id == request_id:
                    request = waiting
                    self._waiting.remove(waiting)
                    break
        if request is None:
            return False
        self._ended.append(self._final(request, "abort"))
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._ended)

    def check_alive(self) -> None:
        """The stand-in has nothing that could go away."""

    def kv_blocks(self) -> tuple[int, int]:
        used = len(self._running) + len(self._waiting)
        return max(0, self.spec.num_blocks - used), self.spec.num_blocks

    def occupancy(self) -> float | None:
        wall = time.perf_counter() - self._started
        return self._busy_s / wall if wall > 0 else None

    def prefix_cache(self) -> tuple[int, int]:
        return 0, 0  # the stand-in keeps no KV cache

    def step_tokens(self, tracker: DeltaTracker) -> list[TokenDelta]:
        deltas, self._ended = self._ended, []
        if not (self._waiting or self._running):
            return deltas
        start = time.perf_counter()
        spec = self.spec
        while len(self._running) < spec.max_num_seqs and self._waiting:
            request = self._waiting.popleft()
            self._running[request.request_id] = request
        busy_until = start + spec.host_ms / 1e3
        while time.perf_counter() < busy_until:
            pass  # the engine's host work: Python that holds the GIL
        left = start + spec.step_ms / 1e3 - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the device's share of the step
        self._steps += 1
        self._busy_s += time.perf_counter() - start
        now = time.perf_counter()
        finished = []
        for request in self._running.values():
            request.tokens.append(2 + (request.number * 7 + len(request.tokens)) % (spec.vocab_size - 2))
            if request.first_token is None:
                request.first_token = now
            if len(request.tokens) >= request.max_tokens:
                finished.append(request)
            else:
                deltas.append(TokenDelta(request.request_id, request.tokens[request.sent:], ""))
                request.sent = len(request.tokens)
        for request in finished:
            del self._running[request.request_id]
            deltas.append(self._final(request, "length"))
        return deltas

    def _final(self, request: _Request, reason: str) -> TokenDelta:
        now = time.perf_counter()
        ttft = tpot = None
        if request.first_token is not None:
            ttft = (request.first_token - request.arrived) * 1e3
            if len(request.tokens) > 1:
                tpot = (now - request.first_token) * 1e3 / (len(request.tokens) - 1)
        output = RequestOutput(request.request_id, request.prompt, list(request.tokens), reason, None, None, ttft, tpot)
        return TokenDelta(request.request_id, request.tokens[request.sent:], "", output)

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
