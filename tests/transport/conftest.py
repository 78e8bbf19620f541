"""Fixtures of the transport tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from ringkit import Wired, wire


@pytest.fixture
def wired() -> Iterator[Callable[..., Wired]]:
    made: list[Wired] = []

    def make(**kwargs: object) -> Wired:
        result = wire(**kwargs)  # type: ignore[arg-type]
        made.append(result)
        return result

    yield make
    for w in made:
        w.ring.close()
