"""JSON mode's TPOT against plain decoding, in one run, on a small-0.6b-shaped model with random weights.

    python benchmarks/json_mode.py --backend cuda --requests 100 --concurrency 32

Writes a checkpoint of the small-0.6b shape (random bf16 weights) with a byte-level tokenizer of
151,936 tokens (Qwen's vocabulary size; the grammar's mask work grows with it) into --workdir,
then runs the same prompts on one engine for two schemas, each beside a plain run with the same
sampling settings (ignore_eos, as many tokens as JSON mode gave on average). Every JSON output must
parse and match the schema.

- Unbounded strings (what OpenAI's strict structured outputs accept): random weights never close
  a string, so these requests bias the quote token (--quote-bias) as a trained model would close it.
- Strings of maxLength 24 and 8: llguidance's lexer is in a new state at every character of such
  a string, so no mask is reused: each one walks the whole vocabulary (0.6-4 ms a row on one core).
  corelib counts those bounds beside the grammar (``corelib.engine.string_bounds``); the same
  schema runs a second time with the bounds left to llguidance's grammar, for comparison.

Prints each run's mean TPOT and their ratio (the target: at most 1.15), and where the steps went
(the host's work per step, the device's busy time and idle gaps, the grammar's calls). Needs the structured
extra (llguidance); with no network, install its wheel (llguidance-*-cp39-abi3-manylinux_*.whl,
one file for every Python 3.9+) before running.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint

VOCAB = 151_936
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}


def write_checkpoint(directory: Path, tiny: bool) -> Path:
    """The small-0.6b shape (``tiny``: two narrow layers, to try the script on a CPU) as a checkpoint, written
    once, with a synthetic byte-level tokenizer."""
    if (directory / "tokenizer.json").exists():
        return directory
    shape: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=64, torch_dtype="bfloat16")
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    config = tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB, max_position_embeddings=2048,
                            rope_theta=1_000_000.0, **shape)
    write_random_checkpoint(directory, config)
    write_tokenizer(directory / "tokenizer.json")
    return directory


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE vocabulary of VOCAB tokens: the 256 bytes, then words, numbers and JSON punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(0)
    vocab = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    seen = set(vocab)
    letters, pieces = "abcdefghijklmnopqrstuvwxyz", ['"', '":', '",', '{"', "}", "},", "[", "],", 'Ġ"', "Ġ{", "Ċ"]
    while len(vocab) < VOCAB:
        kind = rng.random()
        if kind < 0.75:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            word = ("Ġ" if rng.random() < 0.6 else "") + (word.capitalize() if rng.random() < 0.2 else word)
        elif kind < 0.85:
            word = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        else:
            word = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(vocab)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path))


def check(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["name", "age", "role", "active", "tags"], text
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["role"] in ("admin", "user", "guest")
    assert isinstance(value["active"], bool) and isinstance(value["tags"], list) and len(value["tags"]) <= 3


def mean_tpot(outputs: list[RequestOutput]) -> float:
    return statistics.fmean(o.tpot_ms for o in outputs if o.tpot_ms is not None)


class Timers:
    """Wall time inside wrapped host calls (the masks of a step, each request taking its token, ...): each call's
    seconds kept under its label."""

    def __init__(self, labels: tuple[str, ...] = ("masks", "advance", "new matcher")) -> None:
        self.calls: dict[str, list[float]] = {label: [] for label in labels}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        into = self.calls.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - started)

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Each label's seconds in all since the last take; the calls are forgotten."""
        taken = {label: sum(calls) for label, calls in self.calls.items()}
        for calls in self.calls.values():
            calls.clear()
        return taken


def profile(engine: Engine, since: int, timers: dict[str, float]) -> str:
    """Where a run's steps went: the host's work per step (medians) and the device's (busy, idle gap)."""
    steps = engine.core.metrics.steps_since(since)
    hosts = [s.host for s in steps if s.host is not None]
    busy = [s.busy_ms for s in steps if s.busy_ms is not None]
    gaps = [s.gap_ms for s in steps if s.gap_ms is not None]

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    paths = {path: sum(1 for s in steps if s.path == path) for path in ("async", "sync")}
    grammar = ", ".join(f"{name} {seconds * 1e3 / max(len(steps), 1):.3f} ms" for name, seconds in timers.items())
    return (f"{len(steps)} steps ({paths['async']} async, {paths['sync']} sync); host per step (median µs): "
            f"schedule {median([h.schedule_us for h in hosts]):.0f}, pack {median([h.pack_us for h in hosts]):.0f}, "
            f"post-process {median([h.postprocess_us for h in hosts]):.0f}; device busy {median(busy):.3f} ms, "
            f"idle gap {median(gaps):.3f} ms (medians); grammar per step (mean): {grammar}")


