"""benchmarks/floor_targets.py: the decode targets against a run's figures, each with the step's read floor."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf
from support import load_benchmark

from corelib.config.schema import CorelibConfig
from corelib.models.registry import model_shape
from corelib.models.shape import ModelShape
from corelib.models.weight_map import weight_map
from corelib.startup.compose import compose_config

LLAMA_8B_PARAMETERS = 8_030_261_248


def shape_of(model: str) -> ModelShape:
    config = OmegaConf.to_object(compose_config([f"model={model}"]))
    assert isinstance(config, CorelibConfig)
    return model_shape(config.model)


def test_a_decode_step_reads_every_weight_but_an_untied_embedding_table() -> None:
    untied = weight_map(shape_of("llama-8b"))
    assert untied.parameter_count() == LLAMA_8B_PARAMETERS
    assert untied.step_parameter_count() == LLAMA_8B_PARAMETERS - 128_256 * 4_096
    tied = weight_map(shape_of("llama-1b"))
    assert tied.step_parameter_count() == tied.parameter_count()  # the table is read whole, as the LM head


def test_the_read_floor_counts_the_kv_cache_at_the_mean_context() -> None:
    floor = load_benchmark("floor_targets").read_floor("small-0.6b", 32, 1900, copy_rate_tb_s=4.0, new_tokens=128)
    per_token = 28 * 2 * 8 * 64 * 2  # layers, K and V, KV heads, head width, bf16
    assert floor.kv_bytes == 32 * (1900 + 64) * per_token
    weights = weight_map(shape_of("small-0.6b")).step_parameter_count() * 2
    assert floor.weight_bytes == weights
    assert floor.ms == (weights + floor.kv_bytes) / 4.0e12 * 1e3


def test_each_target_line_says_met_or_missed_with_its_floor_and_device_time_under_it(tmp_path: Path) -> None:
    points = [{"batch_size": 1, "tpot_ms": 0.45, "pdl": True}, {"batch_size": 32, "tpot_ms": 2.1, "pdl": True}]
    (tmp_path / "bench-long").mkdir()
    (tmp_path / "bench-long" / "bench.json").write_text(json.dumps({"points": points}))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"copy_rate_tb_per_s": 4.0, "kernels": []}))
    steps = [{"model": "small-0.6b", "batch": 1, "context": 64, "reference_us": 2400.0, "triton_us": 690.0,
              "triton+pdl_us": 560.0, "pdl_equals_plain": True},
             {"model": "small-0.6b", "batch": 1, "context": 1900, "reference_us": 2600.0, "triton+pdl_us": 620.0,
              "pdl_equals_plain": True}]
    (tmp_path / "step.json").write_text(json.dumps({"steps": steps, "bf16_bound": []}))
    lines = load_benchmark("floor_targets").report(tmp_path)
    bs1 = next(i for i, line in enumerate(lines) if line.startswith("long context (prompt 1900) bs 1 "))
    assert lines[bs1].split()[-1] == "met" and "0.450 ms (pdl)" in lines[bs1]
    assert "read floor: weights 1.02 GB + KV 0.11 GB" in lines[bs1 + 1] and "4.00 TB/s" in lines[bs1 + 1]
    assert "device per step (triton+pdl, ctx 1900)" in lines[bs1 + 2] and "0.620 ms" in lines[bs1 + 2]
    bs32 = next(i for i, line in enumerate(lines) if line.startswith("long context (prompt 1900) bs 32"))
    assert lines[bs32].split()[-1] == "MISSED" and "KV 3.60 GB" in lines[bs32 + 1]
    small = next(i for i, line in enumerate(lines) if line.startswith("small-0.6b bs 1 "))
    assert "not run" in lines[small] and "read floor" in lines[small + 1]
    assert "device per step (triton+pdl, ctx 64)" in lines[small + 2] and "0.560 ms" in lines[small + 2]
    assert not any(line.startswith("*") for line in lines)  # the rate was measured


def test_a_copy_rate_that_was_not_measured_is_marked_as_the_h200s(tmp_path: Path) -> None:
    (tmp_path / "bench-small").mkdir()
    (tmp_path / "bench-small" / "bench.json").write_text(json.dumps({"points": [{"batch_size": 1, "tpot_ms": 0.6}]}))
    lines = load_benchmark("floor_targets").report(tmp_path)
    floors = [line for line in lines if "read floor" in line]
    assert floors and all("4.24 TB/s*" in line for line in floors)
    assert [line for line in lines if line.startswith("*")] == [
        "* the H200's copy rate, not this card's: no bandwidth.json (decode_floor.sh's bandwidth section)"]


def test_the_kernels_target_reads_the_graph_replayed_count_over_the_eager_one(tmp_path: Path) -> None:
    # An eager step's attention splits its live context only: where the replayed graph's splits and adds the merge
    # kernel, the eager count is one short, so the graph's count is the one held to the bound when it was taken.
    eager = [{"model": "small-0.6b", "batch": 64, "kernels_per_layer": 6.0}]
    (tmp_path / "kernels.json").write_text(json.dumps(eager))
    report = load_benchmark("floor_targets").report
    [line] = [line for line in report(tmp_path) if line.startswith("kernels per layer")]
    assert line.startswith("kernels per layer (eager), small-0.6b bs 64") and line.split()[-1] == "met"
    graph = [{"model": "small-0.6b", "batch": 64, "kernels_per_layer": 8, "layer": [{"kernel": "_decode_kernel"}]}]
    (tmp_path / "graph_kernels.json").write_text(json.dumps(graph))
    [line] = [line for line in report(tmp_path) if line.startswith("kernels per layer")]
    assert line.startswith("kernels per layer (graph), small-0.6b bs 64") and line.split()[-1] == "MISSED"
