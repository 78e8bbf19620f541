"""Where a step of prompt chunks beside decode rows spends its time, on the device and on the host.

Decoders run with long outputs; then long prompts arrive and are fed in chunks under the step's
token budget beside them. Each step's wall time is taken, and a torch.profiler trace of a few
mixed steps gives the device kernels by total time (and by count), so a slow op names itself.

    python3 benchmarks/mixed_step.py model=small-0.6b backend=cuda --decoders 32 --prompt 1500 --budget 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from corelib.engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cprofile", action="store_true", help="also a cProfile of the host over 6 more mixed steps")
    args = parser.parse_args()
    overrides = [*args.overrides, "engine.chunked_prefill=on", f"engine.max_num_batched_tokens={args.budget}",
                 f"engine.max_num_seqs={args.decoders + args.prompts}", "model.max_model_len=4096"]
    params = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=args.temperature, seed=1)
    with Engine.from_overrides(overrides) as engine:
        vocab = engine.vocab_size
        for i in range(args.decoders):
            engine.add_request([(i * 7 + j) % (vocab - 2) + 2 for j in range(16)], params)
        for _ in range(24):  # the decoders' prompts done: decode steps alone
            engine.step()
        decode_ms = timed(engine, 32)
        for i in range(args.prompts * (2 if args.cprofile else 1)):
            engine.add_request([(i * 131 + j * 17) % (vocab - 2) + 2 for j in range(args.prompt)],
                               SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profile:
            mixed_ms = timed(engine, 6)
        table = profile.key_averages().table(sort_by="cuda_time_total", row_limit=args.top)
        host = ""
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            host_ms = timed(engine, 6)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
            host = f"mixed steps under cProfile: {', '.join(f'{t:.2f}' for t in host_ms)} ms\n{text.getvalue()}"
        print(f"decode steps alone: median {statistics.median(decode_ms):.3f} ms per step")
        print(f"mixed steps ({args.budget}-token budget, {args.decoders} decode rows): "
              f"{', '.join(f'{t:.2f}' for t in mixed_ms)} ms")
        print(table)
        print(host)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"decode_ms": decode_ms, "mixed_ms": mixed_ms, "table": table, "host": host}, f, indent=1)


def timed(engine: Engine, steps: int) -> list[float]:
    """Wall time of each of ``steps`` engine steps, the device synchronized after each."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return times


if __name__ == "__main__":
    main()
