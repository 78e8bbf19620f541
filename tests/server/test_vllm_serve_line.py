"""A vLLM serve line runs unchanged but for the command name, on a local checkpoint with a real tokenizer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from server.servekit import CHAT_TEMPLATE, write_chat_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.long]  # a whole serve process: with the long checks

WAIT_S = 60.0
# As Qwen3's: enable_thinking=false writes an empty thinking block after the generation prompt.
THINKING_TEMPLATE = CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}hello world{% endif %}"


def test_a_vllm_serve_line_runs_unchanged(tmp_path: Path) -> None:
    model = write_chat_checkpoint(tmp_path / "model", THINKING_TEMPLATE, max_position_embeddings=2048)
    line = (f"serve {model} --port 0 --dtype auto --max-model-len 1024 --gpu-memory-utilization 0.9 "
            "--enable-prefix-caching --seed 0 --trust-remote-code --served-model-name m")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CORELIB_API_KEY", None)
    process = subprocess.Popen([sys.executable, "-m", "corelib", *line.split(), f"hydra.run.dir={tmp_path / 'run'}"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    said: list[str] = []
    try:
        assert process.stderr is not None
        stderr = process.stderr
        for status in stderr:  # what it says up to the line that gives its address
            said.append(status)
            if "serving" in status:
                break
        url = re.search(r"at (\S+/v1) ", said[-1])[1]  # type: ignore[index]
        threading.Thread(target=lambda: said.extend(stderr), daemon=True).start()
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=WAIT_S)
        [card] = client.models.list().data
        assert card.id == "m" and card.model_extra is not None and card.model_extra["max_model_len"] == 1024
        completion = client.completions.create(model="m", prompt="The quick brown", max_tokens=5,
                                               extra_body={"ignore_eos": True})
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        again = client.completions.create(model="m", prompt="The quick brown", max_tokens=5, temperature=0.9,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].text, "sampled with a seed server.seed drew"
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=3,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert chat.choices[0].message.role == "assistant"
        base = url.removesuffix("/v1")
        conversation = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
        thinking = httpx.post(f"{base}/tokenize", json=conversation, timeout=WAIT_S).json()
        assert chat.usage is not None and chat.usage.prompt_tokens > thinking["count"], "enable_thinking reached it"
        tokens = httpx.post(f"{base}/tokenize", json={"model": "m", "prompt": "The quick brown"}, timeout=WAIT_S)
        assert tokens.json()["count"] == completion.usage.prompt_tokens
        assert httpx.get(f"{base}/version", timeout=WAIT_S).status_code == 200
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(WAIT_S) == 130
    finally:
        process.kill()
        process.wait()
    text = "".join(said)
    assert "--trust-remote-code is ignored" in text
    config = (tmp_path / "run" / "config.yaml").read_text()
    for setting in ("gpu_memory_utilization: 0.9", "prefix_caching: 'on'", "max_model_len: 1024", "seed: 0"):
        assert setting in config, setting