def typical(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without the strings' length bounds: what OpenAI's strict structured outputs accept."""
    properties = json.loads(json.dumps(schema["properties"]))
    properties["name"].pop("maxLength")
    properties["tags"]["items"].pop("maxLength")
    return {**schema, "properties": properties}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/json_mode_model"))
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32, help="engine.max_num_seqs")
    parser.add_argument("--temperature", type=float, default=0.0, help="the same for every run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--quote-bias", type=float, default=8.0,
                        help="logit bias of the quote token in the unbounded schema's requests: random weights "
                             "never close a string, a trained model does")
    parser.add_argument("--tiny", action="store_true", help="two narrow layers: try the script on a CPU")
    parser.add_argument("overrides", nargs="*", help="more engine keys (key=value)")
    args = parser.parse_args()
    model = write_checkpoint(args.workdir, args.tiny)
    prompts = [[0, *random.Random(i).sample(range(300, VOCAB), 24)] for i in range(args.requests)]
    with Engine.from_overrides([f"backend={args.backend}", f"model.path={model}", "model.dtype=auto",
                                f"engine.max_num_seqs={args.concurrency}", *args.overrides]) as engine:
        warm = SamplingParams(max_tokens=8, temperature=args.temperature, ignore_eos=True)
        engine.generate(prompts[: args.concurrency], [warm] * args.concurrency)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise SystemExit("the checkpoint has no tokenizer")
        [quote] = tokenizer.encode('"', add_special_tokens=False)
        # The bounded schema twice: its bounds counted beside the grammar (corelib's default), then left to it.
        # Both schemas again with a step's masks computed the other way (the mask thread beside the next step's
        # packing, or the loop's thread) than the engine chose for this machine.
        chosen = engine.core.masks_beside_packing
        ways = {True: "on the mask thread, beside the next step's packing", False: "on the loop's thread"}
        other = ways[not chosen]
        cases = {"unbounded strings": (typical(SCHEMA), {quote: args.quote_bias}, True, chosen),
                 "strings of maxLength 24 and 8": (SCHEMA, None, True, chosen),
                 "strings of maxLength 24 and 8, the bounds in llguidance's grammar": (SCHEMA, None, False, chosen),
                 f"unbounded strings, the masks {other}": (typical(SCHEMA), {quote: args.quote_bias}, True, not chosen),
                 f"strings of maxLength 24 and 8, the masks {other}": (SCHEMA, None, True, not chosen)}
        from corelib.engine import step_masks
        from corelib.engine import structured as grammar_module

        timers = Timers(("masks", "bounds", "masks' wait", "advance", "new matcher"))
        timers.wrap(step_masks.StepMasks, "compute", "masks")  # on the mask thread, beside the next step's packing
        timers.wrap(step_masks.StepMasks, "finish", "bounds")  # the counted strings' bounds, on the loop's thread
        timers.wrap(step_masks.MaskThread, "result", "masks' wait")  # the loop waiting for the mask thread
        timers.wrap(grammar_module.GrammarState, "advance", "advance")
        timers.wrap(engine.structured, "state", "new matcher")
        print(f"requests {args.requests}, concurrency {args.concurrency}, backend {args.backend}; the masks "
              f"{ways[chosen]}")
        for name, (schema, bias, counted, beside) in cases.items():
            engine.structured.count_string_bounds = counted
            engine.core.masks_beside_packing = beside
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                     logit_bias=bias, structured_outputs={"json": schema})
                      for i in range(args.requests)]
            engine.generate(prompts[:2], params[:2])  # the grammar compiled, llguidance's tokenizer built, here
            timers.take()
            since = engine.core.metrics.num_steps
            started = time.perf_counter()
            structured = engine.generate(prompts, params)
            json_s = time.perf_counter() - started
            json_profile = profile(engine, since, timers.take())
            valid = 0
            for output in structured:
                try:
                    check(output.outputs[0].text)
                    valid += 1
                except (ValueError, AssertionError) as error:
                    print(f"invalid: {error}")
            tokens = round(statistics.fmean(len(o.outputs[0].token_ids) for o in structured))
            plain_params = [SamplingParams(max_tokens=max(tokens, 2), temperature=args.temperature, seed=i,
                                           logit_bias=bias, ignore_eos=True) for i in range(args.requests)]
            since = engine.core.metrics.num_steps
            started = time.perf_counter()
            plain = engine.generate(prompts, plain_params)
            plain_s = time.perf_counter() - started
            plain_profile = profile(engine, since, timers.take())
            json_tpot, plain_tpot = mean_tpot(structured), mean_tpot(plain)
            print(f"== JSON schema, {name}: {tokens} tokens per request on average, "
                  f"valid JSON outputs: {valid}/{len(structured)}")
            print(f"plain decoding: TPOT {plain_tpot:.3f} ms  ({plain_s:.2f} s)")
            print(f"JSON schema:    TPOT {json_tpot:.3f} ms  ({json_s:.2f} s)")
            print(f"ratio: {json_tpot / plain_tpot:.3f} (target <= 1.15)")
            print(f"plain: {plain_profile}")
            print(f"JSON:  {json_profile}")


if __name__ == "__main__":
    main()
