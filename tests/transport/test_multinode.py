"""Tensor parallelism across nodes: two torchrun launchers on 127.0.0.1 play two nodes (gloo).

Each node is a ``torchrun --nnodes=2 --nproc-per-node=1`` process in a session of its own, as
on two machines: node 0 schedules and runs rank 0, node 1 runs rank 1 from its own SHM ring,
fed with node 0's frames through torch.distributed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import HERMETIC_VARIABLES

from corelib.errors import ConfigError
from corelib.models.identity import checkpoint_identity
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint
from corelib.transport.nodes import Topology

WORKLOAD = ["workload.num_requests=6", "workload.output_len_min=4", "workload.output_len_max=24",
            "workload.ignore_eos=true"]
BACKENDS = {
    "cpu": ["backend=cpu"],
    "npu-emulated-chaos": ["backend=npu", "backend.emulator.chaos=0.3"],
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in HERMETIC_VARIABLES}


def _launch(node: int, port: int, where: Path, overrides: list[str], command: str = "run") -> subprocess.Popen[bytes]:
    """One node; its output goes to files (a pipe nobody reads while the other node is awaited would fill)."""
    where.mkdir(parents=True, exist_ok=True)
    command_line = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                    "-m", "corelib", command, *overrides, f"hydra.run.dir={where / 'run'}"]
    with (where / "stdout").open("wb") as out, (where / "stderr").open("wb") as err:
        return subprocess.Popen(command_line, cwd=where, env=_environment(), stdout=out, stderr=err,
                                start_new_session=True)


def _finish(process: subprocess.Popen[bytes], timeout: float) -> tuple[int, str, str]:
    where = Path(str(process.args[-1]).removeprefix("hydra.run.dir=")).parent  # type: ignore[index]
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_node(process)
    out, err = ((where / name).read_text(errors="replace") for name in ("stdout", "stderr"))
    if process.returncode == -signal.SIGKILL:
        pytest.fail(f"{where.name} did not stop within {timeout:g} s:\n{out[-2000:]}\n{err[-4000:]}")
    return process.returncode, out, err


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_node(process: subprocess.Popen[bytes]) -> None:
    """Every process of a node at once, as when the machine goes down (torchrun starts its workers in
    sessions of their own, so its process group is not enough)."""
    for pid in [process.pid, *_descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def _tokens(run_dir: Path) -> dict[str, list[int]]:
    lines = (run_dir / "outputs.jsonl").read_text().splitlines()
    return {record["id"]: record["output_token_ids"] for record in map(json.loads, lines)}


def _corelib_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("corelib: error:")]


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_nodes_give_the_tokens_of_one_rank(tmp_path: Path, backend: str) -> None:
    overrides = [*BACKENDS[backend], *WORKLOAD]
    single = subprocess.run([sys.executable, "-m", "corelib", "run", *overrides,
                             f"hydra.run.dir={tmp_path / 'tp1'}"], cwd=tmp_path, env=_environment(),
                            capture_output=True, text=True, timeout=300, check=False)
    assert single.returncode == 0, single.stderr
    port = _free_port()
    tp2 = [*overrides, "engine.transport=shm", "engine.tp=2"]
    nodes = [_launch(node, port, tmp_path / f"node{node}", tp2) for node in (0, 1)]
    results = [_finish(process, 300) for process in nodes]
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
    assert _tokens(tmp_path / "node0" / "run") == _tokens(tmp_path / "tp1")
    assert "node 1 (worker rank 1) of 2: following node 0" in results[1][2]  # status: stderr
    assert not (tmp_path / "node1" / "run" / "outputs.jsonl").exists(), "only node 0 writes the outputs"


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("ending", ["SIGTERM to node 0", "node 1 killed while idle"])
def test_serve_across_two_nodes_answers_and_stops_both(tmp_path: Path, ending: str) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from corelib.engine import Engine, SamplingParams

    prompt = [5, 6, 7]
    with Engine.from_overrides(["backend=cpu"]) as engine:
        expected = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_token_ids
    port, http_port = _free_port(), _free_port()
    health = f"http://127.0.0.1:{http_port}/health"
    overrides = ["backend=cpu", "engine.transport=shm", "engine.tp=2", f"server.port={http_port}"]
    nodes = [_launch(node, port, tmp_path / f"node{node}", overrides, command="serve") for node in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(process.poll() is None for process in nodes), "a node stopped while starting"
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(1)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60).json()
        if ending == "node 1 killed while idle":
            _kill_node(nodes[1])
            killed_at = time.monotonic()
            while (state := httpx.get(health, timeout=5)).status_code == 200:
                assert time.monotonic() - killed_at < 30, "node 0 went on as if node 1 were there"
                time.sleep(0.5)
            reason = state.json().get("reason", "")
        nodes[0].send_signal(signal.SIGTERM)  # torchrun passes it to node 0's corelib
        results = {node: _finish(nodes[node], 60) for node in (0, 1) if nodes[node].poll() is None}
    finally:
        for process in nodes:
            _kill_node(process)
    text = answer["choices"][0]["text"]  # no tokenizer: each token id as <id>
    assert [int(t) for t in re.findall(r"<(\d+)>", text)] == expected, answer
    if ending == "SIGTERM to node 0":
        code, out, err = results[1]
        assert code == 0 and "node 0 finished" in err, f"node 1 exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
    else:
        # The engine stops at once; the HTTP server stays up to say why (503) until it is stopped.
        assert "node 1 (worker rank 1) is gone" in reason, reason


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("victim", ["node 0", "node 1", "rank 1"])
def test_killing_a_node_or_a_rank_stops_both_naming_it(tmp_path: Path, victim: str) -> None:
    # Requests arrive for about a minute, so both nodes are mid-run when one is killed.
    overrides = ["backend=cpu", "engine.transport=shm", "engine.tp=2", "engine.timeout_s=20",
                 "workload.num_requests=300", "workload.request_rate=5"]
    port = _free_port()
    nodes = [_launch(node, port, tmp_path / f"node{node}", overrides) for node in (0, 1)]
    try:
        outputs = tmp_path / "node0" / "run" / "outputs.jsonl"
        deadline = time.monotonic() + 180
        while len(outputs.read_text().splitlines() if outputs.exists() else []) < 5:
            assert time.monotonic() < deadline, "node 0 finished no request"
            assert all(process.poll() is None for process in nodes), "a node stopped before the kill"
            time.sleep(0.5)
        if victim == "rank 1":  # only node 1's worker process: node 1's launcher reports it
            (worker,) = [pid for pid in _descendants(nodes[1].pid)
                         if b"corelib.transport.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            os.kill(worker, signal.SIGKILL)
        else:
            _kill_node(nodes[int(victim[-1])])
        killed_at = time.monotonic()
        survivors = [0, 1] if victim == "rank 1" else [1 - int(victim[-1])]
        results = {node: _finish(nodes[node], 120) for node in survivors}
        took = time.monotonic() - killed_at
    finally:
        for process in nodes:
            _kill_node(process)
    expected = {
        "node 0": {1: "node 0 (worker rank 0) is gone"},
        "node 1": {0: "node 1 (worker rank 1) is gone"},
        "rank 1": {0: "node 1 (worker rank 1) stopped: worker rank 1 (pid ",
                   1: "node 1 (worker rank 1): worker rank 1 (pid "},
    }[victim]
    for node, (code, out, err) in results.items():
        errors = _corelib_errors(err)
        assert code != 0 and errors, f"node {node} exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
        assert expected[node] in errors[0], errors
    assert took < 60, f"the surviving node took {took:.0f} s to stop"


def test_topology_from_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Topology.from_environment(4) == Topology(0, 1, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    topology = Topology.from_environment(4)
    assert (topology.follower, list(topology.local_ranks)) == (True, [2, 3])
    assert topology.name(0) == "node 0 (worker ranks 0-1)"
    with pytest.raises(ConfigError, match=r"engine.tp=3 cannot be spread over the 2 nodes"):
        Topology.from_environment(3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node=1"):
        Topology.from_environment(4)


def test_the_identity_of_a_checkpoint_sees_its_weights(tmp_path: Path) -> None:
    hf = tiny_hf_config()
    for name, seed in (("a", 0), ("b", 1), ("c", 0)):
        write_random_checkpoint(tmp_path / name, hf, seed=seed)
    same_config = checkpoint_identity(tmp_path / "a") != checkpoint_identity(tmp_path / "b")
    assert same_config, "two checkpoints of one config with different weights have the same identity"
    assert checkpoint_identity(tmp_path / "a") == checkpoint_identity(tmp_path / "c")
    sharded = tmp_path / "d"
    write_random_checkpoint(sharded, hf, shards=2)
    assert checkpoint_identity(sharded) != checkpoint_identity(tmp_path / "a"), "a resharded copy is another layout"


@pytest.mark.slow
@pytest.mark.multinode
def test_nodes_whose_checkpoints_differ_refuse_to_start(tmp_path: Path) -> None:
    hf = tiny_hf_config()
    for node in (0, 1):  # the same path on both "machines", different weights behind it
        write_random_checkpoint(tmp_path / f"node{node}" / "model", hf, seed=node)
    port = _free_port()
    overrides = ["backend=cpu", "engine.transport=shm", "engine.tp=2", "engine.timeout_s=20", "model.path=model"]
    nodes = [_launch(node, port, tmp_path / f"node{node}", overrides) for node in (0, 1)]
    for node, (code, out, err) in enumerate(_finish(process, 180) for process in nodes):
        errors = _corelib_errors(err)
        assert code != 0 and errors, f"node {node} exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
        assert "the nodes hold different weights: the checkpoint at model.path is not the same" in errors[0]


@pytest.mark.slow
@pytest.mark.multinode
def test_a_node_that_fails_before_it_joins_is_named_within_the_engine_timeout(tmp_path: Path) -> None:
    port = _free_port()
    overrides = ["backend=cpu", "engine.transport=shm", "engine.tp=2", "engine.timeout_s=3"]
    nodes = [_launch(0, port, tmp_path / "node0", overrides),
             _launch(1, port, tmp_path / "node1", [*overrides, "engine.max_num_seqs=0"])]  # node 1 never joins
    code, out, err = _finish(nodes[1], 120)
    assert code != 0 and "engine.max_num_seqs=0" in err, err[-2000:]
    code, out, err = _finish(nodes[0], 120)
    errors = _corelib_errors(err)
    assert code != 0 and errors, f"node 0 exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
    assert errors[0].startswith("corelib: error: node 1 (worker rank 1) did not join node 0 within 3 s"), errors
    assert "DistStoreError" not in errors[0]
