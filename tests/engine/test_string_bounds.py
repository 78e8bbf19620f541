"""Strings' length bounds counted beside the grammar: the masks against llguidance's, which holds the bounds itself.

Where the two masks differ, the extra tokens of ours must be ones llguidance takes byte by byte (it
allows a string at its bound to close only with the bare quote token, not with ``",``): so a mask
that lets a string grow past its bound, or close short of its minLength, fails here.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from corelib.engine.string_bounds import (
    AFTER_BACKSLASH,
    ESCAPE_STATES,
    HEX0,
    NORMAL,
    StringTracker,
    _scan_all,
    bounds_of,
    scan_string,
    table_of,
)
from corelib.engine.structured import (
    SLICES,
    GrammarState,
    StructuredOutputs,
    grammar_of,
    llguidance_module,
    parser_limits,
)
from corelib.support.structured import StructuredOutputsParams
from corelib.support.text import Tokenizer

PIECES = ['"', '",', '":', '":"', '","', '"]', '"],"', '"}', '{"', '["', '[""]', '"",', "\\", "\\n", '\\"', "\\u00",
          "\\u", "\\t", "\\\\", 'x\\"', '\\"",', "\\u00e9", 'e9"', 'e9",', "u00", "e9", "00e9", "é", 'é"', "日本",
          '本",', "ab\"", 'abc",', 'xy","z', '"a', '":"ab', ',"tags":["a', '1,"', '],"n":', '"},"', '{"b":"', 'q"}',
          '":["', '","pair":["', '"],"n":1', '"","', '"ab', '"abcd', '","abc', "},", "}", "]", ",", ":", "[", "{",
          "true", "false"]
SCHEMAS: dict[str, dict[str, Any]] = {
    "properties and items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "maxItems": 3},
            "n": {"type": "integer"},
        },
        "required": ["name", "tags", "n"],
        "additionalProperties": False,
    },
    "refs, prefixItems, nesting, anyOf": {
        "$defs": {"short": {"type": "string", "maxLength": 4}},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/short"},
            "pair": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 1},
                                                      {"type": "string", "maxLength": 4},
                                                      {"type": "string", "maxLength": 1}], "items": False},
            "inner": {"type": "object", "properties": {"b": {"type": "string", "minLength": 1, "maxLength": 3}},
                      "required": ["b"], "additionalProperties": False},
            "either": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]},
        },
        "required": ["a", "pair", "inner", "either"],
        "additionalProperties": False,
    },
    "a string at the root": {"type": "string", "minLength": 1, "maxLength": 4},
    "strings with and without bounds, enums, numbers, optional keys, arrays of objects": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "kind": {"enum": ["ab", "xyz"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "note": {"type": "string", "maxLength": 3},
            "kept": {"$ref": "#/$defs/s"},
            "either": {"anyOf": [{"$ref": "#/$defs/s"}, {"type": "integer"}]},
            "items": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "object", "properties": {"k": {"type": "string"},
                                                                 "v": {"type": "string", "maxLength": 2}},
                                "required": ["k"], "additionalProperties": False}},
        },
        "$defs": {"s": {"type": "string", "maxLength": 2}},
        "required": ["id", "kind", "items"],
        "additionalProperties": False,
    },
}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character a byte-level vocabulary writes it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def write_vocabulary(path: Path) -> int:
    """A byte-level vocabulary of the 256 bytes, JSON pieces, escapes, multi-byte characters and words."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    chars = _byte_chars()
    rng = random.Random(0)
    texts = [*PIECES]
    while len(texts) < 1200:
        texts.append("".join(rng.choice("abcdefghxyz") for _ in range(rng.randint(2, 8))))
    vocab = ["<s>", "</s>", *(chars[b] for b in range(256))]
    vocab += sorted({"".join(chars[b] for b in text.encode()) for text in texts} - set(vocab))
    tokenizer = HfTokenizer(models.BPE(vocab={token: i for i, token in enumerate(vocab)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path))
    return len(vocab)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("bounds") / "tokenizer.json"
    return path, write_vocabulary(path)


@cache
def _allowed(words: bytes, vocab: int) -> frozenset[int]:
    bits = np.unpackbits(np.frombuffer(words, np.uint8), bitorder="little")[:vocab]
    return frozenset(np.flatnonzero(bits).tolist())


# ----------------------------------------------------------------------------- which strings are counted


def test_strings_reached_only_through_followed_paths_are_counted_and_taken_out_of_the_grammar() -> None:
    schema = SCHEMAS["refs, prefixItems, nesting, anyOf"]
    bounds = bounds_of(json.dumps(schema))
    assert bounds is not None
    assert sorted(bounds.strings.values()) == [(0, 1), (0, 1), (0, 4), (0, 4), (1, 3)]  # a, pair's items, inner.b
    grammar = bounds.grammar_schema
    assert isinstance(grammar, dict)
    assert grammar["$defs"]["short"] == {"type": "string"}
    assert grammar["properties"]["either"] == schema["properties"]["either"]  # under anyOf: llguidance's
    assert grammar["properties"]["inner"]["properties"]["b"] == {"type": "string"}


def test_a_definition_also_used_where_the_tracker_does_not_follow_keeps_its_bounds() -> None:
    schema = {"$defs": {"s": {"type": "string", "maxLength": 3}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/s"}, "b": {"anyOf": [{"$ref": "#/$defs/s"}, {"type": "null"}]}}}
    assert bounds_of(json.dumps(schema)) is None
    # a pattern, a format or a type list leaves the string to the grammar as well
    for string in ({"type": "string", "maxLength": 3, "pattern": "a+"}, {"type": ["string", "null"], "maxLength": 3},
                   {"type": "string", "maxLength": 3, "format": "date"}):
        assert bounds_of(json.dumps({"type": "object", "properties": {"a": string}})) is None


# ----------------------------------------------------------------------------- counting


@pytest.mark.parametrize("escape", range(ESCAPE_STATES))
def test_the_vector_scan_counts_as_the_tracker_does(escape: int) -> None:
    rng = random.Random(escape)
    alphabet = [*b'"\\u0a', 0xC3, 0xA9, 0xE6, 0x97, 0xA5, *b"19f"]
    rows = [bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 9))) for _ in range(3000)]
    width = max(len(r) for r in rows)
    matrix = np.full((len(rows), width), -1, np.int16)
    for at, data in enumerate(rows):
        matrix[at, : len(data)] = np.frombuffer(data, np.uint8)
    chars, close_at, after = _scan_all(matrix, escape)
    for at, data in enumerate(rows):
        count, closes, _ = scan_string(data, 0, escape)
        assert (chars[at], close_at[at]) == (count, closes), data
        assert after[at] == (closes >= 0 and b'"' in data[closes + 1 :]), data


