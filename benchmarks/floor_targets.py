"""The targets of the decode-at-the-weight-floor work against what benchmarks/decode_floor.sh measured.

    python3 benchmarks/floor_targets.py OUTDIR

Reads OUTDIR/bench-*/bench.json, graph_kernels.json (else kernels.json), bandwidth.json, checks.json and
step.json (whatever exists) and prints one line per target: the figure, the bound, met or missed; under each TPOT
target the step's read floor (the weights a decode step reads, the LM head included and the embedding table not, and
the KV cache at the run's mean context, over the copy rate of bandwidth.json, else DEFAULT_COPY_RATE) and, from
step.json, the step's device time replayed as a graph; and each projection kernel's achieved bandwidth against the
copy rate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from corelib.config.schema import CorelibConfig
from corelib.models.registry import model_shape
from corelib.models.weight_map import weight_map
from corelib.startup.compose import compose_config
from corelib.startup.limits import kv_cache_bytes

# (bench run, batch size, TPOT bound in ms, what the target is)
TPOT_TARGETS = [
    ("llama-1b", 1, 0.70, "Llama-3.2-1B shape bs 1"),
    ("llama-1b", 32, 0.95, "Llama-3.2-1B shape bs 32"),
    ("small", 1, 0.42, "small-0.6b bs 1"),
    ("small", 32, 0.85, "small-0.6b bs 32"),
    ("small", 128, 1.3, "small-0.6b bs 128"),
    ("llama-8b", 1, 3.9, "llama-8b tp=1 bs 1"),
    ("llama-8b", 32, 4.3, "llama-8b tp=1 bs 32"),
    ("long", 1, 0.5, "long context (prompt 1900) bs 1"),
    ("long", 32, 1.6, "long context (prompt 1900) bs 32"),
]
# What each bench run of benchmarks/decode_floor.sh decodes: (model preset, prompt tokens); every run decodes
# OUTPUT_LEN new tokens a request (conf/bench/h200.yaml), so its mean context is the prompt and half of them.
RUNS = {"llama-1b": ("llama-1b", 32), "small": ("small-0.6b", 32), "llama-8b": ("llama-8b", 32),
        "long": ("small-0.6b", 1900)}
OUTPUT_LEN = 128
SHORT_CONTEXT = 256  # tokens: a step.json row at most this long stands for the short-prompt runs
DEFAULT_COPY_RATE = 4.24  # TB/s: the H200's device-to-device copy rate measured by benchmarks/kernels.py
KERNELS_PER_LAYER = 6.0
OCCUPANCY = 0.99


@dataclass(frozen=True)
class ReadFloor:
    """What a decode step must read from device memory, and how long that takes at the copy rate."""

    weight_bytes: int
    kv_bytes: int
    ms: float


def read_floor(model: str, batch: int, prompt: int, copy_rate_tb_s: float, new_tokens: int = OUTPUT_LEN) -> ReadFloor:
    """What a decode step of ``batch`` requests of ``model`` reads at their mean context: every weight but the
    embedding table, whose rows it gathers, and their KV cache."""
    config = OmegaConf.to_object(compose_config([f"model={model}"]))
    if not isinstance(config, CorelibConfig):
        raise TypeError("the composed config is not a CorelibConfig")
    shape = model_shape(config.model)
    weights = weight_map(shape).step_parameter_count() * shape.dtype.itemsize
    _, per_block, _ = kv_cache_bytes(config)
    kv = round(batch * (prompt + new_tokens / 2) * per_block / config.engine.block_size)
    return ReadFloor(weights, kv, (weights + kv) / (copy_rate_tb_s * 1e12) * 1e3)


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _best(points: list[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """The point of this batch size with the PDL the engine chose by default (auto), else any."""
    found = [p for p in points if p["batch_size"] == batch]
    return max(found, key=lambda p: p.get("pdl", False)) if found else None


def _line(what: str, figure: str, bound: str, met: bool | None) -> str:
    verdict = "-" if met is None else "met" if met else "MISSED"
    return f"{what:<42} {figure:>22} {bound:>12} {verdict:>7}"


def _device_time(rows: list[dict[str, Any]], model: str, batch: int, prompt: int) -> str | None:
    """The device time of one decode step replayed as a graph (``decode_step.py``), its fastest build but the
    reference ops, at a context like the run's (a long one for a long prompt), where step.json has it."""
    long = prompt > SHORT_CONTEXT
    found = [row for row in rows if row["model"] == model and row["batch"] == batch
             and (row["context"] >= prompt if long else row["context"] <= SHORT_CONTEXT)]
    if not found:
        return None
    row = found[0]
    builds = {key.removesuffix("_us"): value for key, value in row.items()
              if key.endswith("_us") and key != "reference_us"}
    if not builds:
        return None
    build = min(builds, key=lambda name: builds[name])
    return _line(f"  device per step ({build}, ctx {row['context']})",
                 f"{builds[build] / 1e3:.3f} ms", "", None)


