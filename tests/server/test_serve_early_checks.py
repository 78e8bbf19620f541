"""``serve`` finds a taken port and an unreadable chat template before it starts the engine."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from corelib.cli.main import main
from corelib.server.bridge import EngineBridge

pytestmark = pytest.mark.slow


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(self: EngineBridge) -> object:
        raise AssertionError("the engine was started before the check")

    monkeypatch.setattr(EngineBridge, "start", start)


def test_a_missing_chat_template_is_refused_before_the_engine_starts(
    no_engine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["serve", "tiny", "--port", "0", f"server.chat_template={tmp_path / 'nope.jinja'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"corelib: error: server.chat_template: {tmp_path / 'nope.jinja'} cannot be read" in err


def test_a_taken_port_is_refused_before_the_engine_starts(
    no_engine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "tiny", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "server.port=N" in err
