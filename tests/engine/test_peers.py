"""benchmarks/peers.py on the CPU with tiny token counts (skipped without transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import load_benchmark

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

NEW_TOKENS = 5
TINY = ["--model", "tiny", "--device", "cpu", "--batch-sizes", "1", "3", "--prompt-len", "6", "--new-tokens",
        str(NEW_TOKENS), "--repeats", "1", "--floor-replays", "3", "--copy-mib", "4"]


def run_peers(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    out = tmp_path / "peers.json"
    assert load_benchmark("peers").main([*TINY, *extra, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "HF static" in printed and "weight-read floor" in printed
    result: dict[str, object] = json.loads(out.read_text())
    return result


def test_emulated_gpu_run_has_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_peers(tmp_path, capsys, "--set", "backend=cuda", "backend.runtime=emulated")
    points = result["points"]
    assert isinstance(points, list)
    assert [p["batch_size"] for p in points] == [1, 3]
    for point in points:
        assert point["transformers"]["tpot_ms"] is not None
        assert point["corelib_sync"]["tpot_ms"] > 0
        assert point["corelib_async"]["async_token_handoff"] is True
        assert point["corelib_async"]["graph_steps"] > 0
        assert point["graph_floor"]["ms"] > 0
        assert point["sync_async_tokens_equal"] is True
        # float32 weights: the same weights and prompts give the same greedy tokens on both sides
        assert point["token_agreement"]["per_request"] == [NEW_TOKENS] * point["batch_size"]
    floor = result["weight_read_floor"]
    assert isinstance(floor, dict)
    assert floor["ms"] > 0 and floor["bytes_read_per_step"] < floor["bytes_all_parameters"]


def test_cpu_backend_reports_what_it_cannot_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_peers(tmp_path, capsys)
    points = result["points"]
    assert isinstance(points, list)
    for point in points:
        assert point["corelib_sync"]["tpot_ms"] > 0
        assert "refused" in point["corelib_async"]["skipped"]
        assert "graphs are off" in point["graph_floor"]["skipped"]
        assert point["token_agreement"]["min"] == NEW_TOKENS
