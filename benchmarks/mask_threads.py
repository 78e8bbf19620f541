"""A step's grammar masks on the host: llguidance's thread pool, with each row's matcher a copy of one template
or of one of ``mask_threads()`` independent templates (as the engine now hands them out).

Rows are brought to their states by random walks through allowed tokens (the quote taken a quarter of the
times it is allowed, as a trained model closes its strings), over the small-0.6b-sized byte-level vocabulary of
``json_mode.py``, for the two schemas of that script; each timing is one step's masks, 32 rows, on fresh copies
(a matcher keeps the mask of its state), the median over the trials after two that warm the lexers.

    python3 benchmarks/mask_threads.py [WORKDIR]
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


def main() -> None:
    from tokenizers import Tokenizer

    ll = llguidance_module()
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/mask_threads")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "tokenizer.json"
    if not path.exists():
        json_mode.write_tokenizer(path)
    tokenizer = ll.LLTokenizer(path.read_text(), n_vocab=json_mode.VOCAB, eos_token=[1])
    [quote] = Tokenizer.from_file(str(path)).encode('"').ids
    threads = mask_threads()
    masks = np.zeros((ROWS, (json_mode.VOCAB + 31) // 32), dtype=np.int32)
    print(f"cpus {os.cpu_count()}, mask threads {threads}; ms for one step's masks of {ROWS} rows (median)")
    for name, schema in (("unbounded strings", json_mode.typical(json_mode.SCHEMA)),
                         ("strings of maxLength 24 and 8", json_mode.SCHEMA)):
        grammar = grammar_of(StructuredOutputsParams.of({"json": schema}))
        one = ll.LLMatcher(tokenizer, grammar, limits=parser_limits())
        pool = [ll.LLMatcher(tokenizer, grammar, limits=parser_limits()) for _ in range(threads)]
        trials = walks(one, quote, random.Random(1))
        results = {}
        for label, templates in (("one template", [one]), (f"{threads} templates", pool)):
            for count in sorted({1, threads}):
                executor = ll.LLExecutor(num_threads=count)
                times = []
                for rows in trials:
                    matchers = []
                    for row, walk in enumerate(rows):
                        matcher = templates[row % len(templates)].deep_copy()
                        for token in walk:
                            matcher.consume_token(token)
                        matchers.append((matcher, row))
                    began = time.perf_counter()
                    executor.unsafe_compute_mask_ptr(matchers, masks.ctypes.data, masks.strides[0], ROWS)
                    times.append((time.perf_counter() - began) * 1e3)
                results[f"{label}, {count} thread{'s' if count > 1 else ''}"] = statistics.median(times[2:])
        print(f"{name}: " + "; ".join(f"{key} {value:.3f}" for key, value in results.items()))


if __name__ == "__main__":
    main()
