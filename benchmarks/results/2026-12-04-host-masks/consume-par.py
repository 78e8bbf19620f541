"""32 grammars mid-output take their tokens: one by one (GrammarState.advance) against llguidance's pool
(LLExecutor.consume_token_par, 2 threads); json_mode.py's vocabulary and schemas, 12 independent matchers per
grammar as the engine keeps them. From the repository root:

    PYTHONPATH=benchmarks python benchmarks/results/2026-12-04-host-masks/consume-par.py
"""

import random
import statistics
import time
from pathlib import Path
from typing import Any

import json_mode as jm
import llguidance as ll

from corelib.engine import structured as st
from corelib.support.structured import StructuredOutputsParams

OUTPUT = '{"name":"Abc defgh ijk","age":42,"role":"admin","active":true,"tags":["ab","cd"]}'


def rows(outputs: st.StructuredOutputs, schema: dict[str, Any], ids: list[int],
         rng: random.Random) -> list[tuple[st.GrammarState, int]]:
    """32 requests each some tokens into OUTPUT, with the next token to take."""
    made = []
    for _ in range(32):
        state, k = outputs.state(StructuredOutputsParams(json=schema)), rng.randrange(len(ids) - 1)
        for token in ids[:k]:
            assert state.advance(token) is None
        made.append((state, ids[k]))
    return made


def main() -> None:
    path = Path("outputs/json_mode_tiny/tokenizer.json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        jm.write_tokenizer(path)
    tokenizer = ll.LLTokenizer(path.read_text(), n_vocab=jm.VOCAB, eos_token=[1], slices=list(st.SLICES))
    outputs = st.StructuredOutputs(None, jm.VOCAB, [1])
    outputs._ll_tokenizer = tokenizer
    outputs.templates_per_grammar = 12
    ids = tokenizer.tokenize_str(OUTPUT)
    pool = ll.LLExecutor(num_threads=2)
    for case, schema in (("unbounded", jm.typical(jm.SCHEMA)), ("maxLength 24 and 8", jm.SCHEMA)):
        rng = random.Random(0)
        alone: list[float] = []
        together: list[float] = []
        for _ in range(200):
            batch = rows(outputs, schema, ids, rng)
            started = time.perf_counter()
            for state, token in batch:
                state.advance(token)
            alone.append(time.perf_counter() - started)
            batch = rows(outputs, schema, ids, rng)
            started = time.perf_counter()
            pool.consume_token_par([(state.matcher, token) for state, token in batch])
            together.append(time.perf_counter() - started)
        print(f"{case}: 32 rows one by one {statistics.median(alone) * 1e6:.0f} us, "
              f"in the pool (consume only) {statistics.median(together) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
