"""The helper thread for a vendor's blocking waits: a wait that returns, one that raises, one that never returns."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from corelib.platform.native import BlockingCalls

PATIENCE_S = 10.0  # far longer than any of these calls takes: reached only when a result is lost


@pytest.fixture
def calls() -> Iterator[BlockingCalls]:
    helper = BlockingCalls("test", bind=lambda: None)
    yield helper
    helper.close(PATIENCE_S)


def test_a_wait_that_raises_raises_in_its_caller_and_the_helper_serves_the_next() -> None:
    bound: list[str] = []
    helper = BlockingCalls("test", bind=lambda: bound.append(threading.current_thread().name))
    lost = RuntimeError("device lost")

    def failing() -> None:
        raise lost

    try:
        with pytest.raises(RuntimeError) as raised:
            helper.run(failing, PATIENCE_S)
        assert raised.value is lost, "the call's own exception, not a timeout"
        ran: list[bool] = []
        assert helper.run(lambda: ran.append(True), PATIENCE_S) is True and ran == [True]
        assert bound == ["test-blocking"], "the helper thread is bound to the device once"
    finally:
        helper.close(PATIENCE_S)


def test_a_wait_that_never_returns_leaves_its_caller_at_the_timeout(calls: BlockingCalls) -> None:
    release = threading.Event()
    try:
        assert calls.run(release.wait, 0.05) is False
    finally:
        release.set()
    assert calls.run(lambda: None, PATIENCE_S) is True, "once the hung call returns, the helper serves again"
