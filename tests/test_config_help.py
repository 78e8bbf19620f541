"""`COMMAND --help` says what every key means and which values an enum key takes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest

from corelib.cli.config_help import HELP_KEY
from corelib.cli.main import main
from corelib.config import schema as config


def schemas() -> Iterator[type]:
    for value in vars(config).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == config.__name__:
            yield value


def test_every_key_of_every_schema_says_what_it_means() -> None:
    undocumented = [f"{schema.__name__}.{field.name}" for schema in schemas() for field in dataclasses.fields(schema)
                    if not field.metadata.get(HELP_KEY)]
    assert not undocumented, f"keys without metadata={{'help': ...}}: {undocumented}"


def help_text(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, str]:
    """``run --help`` as {key line: its comment}, the key line stripped of indentation."""
    assert main(["run", "--help", *args]) == 0
    out = capsys.readouterr().out
    lines = {}
    for line in out.splitlines():
        match = re.match(r"^\s*(\w+:.*?)\s+# (.*)$", line)
        if match:
            lines[match.group(1)] = match.group(2)
    return lines


def test_run_help_shows_each_key_with_its_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    lines = help_text(capsys, "backend=cpu")
    assert lines["max_model_len: 0"].startswith("longest prompt + output a request may have; 0: max_position_emb")
    assert lines["runtime: native"].startswith("[auto|native|emulated] native: only on the hardware")
    assert lines["async_token_handoff: auto"].startswith("[auto|on|off] overlap step N+1")
    assert lines["request_rate: 0.0"].startswith("requests per second, arriving as a Poisson process")
    assert "Hugging Face" in lines["path: null"]


def test_run_help_shows_the_config_the_overrides_make(capsys: pytest.CaptureFixture[str]) -> None:
    lines = help_text(capsys, "model=small-0.6b", "engine.max_num_seqs=3")
    assert lines["vocab_size: 151936"] == "token ids are 0 .. vocab_size-1"
    assert "max_num_seqs: 3" in lines
