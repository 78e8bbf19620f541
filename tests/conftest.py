"""Shared fixtures: engines built from overrides, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from corelib.engine import Engine

EngineFactory = Callable[[Sequence[str]], Engine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    engines: list[Engine] = []

    def factory(overrides: Sequence[str]) -> Engine:
        engine = Engine.from_overrides(list(overrides))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()
