"""The engine as the server drives it, and a recipe that builds one wherever the engine loop runs.

:class:`ServedEngine` is the little the engine loop needs: add, abort, step, a few facts. A
corelib :class:`~corelib.engine.api.Engine` provides it through :class:`EngineAdapter`; the
stand-in of :mod:`corelib.server.fake` provides it with no model. :class:`EngineRecipe` is
picklable, so an engine process builds the same engine the server would have built itself; a
recipe of a composed config also runs the startup there (probing the backend, planning, writing
the run directory's ``plan.json``), so that the server's own process never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from omegaconf import DictConfig

from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.server.events import EngineFacts
from corelib.server.fake import FakeEngine, FakeSpec
from corelib.support.text import Tokenizer

if TYPE_CHECKING:
    from corelib.engine.api import Engine


class ServedEngine(Protocol):
    """What the engine loop drives; one thread at a time."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def has_unfinished(self) -> bool: ...

    def facts(self) -> EngineFacts: ...

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> object: ...

    def add_request_group(self, prompt: list[int], samplings: list[SamplingParams], request_ids: list[str]) -> object:
        """Requests of one prompt (a request's ``n`` choices): they share its KV blocks where the engine can."""
        ...

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

    def prefix_cache(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there)."""
        ...

    def close(self) -> None: ...


class EngineAdapter:
    """A corelib Engine as a :class:`ServedEngine`."""

    def __init__(self, engine: Engine, startup_messages: Sequence[str] = ()) -> None:
        self.engine = engine
        self._startup_messages = tuple(startup_messages)
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
                           cfg.model.path, tokenizer, self.kv_blocks()[1], (*self._startup_messages, *engine.notices),
                           tuple(cfg.model.sampling_defaults.items()))

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> object:
        return self.engine.add_request(prompt, sampling, request_id)

    def add_request_group(self, prompt: list[int], samplings: list[SamplingParams], request_ids: list[str]) -> object:
        return self.engine.add_requests_sharing_prompt(prompt, samplings, request_ids)

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

    def prefix_cache(self) -> tuple[int, int]:
        stats = self.engine.stats()
        return stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class ComposedRun:
    """A composed config (interpolations resolved) and the run directory its startup is recorded in."""

    config: DictConfig
    run_dir: str

    def build(self) -> EngineAdapter:
        """Check the config, choose the backend, plan, record ``config.yaml`` and ``plan.json``, build."""
        from corelib.engine.api import Engine
        from corelib.observe.rundir import RunDir
        from corelib.plugins import PluginRegistry
        from corelib.startup.compose import prepare_config_store
        from corelib.startup.start import start

        plugins = self.config.plugins
        registry = PluginRegistry(allow=plugins.allow, block=plugins.block)
        prepare_config_store(registry)
        startup = start(self.config, registry)
        RunDir(Path(self.run_dir)).record_startup(startup)
        return EngineAdapter(Engine(startup), startup.messages)


@dataclass(frozen=True)
class EngineRecipe:
    """How to build the served engine: from overrides, from the decisions of a startup, or the stand-in."""

    overrides: tuple[str, ...] | None = None
    composed: ComposedRun | None = None
    fake: FakeSpec | None = None

    def __post_init__(self) -> None:
        given = sum(part is not None for part in (self.overrides, self.composed, self.fake))
        if given != 1:
            raise ValueError(f"an EngineRecipe takes exactly one of overrides, composed and fake ({given} given)")

    @classmethod
    def of_overrides(cls, overrides: Sequence[str]) -> EngineRecipe:
        return cls(overrides=tuple(overrides))

    @classmethod
    def of_config(cls, config: DictConfig, run_dir: Path) -> EngineRecipe:
        """The engine of a composed config: its startup (backend choice, probe, plan) runs where it is built."""
        return cls(composed=ComposedRun(config, str(run_dir)))

    def build(self) -> ServedEngine:
        if self.fake is not None:
            return FakeEngine(self.fake)
        from corelib.engine.api import Engine

        if self.overrides is not None:
            return EngineAdapter(Engine.from_overrides(list(self.overrides)))
        assert self.composed is not None, "checked in __post_init__"
        return self.composed.build()
