"""Helpers for the server tests: a tiny checkpoint with a tokenizer and a chat template, /metrics, SSE."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint, write_toy_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A naive cafe in the city sells creme brulee.",
    "Hello world, the engine says hello back.",
]
# Written the way chat templates are (a block per line); trim_blocks and lstrip_blocks make it
# render one line per message, which the tests check against a string written by hand.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}
        {{ raise_exception('this template has no tool role') }}
    {% endif %}
<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


def write_chat_checkpoint(directory: Path, template: str = CHAT_TEMPLATE, **config: object) -> Path:
    """A tiny random Qwen3 checkpoint with tokenizer.json and a tokenizer_config.json holding a chat template;
    ``config`` replaces or adds keys of its config.json."""
    write_random_checkpoint(directory, tiny_hf_config("Qwen3ForCausalLM", **config))
    write_toy_tokenizer(directory, CORPUS * 4)
    settings = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's samples by name, labels folded in: ``corelib_requests_total{finish_reason=abort}``.

    ``api_key``: the server's, when it has one (``/metrics`` needs it then, like every route but ``/health``).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    response = httpx.get(f"{url}/metrics", headers=headers)
    response.raise_for_status()
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            figures[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return figures


def finished(url: str, reason: str) -> float:
    return metrics(url).get(f"corelib_requests_total{{finish_reason={reason}}}", 0.0)


def wait_idle(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> dict[str, float]:
    """Metrics once nothing runs and every KV block is free; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = metrics(url, api_key)
        busy = figures["corelib_requests_running"] + figures["corelib_requests_waiting"]
        if busy == 0 and figures["corelib_kv_blocks_free"] == figures["corelib_kv_blocks_total"]:
            return figures
        assert time.monotonic() < deadline, f"the server did not return to idle: {figures}"
        time.sleep(0.05)


def data_lines(lines: Iterable[str]) -> list[str]:
    """The payloads of SSE ``data:`` lines."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def announced(process: subprocess.Popen[str]) -> tuple[str, int]:
    """The URL and the engine process's pid from the status line (stderr) the server prints once it serves."""
    assert process.stderr is not None, "Popen was asked for a stderr pipe"
    deadline = time.monotonic() + 60
    for line in process.stderr:
        if "serving" in line and "http://" in line:
            match = re.search(r"at (\S+) \(pid \d+, engine process pid (\d+)\)", line)
            assert match is not None, line
            return match[1], int(match[2])
        assert time.monotonic() < deadline, "the server did not start within 60 s"
    raise AssertionError("the server exited before serving")
