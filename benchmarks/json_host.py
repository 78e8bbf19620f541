"""The host's work in a JSON-mode step, beside a plain step's, in one run: where a structured step's time goes.

    python benchmarks/json_host.py --backend npu --rounds 2

A JSON step is the host's between two device steps: once a step's tokens are back, each grammar
takes its token (post-process), the next step's masks are computed on the mask thread (masks)
while the loop schedules and fills the step after it, the loop waits for them (masks' wait),
applies the string bounds counted beside the grammar (bounds), and only then queues that step's
sampling and submits the next one. This times each of those calls (medians per step, µs; the
masks on their own thread) for the schemas of ``json_mode.py`` and plain
decoding with the same settings, alternating, on json_mode.py's checkpoint (``--tiny``: two narrow
layers, the default here, so that the emulator's device work stays small beside the host's).
The rows' device work is not timed: ``json_mode.py`` gives the TPOT ratio on a GPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from json_mode import SCHEMA, VOCAB, Timers, typical, write_checkpoint

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.engine.step_masks import MaskThread, StepMasks

# Each call timed: on the engine's part named, or on a class. The masks are computed on the mask thread while the
# loop schedules and fills the next step; "masks' wait" is the loop's wait for them, "bounds" the counted strings'.
CALLS: dict[str, tuple[str | type, str]] = {
    "schedule": ("scheduler", "schedule"), "fill": ("builder", "fill"), "masks": (StepMasks, "compute"),
    "masks' wait": (MaskThread, "result"), "bounds": (StepMasks, "finish"),
    "post-process": ("scheduler", "postprocess")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="npu")
    parser.add_argument("--workdir", type=Path, help="where the checkpoint is written once (default: "
                        "outputs/json_mode_tiny, or json_mode.py's outputs/json_mode_model with --full)")
    parser.add_argument("--full", action="store_true", help="json_mode.py's full small-0.6b shape, not --tiny's")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2, help="plain and JSON runs of each schema, alternating")
    parser.add_argument("overrides", nargs="*", help="more engine keys (key=value)")
    args = parser.parse_args()
    workdir = args.workdir or Path("outputs/json_mode_model" if args.full else "outputs/json_mode_tiny")
    model = write_checkpoint(workdir, not args.full)
    prompts = [[0, *random.Random(i).sample(range(300, VOCAB), 24)] for i in range(args.requests)]
    with Engine.from_overrides([f"backend={args.backend}", f"model.path={model}", "model.dtype=auto",
                                f"engine.max_num_seqs={args.concurrency}", *args.overrides]) as engine:
        if engine.tokenizer is None:
            raise SystemExit("the checkpoint has no tokenizer")
        [quote] = engine.tokenizer.encode('"', add_special_tokens=False)
        timers = Timers(tuple(CALLS))
        for label, (owner, method) in CALLS.items():
            timers.wrap(getattr(engine.core, owner) if isinstance(owner, str) else owner, method, label)
        print(f"requests {args.requests}, concurrency {args.concurrency}, backend {args.backend}; "
              f"median µs per call (calls)")
        for case, schema in (("unbounded strings", typical(SCHEMA)), ("strings of maxLength 24 and 8", SCHEMA)):
            bias = {quote: 8.0} if schema is not SCHEMA else None
            runs = {"plain": [SamplingParams(max_tokens=args.max_tokens * 3 // 4, temperature=0.0, seed=i,
                                             logit_bias=bias, ignore_eos=True) for i in range(args.requests)],
                    "JSON": [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=i, logit_bias=bias,
                                            structured_outputs={"json": schema}) for i in range(args.requests)]}
            for params in runs.values():  # compiled, warmed, graphs captured
                engine.generate(prompts[: args.concurrency], params[: args.concurrency])
            for round_ in range(1, args.rounds + 1):
                for name, params in runs.items():
                    timers.take()
                    engine.generate(prompts, params)
                    figures = ", ".join(f"{call} {statistics.median(times) * 1e6:.0f} ({len(times)})"
                                        for call, times in timers.calls.items() if times)
                    print(f"{case}, round {round_}, {name}: {figures}")


if __name__ == "__main__":
    main()