def report(out: Path) -> list[str]:
    lines = [f"{'target':<42} {'measured':>22} {'bound':>12} {'verdict':>7}"]
    benches = {p.parent.name.removeprefix("bench-"): _load(p)["points"] for p in sorted(out.glob("bench-*/bench.json"))}
    bandwidth = _load(out / "bandwidth.json")
    rate = bandwidth["copy_rate_tb_per_s"] if bandwidth else DEFAULT_COPY_RATE
    # Without bandwidth.json the floors use the H200's rate, whatever the card: marked, and said once below them
    rate_shown = f"{rate:.2f} TB/s" + ("" if bandwidth else "*")
    step = _load(out / "step.json")
    for run, batch, bound, what in TPOT_TARGETS:
        model, prompt = RUNS[run]
        floor = read_floor(model, batch, prompt, rate)
        read = f"weights {floor.weight_bytes / 1e9:.2f} GB + KV {floor.kv_bytes / 1e9:.2f} GB"
        below = [_line(f"  read floor: {read}", f"{floor.ms:.3f} ms", rate_shown, None)]
        device = _device_time(step["steps"] if step else [], model, batch, prompt)
        if device is not None:
            below.append(device)
        point = _best(benches.get(run, []), batch)
        if point is None:
            lines += [_line(what, "not run", f"<= {bound} ms", None), *below]
            continue
        pdl = "pdl" if point.get("pdl") else "no pdl"
        lines += [_line(what, f"{point['tpot_ms']:.3f} ms ({pdl})", f"<= {bound} ms", point["tpot_ms"] <= bound),
                  *below]
        before = _best(benches.get(f"{run}-before", []), batch)
        if before is not None:
            lines.append(_line("  before (previous release)", f"{before['tpot_ms']:.3f} ms", "", None))
        plain = [p for p in benches.get(run, []) if p["batch_size"] == batch and not p.get("pdl")]
        if point.get("pdl") and plain:
            lines.append(_line("  the same with PDL off", f"{plain[0]['tpot_ms']:.3f} ms", "", None))
    if not bandwidth:
        lines.append("* the H200's copy rate, not this card's: no bandwidth.json (decode_floor.sh's bandwidth section)")
    occupancies = [(run, p["batch_size"], p["occupancy"]) for run, points in benches.items() for p in points
                   if p["batch_size"] <= 64 and p.get("occupancy") is not None and not run.endswith("-before")]
    if occupancies:
        run, batch, lowest = min(occupancies, key=lambda o: o[2])
        lines.append(_line("occupancy at bs 1-64 (lowest)", f"{100 * lowest:.1f} % ({run} bs {batch})",
                           f">= {100 * OCCUPANCY:.0f} %", lowest >= OCCUPANCY))
    # The graph-replayed step's count where it was taken (kernels.py --graph): an eager step's attention splits its
    # live context only, so its count can leave out the merge kernel the replayed step runs.
    graph = _load(out / "graph_kernels.json")
    for row in graph or _load(out / "kernels.json") or []:
        how = "graph" if graph else "eager"
        lines.append(_line(f"kernels per layer ({how}), {row['model']} bs {row['batch']}",
                           f"{row['kernels_per_layer']:.1f}", f"<= {KERNELS_PER_LAYER:.0f}",
                           row["kernels_per_layer"] <= KERNELS_PER_LAYER))
    checks = _load(out / "checks.json")
    if checks:
        for row in checks["pdl"]:
            lines.append(_line(f"PDL on = off, fp32, bs {row['batch']}, {row['repeats']}x{row['steps']} steps",
                               "equal" if row["all_equal"] else "differ", "equal",
                               row["all_equal"] and row["pdl_enabled"]))
        fused = checks["fused_vs_reference"]
        lines.append(_line(f"fp32 fused tokens = reference, bs {fused['batch']}x{fused['steps']}",
                           "equal" if fused["equal"] else "differ", "equal", fused["equal"]))
    if bandwidth:
        for row in bandwidth["kernels"]:
            lines.append(_line(f"{row['model']} bs {row['batch']} {row['projection']} ({row['kernel']})",
                               f"{row['tb_per_s']:.2f} TB/s, {100 * row['of_copy_rate']:.0f} %",
                               f"{rate:.2f} TB/s", None))
    if step:
        for row in step["bf16_bound"]:
            baseline = row.get("reference_bf16_max_relative_error", float("nan"))
            lines.append(_line(f"bf16 logits vs fp32, {row['model']} (bf16 reference ops)",
                               f"{row['max_relative_error']:.1e} ({baseline:.1e})", "stated", None))
        for row in step["steps"]:
            same = all(value for key, value in row.items() if key.endswith("_same")) and row["pdl_equals_plain"]
            lines.append(_line(f"graph replays bit-identical, {row['model']} bs {row['batch']}",
                               "yes" if same else "no", "yes", same))
    return lines


def main() -> None:
    for line in report(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(line)


if __name__ == "__main__":
    main()
