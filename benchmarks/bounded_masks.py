"""One row's grammar mask inside a string of ``maxLength`` 24, character by character: corelib's (llguidance's
mask of the schema without the bound, the bound counted beside it: ``corelib.engine.string_bounds``), llguidance
holding the bound in its grammar with corelib's slices and with its own default ones, and xgrammar when it is
installed, over the byte-level vocabulary of ``json_mode.py``.

    python3 benchmarks/bounded_masks.py [WORKDIR]

Each matcher takes ``{"name":"`` of ``json_mode.SCHEMA`` and then one letter a step; before each letter each
writes the mask of the next token, timed (milliseconds, the best of three rows). The allowed-token counts and
the tokens only one library allows (at the string's first character) show whether the two grammars agree.
xgrammar is not a dependency of corelib: ``pip install xgrammar`` (it brings transformers, triton and
apache-tvm-ffi) to compare.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from corelib.engine.string_bounds import StringTracker, bounds_of, table_of
from corelib.engine.structured import SLICES, GrammarState, grammar_of, llguidance_module, parser_limits
from corelib.support.structured import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent))
json_mode: Any = importlib.import_module("json_mode")  # a sibling script: its vocabulary and schema

ROWS = 3
LETTERS = "abcdefghijklmnopqrstuvwx"  # 24: up to the bound of the name's string


def allowed(words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The allowed token ids of one bitmask row (int32 words, bit t of word t // 32)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: json_mode.VOCAB]
    return np.flatnonzero(bits)


def main() -> None:
    from tokenizers import Tokenizer

    work = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/bounded_masks")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "tokenizer.json"
    if not path.exists():
        json_mode.write_tokenizer(path)
    vocab = json_mode.VOCAB
    tokenizer = Tokenizer.from_file(str(path))
    prefix = tokenizer.encode('{"name":"').ids
    letters = [tokenizer.encode(letter).ids[0] for letter in LETTERS]
    ll = llguidance_module()
    params = StructuredOutputsParams.of({"json": json_mode.SCHEMA})
    grammar = grammar_of(params)
    ll_tokenizer = ll.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=[1], slices=list(SLICES))
    templates = {name: ll.LLMatcher(ll.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=[1], slices=slices),
                                    grammar, limits=parser_limits())
                 for name, slices in (("llguidance", list(SLICES)), ("llguidance, its slices", None))}
    bounds = bounds_of(params.schema)
    assert bounds is not None
    table = table_of(ll_tokenizer, vocab)
    templates["corelib (counted)"] = ll.LLMatcher(
        ll_tokenizer, grammar_of(StructuredOutputsParams(json=bounds.grammar_schema)), limits=parser_limits())
    try:
        xgr: Any = importlib.import_module("xgrammar")
    except ImportError:
        xgr = None
        print("xgrammar is not installed: llguidance alone")
    compiled = None
    if xgr is not None:
        info = xgr.TokenizerInfo([tokenizer.id_to_token(i) for i in range(vocab)],
                                 vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[1])
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(json_mode.SCHEMA), any_whitespace=False,
                                                                 separators=(",", ":"))
    words = (vocab + 31) // 32
    ll_mask = np.zeros(words, dtype=np.int32)
    xg_mask = None if xgr is None else xgr.allocate_token_bitmask(1, vocab)
    libraries = [*templates, *([] if xgr is None else ["xgrammar"])]
    best = {library: [float("inf")] * len(letters) for library in libraries}
    counts = {library: [0] * len(letters) for library in libraries}
    first: dict[str, set[int]] = {}
    for _ in range(ROWS):
        ll_rows = {name: template.deep_copy() for name, template in templates.items()}
        counted = GrammarState(ll_rows["corelib (counted)"], StringTracker(bounds, table))
        xg_row = None if compiled is None else xgr.GrammarMatcher(compiled)
        for token in prefix:
            assert all(row.consume_token(token) for name, row in ll_rows.items() if name != "corelib (counted)")
            assert counted.advance(token) is None
            assert xg_row is None or xg_row.accept_token(token)
        for at, letter in enumerate(letters):
            for name, row in ll_rows.items():
                began = time.perf_counter()
                if name == "corelib (counted)":  # the matcher's mask, then the tracker's restriction
                    counted.fill(ll_mask.ctypes.data, ll_mask.nbytes)
                else:
                    row.unsafe_compute_mask_ptr(ll_mask.ctypes.data, ll_mask.nbytes)
                best[name][at] = min(best[name][at], time.perf_counter() - began)
                counts[name][at] = len(ids := allowed(ll_mask))
                if name == "llguidance":
                    ll_ids = ids
            if xg_row is not None and xg_mask is not None:
                began = time.perf_counter()
                xg_row.fill_next_token_bitmask(xg_mask, 0)
                best["xgrammar"][at] = min(best["xgrammar"][at], time.perf_counter() - began)
                counts["xgrammar"][at] = len(xg_ids := allowed(xg_mask[0].numpy()))
                if at == 0:
                    first = {"llguidance": set(ll_ids.tolist()), "xgrammar": set(xg_ids.tolist())}
                assert xg_row.accept_token(letter)
            assert all(row.consume_token(letter) for name, row in ll_rows.items() if name != "corelib (counted)")
            assert counted.advance(letter) is None
    shown = range(0, len(letters), 3)
    print(f"{'characters in the string':>32}: " + " ".join(f"{at:>7}" for at in shown) + "  | all: sum, slowest")
    for library in libraries:
        print(f"{library + ' ms':>32}: " + " ".join(f"{best[library][at] * 1e3:7.3f}" for at in shown)
              + f"  | {sum(best[library]) * 1e3:.2f}, {max(best[library]) * 1e3:.3f}")
        print(f"{library + ' allowed':>32}: " + " ".join(f"{counts[library][at]:7d}" for at in shown))
    if first:
        for library, other in (("llguidance", "xgrammar"), ("xgrammar", "llguidance")):
            only = sorted(first[library] - first[other])
            print(f"only {library} allows, at the first character: "
                  f"{[tokenizer.decode([token]) for token in only[:40]]}")


if __name__ == "__main__":
    main()
