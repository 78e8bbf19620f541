"""Every shell and Python block of README.md runs: offline, on the CPU, against a tiny stand-in for its model.

Blocks between ``<!-- ci:NAME -->`` markers are the ones ``.ci/run`` runs as written (installs,
the suite itself): this test checks that ``.ci/run`` names each of them. Every other block runs
here, in a directory of its own, with ``HF_HUB_OFFLINE=1`` and a Hugging Face cache holding a
tiny random checkpoint (with a tokenizer and a chat template) under each hub id the README
names, so a real model's commands run in seconds. A block after ``<!-- readme: background -->``
is a server: it runs until the block after it has run against it. Port 8000 is replaced by a
free port, so parallel runs cannot collide.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from corelib.models.synthetic import hub_snapshot, write_text_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
HUB_ID = re.compile(r"""(?:model\.path=|model=["']|corelib (?:run|serve) )([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)""")
BLOCK_TIMEOUT_S = 300  # a bound on a hang, not a speed requirement


@dataclass(frozen=True)
class Block:
    line: int  # where the block starts in README.md
    language: str
    text: str
    ci: str | None  # the <!-- ci:NAME --> block this is, if any
    background: bool  # <!-- readme: background -->: a server for the next block

    @property
    def id(self) -> str:
        return f"line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    ci: str | None = None
    background = False
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if match := re.fullmatch(r"<!-- ci:([\w-]+) -->", line):
            ci = match[1]
        elif re.fullmatch(r"<!-- /ci:[\w-]+ -->", line):
            ci = None
        elif line == "<!-- readme: background -->":
            background = True
        elif line.startswith("```"):
            language = line[3:].strip()
            start = index
            body: list[str] = []
            index += 1
            while not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            if language in LANGUAGES:
                blocks.append(Block(start + 1, LANGUAGES[language], "\n".join(body) + "\n", ci, background))
            background = False
        index += 1
    return blocks


BLOCKS = readme_blocks(README.read_text())
# A background block and the block it serves run as one case.
CASES = [(block, BLOCKS[i + 1] if block.background else None) for i, block in enumerate(BLOCKS)
         if block.ci is None and not (i and BLOCKS[i - 1].background)]


def test_every_ci_block_is_run_by_ci_run() -> None:
    script = (REPO / ".ci" / "run").read_text()
    named = set(re.findall(r"run_readme_block (\S+)", script))
    blocks = {block.ci for block in BLOCKS if block.ci is not None}
    assert blocks <= named, f"README blocks .ci/run never runs: {sorted(blocks - named)}"
    assert {"install", "test", "soak", "multinode"} <= blocks


def test_the_readme_is_for_a_user() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first_screen = "\n".join(text.splitlines()[:30])
    assert "## Quickstart" in first_screen and "python -m corelib run" in first_screen


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    model = write_text_checkpoint(tmp_path_factory.mktemp("stand-in"))
    for repo_id in sorted({m for block in BLOCKS for m in HUB_ID.findall(block.text)}):
        snapshot = hub_snapshot(cache, repo_id)
        for file in model.iterdir():
            (snapshot / file.name).symlink_to(file)
    return cache


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(block: Block, cwd: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    text = block.text.replace("8000", str(port))
    command = ["bash", "-euo", "pipefail", "-c", text] if block.language == "bash" else [sys.executable, "-c", text]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen[str], block: Block) -> str:
    try:
        out, err = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"README line {block.line}: still running after {BLOCK_TIMEOUT_S} s\n{err}") from None
    assert process.returncode == 0, f"README line {block.line} exited {process.returncode}:\n{block.text}\n{err}"
    assert "Traceback" not in err, err
    return out


def wait_until_serving(server: subprocess.Popen[str], block: Block) -> None:
    assert server.stderr is not None
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    for line in server.stderr:
        if "serving" in line and "http://" in line:
            return
        assert time.monotonic() < deadline, f"README line {block.line}: the server did not start"
    raise AssertionError(f"README line {block.line}: the server exited before serving (exit {server.wait()})")


@pytest.mark.parametrize(("block", "client"), CASES, ids=[block.id for block, _ in CASES])
def test_a_readme_block_runs(block: Block, client: Block | None, offline_cache: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORELIB_", "HF_"))}
    env.update(HF_HUB_CACHE=str(offline_cache), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    port = free_port()
    process = start(block, tmp_path, env, port)
    if client is None:
        finish(process, block)
        return
    try:
        wait_until_serving(process, block)
        out = finish(start(client, tmp_path, env, port), client)
        assert out.strip(), f"README line {client.line} printed nothing"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
