"""Penalties on a GPU: inside the captured decode graphs, the reference's tokens, and what they cost per step.

The presence, frequency and repetition penalties run in the sampled decode graphs (the token
counts are scattered and gathered on the device, by state index). This checks, on CUDA with
graphs, async handoff and the fused ops as startup picks them, that penalized requests (greedy
and sampled, mixed with plain ones in one batch) get exactly the tokens of the plain reference
(float32, a full forward per token), then times TPOT for greedy, sampled, and sampled with
penalties at a few batch sizes. It prints a short table; ``--out`` also writes it as JSON.

    python3 benchmarks/penalties_h200.py                      # small-0.6b, bs 1 and 32
    python3 benchmarks/penalties_h200.py --batch 1 8 64 --out penalties.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import reference_sampled, seeded_weights

from corelib.engine import Engine, SamplingParams

CHECK = ["backend=cuda", "backend.runtime=native", "engine.async_token_handoff=on", "model.dtype=float32",
         "model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4",
         "model.intermediate_size=1536", "engine.max_num_seqs=8"]
PROMPTS = [[5, 6, 7, 5, 5], [100] * 6, list(range(30, 42)), [9, 8], [200, 201, 200], [3, 4, 5, 6]]
PARAMS = [
    SamplingParams(max_tokens=40, repetition_penalty=1.6, ignore_eos=True),
    SamplingParams(max_tokens=40, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, top_k=30, seed=11, frequency_penalty=1.2, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.1, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=40, presence_penalty=-2.0, frequency_penalty=-0.5, ignore_eos=True),
]
KINDS = {
    "greedy": SamplingParams(max_tokens=1, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
    "sampled+penalties": SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True,
                                        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
}


def check_tokens() -> list[str]:
    """Mismatches between the engine (graphs on the GPU) and the reference; empty when every row agrees."""
    weights = seeded_weights(CHECK)  # the engine's random weights, on the CPU
    with Engine.from_overrides(CHECK) as engine:
        outputs = engine.generate(PROMPTS, PARAMS)
        graph_steps = engine.metrics(1.0)["graph_steps"]
    problems = [f"prompt {p}: {params}" for p, params, o in zip(PROMPTS, PARAMS, outputs, strict=True)
                if o.output_token_ids != reference_sampled(weights, p, params)]
    if not graph_steps:
        problems.append("no decode step replayed a graph")
    return problems


def tpot_ms(model: str, batch: int, params: SamplingParams, tokens: int) -> float:
    overrides = ["backend=cuda", "backend.runtime=native", f"model={model}", "engine.async_token_handoff=on",
                 f"engine.max_num_seqs={max(batch, 1)}"]
    with Engine.from_overrides(overrides) as engine:
        prompts = [[7 + i, 8, 9, 10] * 8 for i in range(batch)]
        engine.generate(prompts, params.replace(max_tokens=8))  # warm-up: graphs captured, kernels loaded
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params.replace(max_tokens=tokens))
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    problems = check_tokens()
    print(f"penalties in the graphs give the reference's tokens: {'yes' if not problems else 'NO'}")
    for problem in problems:
        print(f"  mismatch: {problem}")
    rows = []
    print(f"{'batch':>5} | " + " | ".join(f"{kind:>18}" for kind in KINDS) + "   (TPOT, ms)")
    for batch in args.batch:
        figures = {kind: tpot_ms(args.model, batch, params, args.tokens) for kind, params in KINDS.items()}
        rows.append({"batch": batch, **figures})
        print(f"{batch:>5} | " + " | ".join(f"{figures[kind]:>18.3f}" for kind in KINDS))
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "tokens_match": not problems, "problems": problems,
                                        "tpot_ms": rows}, indent=2) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
