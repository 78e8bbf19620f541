"""A step's grammar masks on the host: llguidance's thread pool, with each row's matcher a copy of one template
or of one of several independent templates (the engine keeps one per mask thread and hands them out in turn).

Rows are brought to their states by random walks through allowed tokens (the quote taken a quarter of the
times it is allowed, as a trained model closes its strings), over the small-0.6b-sized byte-level vocabulary of
``json_mode.py`` with corelib's slices, for the two schemas of that script; each timing is one step's masks, 32
rows, on fresh copies (a matcher keeps the mask of its state), the median (and the slowest) over the trials
after two, every template's lexer warmed through every walk first. For each thread count (1, 2, 4, 8 and
``mask_threads()``, or those given): the rows copied from one template, and from as many templates as threads,
handed out in turn (the engine's order) or grouped by template (copies of one template wait for each other's
lexer, so a thread that takes neighbouring rows waits less); with one thread, also the rows computed one by one
on the calling thread (each call lets go of the GIL and takes it back).

    python3 benchmarks/mask_threads.py [--threads N ...] [WORKDIR]
"""

from __future__ import annotations

import importlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from corelib.engine.structured import grammar_of, llguidance_module, mask_threads, parser_limits
from corelib.support.structured import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent))
json_mode: Any = importlib.import_module("json_mode")  # a sibling script: its vocabulary and schemas

ROWS = 32
TRIALS = 8


def walks(template: Any, quote: int, rng: random.Random) -> list[list[list[int]]]:
    """Per trial, per row: the tokens that bring a fresh matcher to a state of a random walk."""
    words = (json_mode.VOCAB + 31) // 32
    scratch = np.zeros(words, dtype=np.int32)
    trials = []
    for _ in range(TRIALS):
        rows = []
        for _ in range(ROWS):
            probe, walk = template.deep_copy(), []
            for _ in range(rng.randint(0, 40)):
                probe.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
                bits = np.unpackbits(scratch.view(np.uint8), bitorder="little")[: json_mode.VOCAB]
                allowed = np.flatnonzero(bits)
                token = quote if bits[quote] and rng.random() < 0.25 else int(allowed[rng.randrange(len(allowed))])
                if token == 1 or not probe.consume_token(token) or probe.is_stopped():
                    break
                walk.append(token)
            rows.append(walk)
        trials.append(rows)
    return trials


def walked(template: Any, walk: list[int]) -> Any:
    """A fresh copy of ``template`` that has taken the tokens of ``walk``."""
    matcher = template.deep_copy()
    for token in walk:
        matcher.consume_token(token)
    return matcher


def main() -> None:
    import argparse

    from tokenizers import Tokenizer

    from corelib.engine.structured import SLICES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="*", help="thread counts (default: 1, 2, 4, 8, mask_threads())")
    parser.add_argument("workdir", type=Path, nargs="?", default=Path("outputs/mask_threads"))
    args = parser.parse_args()
    ll = llguidance_module()
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / "tokenizer.json"
    if not path.exists():
        json_mode.write_tokenizer(path)
    tokenizer = ll.LLTokenizer(path.read_text(), n_vocab=json_mode.VOCAB, eos_token=[1], slices=list(SLICES))
    [quote] = Tokenizer.from_file(str(path)).encode('"').ids
    default = mask_threads()
    counts = sorted(set(args.threads or [n for n in (1, 2, 4, 8) if n <= default] + [default]))
    masks = np.zeros((ROWS, (json_mode.VOCAB + 31) // 32), dtype=np.int32)
    print(f"cpus {os.cpu_count()}, mask threads {default}; ms for one step's masks of {ROWS} rows (median)")
    for name, schema in (("unbounded strings", json_mode.typical(json_mode.SCHEMA)),
                         ("strings of maxLength 24 and 8", json_mode.SCHEMA)):
        grammar = grammar_of(StructuredOutputsParams.of({"json": schema}))
        templates = [ll.LLMatcher(tokenizer, grammar, limits=parser_limits()) for _ in range(max(counts))]
        trials = walks(templates[0], quote, random.Random(1))
        for template in templates:  # every template's lexer warmed through every walk first
            for rows in trials:
                for walk in rows:
                    walked(template, walk).unsafe_compute_mask_ptr(masks.ctypes.data, masks.strides[0])
        print(f"{name}:")
        for count in counts:
            executor = ll.LLExecutor(num_threads=count)
            results: dict[str, str] = {}
            cases = [("one template", 1, False)]
            if count == 1:  # no hand-off to a pool thread, but a GIL round trip per row
                cases += [("one template, on the calling thread", 1, False)]
            else:
                cases += [(f"{count} templates in turn", count, False), (f"{count} templates grouped", count, True)]
            for label, kept, grouped in cases:
                times = []
                for rows in trials:
                    matchers = []
                    for row, walk in enumerate(rows):
                        matchers.append((row % kept, walked(templates[row % kept], walk), row))
                    if grouped:
                        matchers.sort(key=lambda entry: entry[0])
                    began = time.perf_counter()
                    if label.endswith("calling thread"):
                        for _, matcher, row in matchers:
                            matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks.strides[0])
                    else:
                        executor.unsafe_compute_mask_ptr([(matcher, row) for _, matcher, row in matchers],
                                                         masks.ctypes.data, masks.strides[0], ROWS)
                    times.append((time.perf_counter() - began) * 1e3)
                late = sorted(times[2:])
                results[label] = f"{statistics.median(late):.3f} (slowest {late[-1]:.3f})"
            print(f"  {count} thread{'s' if count > 1 else ''}: " +
                  "; ".join(f"{key} {value}" for key, value in results.items()))


if __name__ == "__main__":
    main()
