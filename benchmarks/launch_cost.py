"""What one launch costs the host, against what an eager step with prompt tokens makes of it.

Times, with the device left to run (no synchronization inside the loop), the host's side of:
a Triton kernel of the fused ops (RMSNorm over a step's tokens), a cuBLAS product (F.linear),
a torch elementwise op, and one decoder layer of the model run eagerly over the same tokens.
Per launch, then per layer: the difference is the Python around the launches.

    python3 benchmarks/launch_cost.py model=small-0.6b backend=cuda --tokens 544
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from corelib.engine import Engine
from corelib.models.base import StepBatch
from corelib.models.llama import decoder_layer
from corelib.ops import PagedAttention


def host_us(fn: Callable[[], Any], repeats: int, synchronize: Callable[[], None]) -> float:
    """The mean host time of ``fn`` over ``repeats`` calls (after 10 warm ones), µs."""
    for _ in range(10):
        fn()
    synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = (time.perf_counter() - started) / repeats * 1e6
    synchronize()
    return host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tokens", type=int, default=544)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with Engine.from_overrides([*args.overrides, "engine.mixed_graphs=off", "engine.graph=off"]) as engine:
        runner = engine.local_runner
        ops, model, device = runner.ops, runner.model, runner.device.torch_device
        sync = runner.device.synchronize
        weights = model.weights  # type: ignore[attr-defined]
        shape = weights.shape
        tokens = args.tokens
        h = torch.randn(tokens, shape.hidden_size, device=device, dtype=shape.dtype)
        layer = weights.layers[0]
        result: dict[str, float] = {
            "triton rms_norm": host_us(lambda: ops.rms_norm(h, layer.input_norm, shape.rms_norm_eps), args.repeats,
                                       sync),
            "cublas F.linear": host_us(lambda: torch.nn.functional.linear(h, layer.qkv), args.repeats, sync),
            "torch add": host_us(lambda: h + h, args.repeats, sync),
        }
        state = runner.state
        k_cache, v_cache = state.layer(0)  # type: ignore[attr-defined]
        rows = 4
        per_row = tokens // rows
        starts = torch.arange(0, tokens + 1, per_row, device=device)[: rows + 1]
        starts[-1] = tokens
        width = -(-tokens // runner.layout.block_size)
        tables = torch.arange(1, 1 + rows * width, device=device, dtype=torch.int32).view(rows, width)
        lengths = (starts[1:] - starts[:-1]).to(torch.int64)
        attention = PagedAttention(tables % (runner.layout.num_blocks - 1) + 1, lengths, runner.layout.block_size,
                                   starts, int(lengths.max()))
        positions = torch.cat([torch.arange(int(n), device=device) for n in lengths])
        slots = torch.zeros(tokens, dtype=torch.int64, device=device)
        batch = StepBatch(torch.zeros(tokens, dtype=torch.int64, device=device), positions, slots, attention,
                          torch.arange(rows, device=device), starts[1:] - 1)
        result["decoder layer (eager)"] = host_us(
            lambda: decoder_layer(layer, shape, h, None, batch, k_cache, v_cache, weights.cos_sin, ops,
                                  weights.all_reduce), max(args.repeats // 10, 10), sync)
    for name, value in result.items():
        print(f"{name:>24}: {value:8.1f} µs of host time per call")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