def test_an_escape_or_a_multi_byte_character_counts_once_where_it_starts() -> None:
    assert scan_string(b"a\\n\\u00e9", 0, NORMAL) == (3, -1, NORMAL)
    assert scan_string("é日".encode(), 0, NORMAL) == (2, -1, NORMAL)
    assert scan_string(b'\\"x"y', 0, NORMAL) == (2, 3, NORMAL)  # an escaped quote does not close it
    assert scan_string(b"u00", 0, AFTER_BACKSLASH) == (0, -1, HEX0 + 2)  # the escape was counted at its backslash
    assert scan_string("\xa9b".encode("latin-1"), 0, NORMAL) == (1, -1, NORMAL)  # a continuation byte: no new one


# ----------------------------------------------------------------------------- the masks


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_masks_keep_the_bounds_llguidance_keeps(vocabulary: tuple[Path, int], name: str) -> None:
    path, vocab = vocabulary
    ll = llguidance_module()
    ll_tokenizer = ll.LLTokenizer(path.read_text(), n_vocab=vocab, eos_token=[1], slices=list(SLICES))
    schema = SCHEMAS[name]
    bounds = bounds_of(json.dumps(schema, separators=(",", ":")))
    assert bounds is not None
    table = table_of(ll_tokenizer, vocab)
    bounded = ll.LLMatcher(ll_tokenizer, grammar_of(StructuredOutputsParams(json=schema)), limits=parser_limits())
    unbounded = ll.LLMatcher(ll_tokenizer, grammar_of(StructuredOutputsParams(json=bounds.grammar_schema)),
                             limits=parser_limits())
    byte_token = {byte: 2 + byte for byte in range(256)}  # the vocabulary's single bytes
    words = (vocab + 31) // 32
    rng = random.Random(name)
    extras = closed = 0
    for _ in range(40):  # one schema's walks share its verdicts, as its requests do
        theirs_matcher, ours_matcher = bounded.deep_copy(), unbounded.deep_copy()
        state = GrammarState(ours_matcher, StringTracker(bounds, table))
        for _ in range(60):
            theirs, ours = np.zeros(words, np.uint32), np.zeros(words, np.uint32)
            theirs_matcher.unsafe_compute_mask_ptr(theirs.ctypes.data, theirs.nbytes)
            state.fill(ours.ctypes.data, ours.nbytes)
            allowed, ours_allowed = _allowed(theirs.tobytes(), vocab), _allowed(ours.tobytes(), vocab)
            assert allowed <= ours_allowed, f"{name}: ours takes out {sorted(allowed - ours_allowed)[:5]}"
            for token in ours_allowed - allowed:  # llguidance must take its bytes one by one
                extras += 1
                check = theirs_matcher.deep_copy()
                data = table.token_bytes[token]
                assert all(check.consume_token(byte_token[b]) for b in data), f"{name}: {data!r} breaks a bound"
            if not allowed or theirs_matcher.is_stopped():
                break
            # every third token, one with a quote or a backslash where one is allowed: crossings and escapes
            special = [t for t in sorted(allowed) if any(c in table.token_bytes[t] for c in b'"\\')]
            token = rng.choice(special if special and rng.random() < 0.33 else sorted(allowed))
            assert theirs_matcher.consume_token(token)
            assert state.advance(token) in (None, "done")
        closed += theirs_matcher.is_stopped()
    assert closed >= 10, "too few walks reached the end of the JSON to have crossed every bound"
    if name == "a string at the root":  # nothing may follow its closing quote: there the masks are equal
        assert extras == 0


def test_a_token_past_a_bound_fails_its_request_when_the_mask_was_not_applied(tmp_path: Path) -> None:
    from corelib.models.synthetic import write_text_checkpoint

    tokenizer = Tokenizer.from_directory(write_text_checkpoint(tmp_path))
    assert tokenizer is not None
    outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size, [1])
    for text in ('{"name":"abcdef', '{"name":"a"'):  # past maxLength 5; closed short of minLength 2
        state = outputs.state(StructuredOutputsParams(json=SCHEMAS["properties and items"]))
        verdicts = [state.advance(token) for token in tokenizer.encode(text, add_special_tokens=False)]
        assert verdicts[-1] is not None and "minLength or maxLength" in verdicts[-1], text
        assert all(verdict is None for verdict in verdicts[:-1])
