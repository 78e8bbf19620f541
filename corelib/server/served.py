"""The engine as the server drives it, and a recipe that builds one wherever the engine loop runs.

:class:`ServedEngine` is the little the engine loop needs: add, abort, step, a few facts. A
corelib :class:`~corelib.engine.api.Engine` provides it through :class:`EngineAdapter`; the
stand-in of :mod:`corelib.server.fake` provides it with no model. :class:`EngineRecipe` is
picklable, so an engine process builds the same engine the server would have built itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from omegaconf import DictConfig

from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.server.events import EngineFacts
from corelib.server.fake import FakeEngine, FakeSpec
from corelib.text import Tokenizer

if TYPE_CHECKING:
    from corelib.backend import DeviceSpec
    from corelib.config import CorelibConfig
    from corelib.engine.api import Engine
    from corelib.features import Plan
    from corelib.options import EngineOptions
    from corelib.startup import Startup


class ServedEngine(Protocol):
    """What the engine loop drives; one thread at a time."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def has_unfinished(self) -> bool: ...

    def facts(self) -> EngineFacts: ...

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> object: ...

    def abort(self, request_id: str) -> bool: ...

    def step_tokens(self, tracker: DeltaTracker) -> list[TokenDelta]: ...

    def check_alive(self) -> None:
        """Raise when the engine can no longer run steps (its workers or another node are gone)."""
        ...

    def kv_blocks(self) -> tuple[int, int]:
        """(free, usable) KV-cache blocks."""
        ...

    def occupancy(self) -> float | None:
        """Device busy / (busy + idle) over recent steady decode, when known."""
        ...

    def close(self) -> None: ...


class EngineAdapter:
    """A corelib Engine as a :class:`ServedEngine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._started = time.perf_counter()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def facts(self) -> EngineFacts:
        engine = self.engine
        cfg = engine.startup.config
        tokenizer = str(engine.tokenizer.path) if engine.tokenizer is not None else None
        return EngineFacts(engine.vocab_size, cfg.model.max_model_len, cfg.engine.max_num_seqs, cfg.model.name,
                           cfg.model.path, tokenizer, self.kv_blocks()[1], tuple(engine.notices))

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> object:
        return self.engine.add_request(prompt, sampling, request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def step_tokens(self, tracker: DeltaTracker) -> list[TokenDelta]:
        return self.engine.step_tokens(tracker)

    def check_alive(self) -> None:
        self.engine.check_alive()

    def kv_blocks(self) -> tuple[int, int]:
        stats = self.engine.stats()
        return stats.kv_blocks_free, stats.kv_blocks_total

    def occupancy(self) -> float | None:
        occupancy = self.engine.metrics(time.perf_counter() - self._started).get("occupancy")
        return occupancy if isinstance(occupancy, float) else None

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class StartupParts:
    """A Startup without its backend object, which the engine process looks up by name again."""

    raw: DictConfig
    config: CorelibConfig
    spec: DeviceSpec
    plan: Plan
    messages: tuple[str, ...]
    options: EngineOptions

    def startup(self) -> Startup:
        from corelib.plugins import PluginRegistry
        from corelib.startup import Startup

        backend = PluginRegistry().get(self.spec.backend)
        return Startup(self.raw, self.config, backend, self.spec, self.plan, self.messages, self.options)


@dataclass(frozen=True)
class EngineRecipe:
    """How to build the served engine: from overrides, from the decisions of a startup, or the stand-in."""

    overrides: tuple[str, ...] | None = None
    startup: StartupParts | None = None
    fake: FakeSpec | None = None

    def __post_init__(self) -> None:
        given = sum(part is not None for part in (self.overrides, self.startup, self.fake))
        if given != 1:
            raise ValueError(f"an EngineRecipe takes exactly one of overrides, startup and fake ({given} given)")

    @classmethod
    def of_overrides(cls, overrides: Sequence[str]) -> EngineRecipe:
        return cls(overrides=tuple(overrides))

    @classmethod
    def of_startup(cls, startup: Startup) -> EngineRecipe:
        """The engine ``Engine(startup)`` builds, with the checks and choices already made (nothing re-resolved)."""
        return cls(startup=StartupParts(startup.raw, startup.config, startup.spec, startup.plan, startup.messages,
                                        startup.options))

    def build(self) -> ServedEngine:
        if self.fake is not None:
            return FakeEngine(self.fake)
        from corelib.engine.api import Engine

        if self.overrides is not None:
            return EngineAdapter(Engine.from_overrides(list(self.overrides)))
        assert self.startup is not None, "checked in __post_init__"
        return EngineAdapter(Engine(self.startup.startup()))
