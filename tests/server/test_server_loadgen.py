"""bench-serve against a live server: every request answered once or hung up on, and the server idle after."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from corelib.config.schema import Endpoint, LogLevel, ServeBenchConfig, ServerConfig
from corelib.errors import ConfigError
from corelib.loadtest.loadgen import Load, bench_serve, run_bench
from corelib.loadtest.plot import plot_latencies
from corelib.observe.rundir import RunDir
from corelib.server.serve import RunningServer, start_in_thread

pytestmark = pytest.mark.slow


def spec(server: RunningServer, **changes: object) -> ServeBenchConfig:
    base = ServeBenchConfig(url=server.url, concurrency=[4], num_requests=12, prompt_len=6, output_len=12,
                            settle_s=10)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_a_load_with_hang_ups_loses_nothing_and_leaves_the_server_idle(server: RunningServer) -> None:
    result = asyncio.run(run_bench(spec(server, disconnect_fraction=0.3, rates=[50.0]), Console(quiet=True)))
    points = result["points"]
    assert isinstance(points, list) and [p["mode"] for p in points] == ["rate", "concurrency"]
    for point in points:
        assert point["requests"] == 12
        assert point["lost"] == 0 and point["duplicated"] == 0, point
        assert point["completed"] + point["disconnected"] == 12
        assert point["tpot_ms_p50"] is not None and point["output_tokens_per_s"] > 0
        # The engine's own TPOT over the same requests, read from the server's metrics, in ms: a gap between two of
        # its tokens lies inside the point's run (a bound the machine's speed or load cannot break; µs would).
        assert 0 < point["engine_tpot_ms_mean"] <= point["duration_s"] * 1e3
    assert sum(p["disconnected"] for p in points) > 0, "with 30 % of clients hanging up some should have"
    after = result["server_after"]
    assert isinstance(after, dict) and after["corelib_kv_blocks_free"] == after["corelib_kv_blocks_total"]
    assert after["process_resident_memory_bytes"] > 0


def test_chat_load_from_a_dataset(server: RunningServer, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello world", "The quick brown fox")) + "\n")
    result = asyncio.run(run_bench(spec(server, endpoint=Endpoint.chat, dataset=str(dataset), num_requests=4),
                                   Console(quiet=True)))
    points = result["points"]
    assert isinstance(points, list) and len(points) == 1
    assert points[0]["completed"] == 4 and points[0]["lost"] == 0


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [({"num_requests": 0}, "never end"), ({"concurrency": []}, "positive"), ({"dataset": "/nonexistent.jsonl"},
                                                                            "cannot be read"),
     ({"top_p": 0.0}, r"^server\.bench\.top_p=0\.0: must be in \(0, 1\]$"),
     ({"temperature": -1.0}, r"^server\.bench\.temperature=-1\.0: must be")],
)
def test_a_bad_load_setting_is_one_line(server: RunningServer, changes: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        asyncio.run(run_bench(spec(server, **changes), Console(quiet=True)))


def test_a_sampled_load_asks_for_its_sampling_and_loses_nothing(server: RunningServer) -> None:
    settings = spec(server, temperature=1.0, top_p=0.9, top_k=20, min_p=0.05, num_requests=8)
    payload, _ = Load(settings, "m").next_request()
    assert (payload["temperature"], payload["top_p"], payload["top_k"], payload["min_p"]) == (1.0, 0.9, 20, 0.05)
    greedy, _ = Load(spec(server), "m").next_request()
    assert greedy["temperature"] == 0.0 and not {"top_p", "top_k", "min_p"} & set(greedy)
    result = asyncio.run(run_bench(settings, Console(quiet=True)))
    points = result["points"]
    assert isinstance(points, list) and points[0]["completed"] == 8 and points[0]["lost"] == 0, points


def test_requests_turned_away_with_429_are_refused_not_lost(overrides: list[str]) -> None:
    config = ServerConfig(port=0, log_level=LogLevel.warning, max_waiting=0)
    with start_in_thread([*overrides, "engine.max_num_seqs=1"], config) as small:
        result = asyncio.run(run_bench(spec(small, concurrency=[6], num_requests=12), Console(quiet=True)))
    points = result["points"]
    assert isinstance(points, list) and len(points) == 1
    assert points[0]["refused"] > 0 and points[0]["lost"] == 0, points[0]
    assert points[0]["completed"] + points[0]["refused"] == 12


def test_bench_serve_shows_progress_and_plots_ttft_and_itl_beside_its_json(
    server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("CORELIB_PROGRESS_INTERVAL", "0")  # a line per request ended: the run is short
    shown = io.StringIO()
    result = bench_serve(spec(server, concurrency=[2], num_requests=4), RunDir(tmp_path),
                         Console(file=shown, width=200))
    said = shown.getvalue()
    assert "bench-serve: 2 clients: 1/4 requests" in said, said
    points = result["points"]
    assert isinstance(points, list) and len(points) == 1
    point = points[0]
    # A gap between each two chunks; a chunk may bring several tokens, so there are at most 11 per request.
    assert len(point["ttfts_ms"]) == 4 and len(point["itls_ms"]) <= 4 * 11
    assert (point["itl_ms_p50"] is None) == (not point["itls_ms"])
    assert json.loads((tmp_path / "bench_serve.json").read_text())["points"][0]["itls_ms"] == point["itls_ms"]
    assert (tmp_path / "bench_serve.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"wrote {tmp_path / 'bench_serve.png'}" in said


def test_without_matplotlib_the_figures_stand_and_the_extra_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"corelib\[bench\]"):
        plot_latencies({"points": []}, tmp_path / "b.png")
