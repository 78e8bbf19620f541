"""A tiny checkpoint with a tokenizer and a chat template, served on 127.0.0.1 by a thread of the test process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.engine.api import Engine
from corelib.server.serve import RunningServer, start_in_thread
from server.servekit import write_chat_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def overrides(model_dir: Path) -> list[str]:
    # The emulated npu: the real async path, and quick on a busy 2-core machine.
    return ["backend=npu", f"model.path={model_dir}", "engine.max_num_seqs=64"]


@pytest.fixture(scope="module")
def server(overrides: list[str]) -> Iterator[RunningServer]:
    config = ServerConfig(port=0, log_level=LogLevel.warning, max_waiting=64, served_model_name="chat-model")
    running = start_in_thread(overrides, config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(overrides: list[str]) -> Iterator[Engine]:
    """An engine of the same config in the test's thread: what the server must match."""
    with Engine.from_overrides(overrides) as engine:
        yield engine
