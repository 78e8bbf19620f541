"""The length bounds of a schema's JSON strings, enforced beside the grammar's matcher instead of inside it.

Inside a string of ``maxLength`` n, llguidance's lexer is in a new state at every character (the
characters left are part of it), so it reuses no mask and walks most of the vocabulary to write each
one: 1-3 ms a row at a 150k vocabulary, against some 20 µs in a string without a bound. The
bounds follow from counting alone, though: a token that stays inside the string fits when the
characters it starts are no more than what is left; one that closes it, when the string's length
lands within [minLength, maxLength].

So where the schema lets it be done exactly, the matcher gets the schema with those strings'
bounds taken out (:func:`bounds_of`), and each request's :class:`StringTracker` follows its output
through the JSON (objects, arrays, keys, each string's characters) and takes away from the
matcher's mask what the bounds forbid:

- inside a bounded string, every token that stays inside it or closes it with nothing quoted after,
  by two bitmasks cached per count (:class:`TokenTable`): a numpy AND over the row;
- a token that crosses a quote into more JSON (``","``, ``{"key":"va``, ...), by feeding its bytes to a
  copy of the tracker. Only those the matcher allowed are fed, and outside strings they are
  grouped by what precedes their first quote, so the common case (a string value's opening
  quote and its first characters) is one feed per group and a vector compare.

A character is what llguidance counts in a bounded string: a code point written as is, or an escape
(``\\n``, ``\\u001f``: each one). A token that ends inside a multi-byte character or an escape has
started that character, so it counts it. The masks then equal llguidance's with the bounds in its
grammar but in one way: at a string's bound llguidance lets it close with the bare quote token only,
where this also allows a token such as ``",`` whose bytes llguidance takes one by one.

A string is counted here only where every path to it from the root is one the tracker follows:
``properties`` (and ``additionalProperties``) of plain objects, ``items`` and ``prefixItems`` of plain
arrays, and local ``$ref``\\s. A string reached through ``anyOf``, ``oneOf``, ``allOf``, conditionals or
anything else keeps its bounds in the grammar, and llguidance enforces them as before. Tests compare
the masks with llguidance's own over walks through such schemas.

Long: one mechanism in three parts that only make sense together: which strings are counted (the
schema walk), what each token does inside a string (the vectorised scan, with the per-count bitmasks),
and the tracker that follows an output and applies both; apart, each would export its internals to
the others.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

QUOTE, BACKSLASH_BYTE = 0x22, 0x5C
# Where a string's scan is: NORMAL, after a backslash, or after \u and 0-3 of its hex digits.
NORMAL, AFTER_BACKSLASH, HEX0, HEX3 = 0, 1, 2, 5
ESCAPE_STATES = 6
WHITESPACE = frozenset(b" \t\n\r")

_STRING_KEYS = frozenset({"type", "maxLength", "minLength", "title", "description", "default", "examples",
                          "$comment"})
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "title", "description",
                          "$defs", "definitions", "$schema", "$id", "$comment", "default", "examples",
                          "minProperties", "maxProperties"})
_ARRAY_KEYS = frozenset({"type", "items", "prefixItems", "minItems", "maxItems", "title", "description",
                         "$comment", "default", "examples"})
_REF_KEYS = frozenset({"$ref", "title", "description", "$comment"})


class LostTrack(RuntimeError):
    """The output left the JSON the tracker follows (the matcher allowed what it should not have)."""


# ----------------------------------------------------------------------------- the schema


def _kind(node: object) -> str | None:
    """How the tracker follows ``node``: "string" (a bounded string it can count), "object", "array", "ref",
    or None (not followed: the strings under it keep their bounds in the grammar)."""
    if not isinstance(node, dict):
        return None
    keys = node.keys()
    kind = node.get("type")
    if kind == "string" and keys <= _STRING_KEYS and "maxLength" in node:
        bounds = node.get("minLength", 0), node["maxLength"]
        return "string" if all(type(b) is int and b >= 0 for b in bounds) and bounds[0] <= bounds[1] else None
    if keys <= _OBJECT_KEYS and kind in ("object", None) and "properties" in node:
        extra = node.get("additionalProperties", True)
        return "object" if isinstance(node["properties"], dict) and isinstance(extra, (bool, dict)) else None
    if keys <= _ARRAY_KEYS and kind in ("array", None) and ("items" in node or "prefixItems" in node):
        items, prefix = node.get("items", True), node.get("prefixItems", [])
        return "array" if isinstance(items, (bool, dict)) and isinstance(prefix, list) else None
    if keys <= _REF_KEYS and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
        return "ref"
    return None


def _pointer(root: object, ref: str) -> object:
    """The node a local ``$ref`` names (a JSON pointer into ``root``); None when it names nothing."""
    node = root
    for escaped in ref[1:].split("/")[1:]:
        part = escaped.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


@dataclasses.dataclass
class Bounds:
    """Which strings of one schema are counted by the tracker, and the schema the matcher gets without them."""

    root: object  # the schema as given (the tracker walks it)
    strings: dict[int, tuple[int, int]]  # id of a string node -> (minLength, maxLength)
    grammar_schema: dict[str, Any]  # the schema with those strings' bounds taken out
    _verdicts: OrderedDict[tuple[Any, ...], _Verdicts] = dataclasses.field(default_factory=OrderedDict)

    def verdicts(self, position: tuple[Any, ...], candidates: npt.NDArray[np.uint32]) -> _Verdicts:
        """What the crossing tokens fed at ``position`` did (:meth:`StringTracker.restrict`), kept for every
        request of this schema; a few hundred positions at most, least recently used dropped."""
        found = self._verdicts.get(position)
        if found is None:
            found = self._verdicts[position] = _Verdicts(candidates)
            while len(self._verdicts) > MAX_POSITIONS:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(position)
        return found

    def resolve(self, node: object) -> object:
        """``node`` past its local ``$ref``\\s (at most a few: a cycle of refs resolves to nothing)."""
        for _ in range(32):
            if _kind(node) != "ref":
                return node
            assert isinstance(node, dict)
            node = _pointer(self.root, node["$ref"])
        return None

    def child(self, node: object, key: str) -> object:
        """The schema of property ``key`` of an object of schema ``node`` (None where the tracker does not follow)."""
        node = self.resolve(node)
        if _kind(node) != "object":
            return None
        assert isinstance(node, dict)
        found = node["properties"].get(key)
        if found is None and isinstance(node.get("additionalProperties"), dict):
            found = node["additionalProperties"]
        return self.resolve(found)

    def item(self, node: object, index: int) -> object:
        """The schema of item ``index`` of an array of schema ``node``."""
        node = self.resolve(node)
        if _kind(node) != "array":
            return None
        assert isinstance(node, dict)
        prefix = node.get("prefixItems", [])
        return self.resolve(prefix[index] if index < len(prefix) else node.get("items"))

    def of(self, node: object) -> tuple[int, int] | None:
        """(minLength, maxLength) of a string of schema ``node`` the tracker counts; None for any other node."""
        return self.strings.get(id(node)) if node is not None else None


def bounds_of(schema: str) -> Bounds | None:
    """What of ``schema`` (JSON text) the tracker counts; None when it counts nothing (the grammar keeps it all)."""
    root = json.loads(schema)
    counted: set[int] = set()
    kept: set[int] = set()
    nodes: dict[int, dict[str, Any]] = {}
    seen: set[tuple[int, bool]] = set()

    def walk(value: object, followed: bool) -> None:
        if (id(value), followed) in seen:
            return
        seen.add((id(value), followed))
        if isinstance(value, list):
            for entry in value:
                walk(entry, False)
            return
        if not isinstance(value, dict):
            return
        kind = _kind(value)
        if kind == "string":
            nodes[id(value)] = value
            (counted if followed else kept).add(id(value))
            return
        for key, sub in value.items():
            if key in ("$defs", "definitions"):  # definitions are reached through the refs that use them
                continue
            if kind == "ref" and key == "$ref":
                walk(_pointer(root, sub), followed)
            elif key == "$ref" and isinstance(sub, str) and sub.startswith("#"):
                walk(_pointer(root, sub), False)
            elif kind == "object" and key == "properties":
                for entry in sub.values():
                    walk(entry, followed)
            elif (kind, key) in (("object", "additionalProperties"), ("array", "items")):
                walk(sub, followed)
            elif kind == "array" and key == "prefixItems":
                for entry in sub:
                    walk(entry, followed)
            else:
                walk(sub, False)

    try:
        walk(root, True)
    except RecursionError:  # nested past Python's stack: the grammar keeps every bound
        return None
    strings = {key: (nodes[key].get("minLength", 0), nodes[key]["maxLength"]) for key in counted - kept}
    if not strings:
        return None

    def without_bounds(value: object) -> object:
        if isinstance(value, list):
            return [without_bounds(entry) for entry in value]
        if not isinstance(value, dict):
            return value
        drop = ("maxLength", "minLength") if id(value) in strings else ()
        return {key: without_bounds(sub) for key, sub in value.items() if key not in drop}

    grammar = without_bounds(root)
    assert isinstance(grammar, dict)  # a schema is an object (StructuredOutputsParams checks it)
    return Bounds(root, strings, grammar)


# ----------------------------------------------------------------------------- counting a string's characters


def string_byte(escape: int, byte: int) -> tuple[int, bool]:
    """One byte inside a JSON string that does not close it (not a quote in escape state NORMAL): the escape
    state after it, and whether it starts a character (a backslash does, and so does any byte in NORMAL but a
    UTF-8 continuation byte; an escape's later bytes do not)."""
    if escape == NORMAL:
        if byte == BACKSLASH_BYTE:
            return AFTER_BACKSLASH, True
        return NORMAL, byte & 0xC0 != 0x80
    if escape == AFTER_BACKSLASH:
        return (HEX0 if byte == ord("u") else NORMAL), False
    return (escape + 1 if escape < HEX3 else NORMAL), False


def scan_string(data: bytes, start: int, escape: int) -> tuple[int, int, int]:
    """Scan ``data[start:]`` inside a JSON string in escape state ``escape``: (characters started before the
    closing quote or the end, the closing quote's index or -1, the escape state at the end)."""
    chars = 0
    for at in range(start, len(data)):
        byte = data[at]
        if escape == NORMAL and byte == QUOTE:
            return chars, at, NORMAL
        escape, starts = string_byte(escape, byte)
        chars += starts
    return chars, -1, escape


def _scan_all(matrix: npt.NDArray[np.int16], escape: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32],
                                                                     npt.NDArray[np.bool_]]:
    """:func:`scan_string` over every row of ``matrix`` (bytes, -1 past the end) at once: the characters started
    before the closing quote, the closing quote's index (-1: none), and whether a quote byte follows it."""
    rows = matrix.shape[0]
    state = np.full(rows, escape, np.int8)
    chars = np.zeros(rows, np.int32)
    close_at = np.full(rows, -1, np.int32)
    after = np.zeros(rows, bool)
    for at, byte in enumerate(matrix.T):
        closed = close_at >= 0
        after |= closed & (byte == QUOTE)
        live = (byte >= 0) & ~closed
        normal = live & (state == NORMAL)
        backslashed = live & (state == AFTER_BACKSLASH)
        hexing = live & (state >= HEX0)
        quote = normal & (byte == QUOTE)
        chars += (normal & ~quote & ((byte & 0xC0) != 0x80)).astype(np.int32)  # a backslash starts one too
        close_at[quote] = at
        state[normal & (byte == BACKSLASH_BYTE)] = AFTER_BACKSLASH
        state[backslashed] = np.where(byte[backslashed] == ord("u"), HEX0, NORMAL)
        state[hexing] = np.where(state[hexing] < HEX3, state[hexing] + 1, NORMAL)
    return chars, close_at, after


def _bits(flags: npt.NDArray[np.bool_], words: int) -> npt.NDArray[np.uint32]:
    """A token bitmask (bit t of word t // 32) of the tokens where ``flags`` holds."""
    packed = np.packbits(flags, bitorder="little")
    out = np.zeros(words * 4, np.uint8)
    out[: packed.size] = packed
    return out.view(np.uint32)


def _ids(words: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """The token ids whose bits are set in ``words``."""
    nonzero = np.flatnonzero(words)
    if nonzero.size == 0:
        return nonzero
    bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32).astype(bool)
    ids: npt.NDArray[np.int64] = (nonzero[:, None] * 32 + np.arange(32))[bits]
    return ids


def _set(words: npt.NDArray[np.uint32], ids: npt.NDArray[np.int64]) -> None:
    if ids.size:
        np.bitwise_or.at(words, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))


@dataclasses.dataclass
class _StringColumns:
    """Every token scanned from inside a string in one escape state."""

    chars: npt.NDArray[np.int32]  # characters started before the closing quote (or in all of it)
    close_at: npt.NDArray[np.int32]  # the closing quote's byte index, -1 where it stays inside
    crossing_bits: npt.NDArray[np.uint32]  # closes, and has a quote after: the rest fed to a tracker
    top: int  # the most characters a token starts
    within: dict[int, npt.NDArray[np.uint32]]  # r -> every token but those starting more than r characters
    long_enough: dict[int, npt.NDArray[np.uint32]]  # n -> every token but those closing it after fewer than n


class TokenTable:
    """Each token's bytes, and what it does inside a string and from outside one, for a vocabulary (built once
    per tokenizer: a few tenths of a second at 150k tokens)."""

    def __init__(self, token_bytes: list[bytes], special: Iterable[int] = ()) -> None:
        self.token_bytes = token_bytes
        self.vocab = len(token_bytes)
        self.words = (self.vocab + 31) // 32
        width = max((len(b) for b in token_bytes), default=1) or 1
        matrix = np.full((self.vocab, width), -1, np.int16)
        for token, data in enumerate(token_bytes):
            matrix[token, : len(data)] = np.frombuffer(data, np.uint8)
        self._plain = np.ones(self.vocab, bool)  # not a special token (those never enter a string)
        self._plain[[t for t in special if 0 <= t < self.vocab]] = False
        self._matrix = matrix
        self._columns: dict[int, _StringColumns] = {}
        self.scratch = np.zeros(self.words, np.uint32)  # StringTracker.restrict's (one thread writes the masks)
        # From outside a string: the first quote opens one; what the token holds after it, scanned from there.
        is_quote = matrix == QUOTE
        has_quote = is_quote.any(axis=1) & self._plain
        self.quoted_bits = _bits(has_quote, self.words)
        # Tokens of string content alone (no quote, no backslash): inside a string out of any escape they only add
        # their characters (StringTracker.feed_token's shortcut).
        self.content = ~(is_quote | (matrix == BACKSLASH_BYTE)).any(axis=1) & self._plain
        self.first_quote = np.where(has_quote, is_quote.argmax(axis=1), width).astype(np.int32)
        shift = self.first_quote[:, None] + 1 + np.arange(width)[None, :]
        shifted = np.where(shift < width, np.take_along_axis(matrix, np.minimum(shift, width - 1), axis=1), -1)
        self.open_chars, open_close, self.open_crossing = _scan_all(shifted.astype(np.int16), NORMAL)
        self.open_closes = open_close >= 0

    def plain(self, token: int) -> bool:
        """Whether ``token`` is text (not a special token, whose bytes never enter the JSON)."""
        return 0 <= token < self.vocab and bool(self._plain[token])

    def columns(self, escape: int) -> _StringColumns:
        found = self._columns.get(escape)
        if found is None:
            chars, close_at, after = _scan_all(self._matrix, escape)
            crossing = (close_at >= 0) & after & self._plain
            found = _StringColumns(chars, close_at, _bits(crossing, self.words), int(chars.max(initial=0)), {}, {})
            self._columns[escape] = found
        return found

    def within(self, escape: int, left: int) -> npt.NDArray[np.uint32] | None:
        """Every token but those that start more than ``left`` characters in a string: None where none does."""
        columns = self.columns(escape)
        if left >= columns.top:
            return None
        found = columns.within.get(left)
        if found is None:
            found = columns.within[left] = ~_bits((columns.chars > left) & self._plain, self.words)
        return found

    def long_enough(self, escape: int, need: int) -> npt.NDArray[np.uint32]:
        """Every token but those that close a string having started fewer than ``need`` characters in it."""
        columns = self.columns(escape)
        found = columns.long_enough.get(need)
        if found is None:
            flags = (columns.close_at >= 0) & (columns.chars < need) & self._plain
            found = columns.long_enough[need] = ~_bits(flags, self.words)
        return found


# ----------------------------------------------------------------------------- following the output

# Where the tracker is between two bytes.
VALUE, VALUE_OR_END, KEY, KEY_OR_END, COLON, AFTER, STRING, SCALAR, DONE = range(9)
#: the tracker positions whose verdicts (:class:`_Verdicts`) one schema keeps, least recently used dropped
MAX_POSITIONS = 512


class _Verdicts:
    """At one position of the tracker: the crossing tokens not fed yet (``unfed``), and every token but those
    fed that broke a bound (``keep``; ``broke`` once any did)."""

    __slots__ = ("broke", "keep", "unfed")

    def __init__(self, candidates: npt.NDArray[np.uint32]) -> None:
        self.unfed = candidates.copy()
        self.keep = np.full_like(candidates, 0xFFFFFFFF)
        self.broke = False


class StringTracker:
    """One request's output followed through the JSON: the stack of objects and arrays with their schemas, and
    inside a string, its characters so far and its bounds (None where it is not counted here)."""

    __slots__ = ("bounds", "count", "escape", "is_key", "key", "limits", "stack", "state", "table", "verdicts")

    def __init__(self, bounds: Bounds, table: TokenTable) -> None:
        self.bounds = bounds
        self.table = table
        self.state = VALUE
        self.stack: list[list[Any]] = []  # [is object, schema, the key's schema or the item index]
        self.is_key = False
        self.key = bytearray()
        self.limits: tuple[int, int] | None = None
        self.count = 0
        self.escape = NORMAL
        # The verdicts of where it is (:meth:`restrict`), kept while only a string's count moves: None once a byte
        # is fed (the position may have changed).
        self.verdicts: _Verdicts | None = None

    def copy(self) -> StringTracker:
        other = StringTracker.__new__(StringTracker)
        other.bounds, other.table, other.state = self.bounds, self.table, self.state
        other.stack = [list(frame) for frame in self.stack]
        other.is_key, other.key, other.limits = self.is_key, bytearray(self.key), self.limits
        other.count, other.escape, other.verdicts = self.count, self.escape, None
        return other

    def _value_schema(self) -> object:
        if not self.stack:
            return self.bounds.resolve(self.bounds.root)
        is_object, schema, at = self.stack[-1]
        return at if is_object else self.bounds.item(schema, at)

    def feed_token(self, token: int) -> bool:
        """:meth:`feed` the bytes of ``token`` (of the table's vocabulary); inside a counted string, a token of
        content alone only adds its characters."""
        table = self.table
        if self.state == STRING and self.escape == NORMAL and self.limits is not None and table.content[token]:
            self.count += int(table.columns(NORMAL).chars[token])
            return self.count <= self.limits[1]
        return self.feed(table.token_bytes[token])

    def feed(self, data: bytes) -> bool:
        """Take ``data``; False when it breaks a counted string's bounds (the state is then undefined).
        LostTrack where ``data`` is not JSON this tracker follows."""
        self.verdicts = None
        return all(self._byte(byte) for byte in data)

    def _byte(self, byte: int) -> bool:  # one JSON scanner, a branch per state
        state = self.state
        if state == STRING:
            if self.escape == NORMAL and byte == QUOTE:
                return self._close()
            self.escape, starts = string_byte(self.escape, byte)
            if self.is_key:
                self.key.append(byte)
            elif starts and self.limits is not None:
                self.count += 1
                return self.count <= self.limits[1]
            return True
        if state == SCALAR:
            if byte not in b",}]" and byte not in WHITESPACE:
                return True
            state = self.state = AFTER
        if byte in WHITESPACE:
            return True
        if state == VALUE_OR_END and byte == ord("]"):
            return self._pop()
        if state in (VALUE, VALUE_OR_END):
            schema = self._value_schema()
            if byte == QUOTE:
                self._open(False, self.bounds.of(schema))
            elif byte == ord("{"):
                self.stack.append([True, schema, None])
                self.state = KEY_OR_END
            elif byte == ord("["):
                self.stack.append([False, schema, 0])
                self.state = VALUE_OR_END
            else:
                self.state = SCALAR
            return True
        if state in (KEY, KEY_OR_END):
            if byte == QUOTE:
                self._open(True, None)
                return True
            if state == KEY_OR_END and byte == ord("}"):
                return self._pop()
        elif state == COLON:
            if byte == ord(":"):
                self.state = VALUE
                return True
        elif state == AFTER and self.stack:
            if byte == ord(","):
                frame = self.stack[-1]
                if frame[0]:
                    self.state = KEY
                else:
                    frame[2] += 1
                    self.state = VALUE
                return True
            if byte in b"}]":
                return self._pop()
        raise LostTrack(f"byte {bytes((byte,))!r} where the JSON cannot take it")

    def _open(self, is_key: bool, limits: tuple[int, int] | None) -> None:
        self.state, self.is_key, self.limits, self.count, self.escape = STRING, is_key, limits, 0, NORMAL
        self.key.clear()

    def _close(self) -> bool:
        """The string ends: False when it is a counted one shorter than its minLength."""
        if self.is_key:
            schema = self.stack[-1][1]
            self.stack[-1][2] = self.bounds.child(schema, json.loads(b'"' + bytes(self.key) + b'"'))
            self.state = COLON
            return True
        self.state = AFTER if self.stack else DONE
        return self.limits is None or self.count >= self.limits[0]

    def _pop(self) -> bool:
        self.stack.pop()
        self.state = AFTER if self.stack else DONE
        return True

    # -------------------------------------------------------------------------- the mask

    def _position(self) -> tuple[Any, ...]:
        """What decides how a token crossing a quote from here goes on: the stack (each schema by identity, an
        array's index past its prefixItems taken as the first past them), the state, and in a string its
        escape state and, for a key, the key so far. Not the characters counted: those are compared apart."""
        frames = []
        for is_object, schema, at in self.stack:
            if is_object:
                frames.append((True, id(schema), id(at)))
            else:
                prefix = schema.get("prefixItems", ()) if isinstance(schema, dict) else ()
                frames.append((False, id(schema), min(at, len(prefix))))
        if self.state != STRING:
            return (self.state, *frames)
        return (STRING, self.escape, bytes(self.key) if self.is_key else self.limits is None, *frames)

    def restrict(self, row: npt.NDArray[np.uint32]) -> None:
        """Take out of ``row`` (the matcher's mask for the next token) every token the bounds forbid."""
        table = self.table
        state = self.state
        if state == DONE:
            return
        if state == STRING:
            columns = table.columns(self.escape)
            if self.limits is not None:
                low, high = self.limits
                within = table.within(self.escape, high - self.count)
                if within is not None:
                    row &= within
                if low > self.count:
                    row &= table.long_enough(self.escape, low - self.count)
            candidates = columns.crossing_bits
        else:
            candidates = table.quoted_bits
        verdicts = self.verdicts
        if verdicts is None:  # the position is looked up once per byte fed, not per row and step
            verdicts = self.verdicts = self.bounds.verdicts(self._position(), candidates)
        new = np.bitwise_and(row, verdicts.unfed, out=table.scratch)  # no array made per row and step
        if np.count_nonzero(new):  # (faster than any() at these sizes)
            ids = _ids(new)
            broke = np.zeros_like(new)
            _set(broke, ids[~self._fit(ids)])
            if np.count_nonzero(broke):
                verdicts.keep &= ~broke
                verdicts.broke = True
            verdicts.unfed &= ~new
        if verdicts.broke:  # most positions never see a crossing token break a bound: no AND over the row
            row &= verdicts.keep

    def _fit(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Whether each of ``ids`` keeps the bounds of what it crosses into. In a string, past its closing quote
        (the characters before it are compared by count); outside one, from here, grouped by what precedes the
        token's first quote."""
        table = self.table
        token_bytes = table.token_bytes
        fits = np.ones(ids.size, bool)
        if self.state == STRING:
            closed = self.copy()
            closed.limits = None  # its length is checked apart
            closed._close()
            close_at = table.columns(self.escape).close_at
            for at, token in enumerate(ids.tolist()):
                fits[at] = closed.copy().feed(token_bytes[token][close_at[token] + 1 :])
            return fits
        groups: dict[bytes, list[int]] = {}
        for at, token in enumerate(ids.tolist()):
            groups.setdefault(token_bytes[token][: table.first_quote[token]], []).append(at)
        for before, members in groups.items():
            opened = self.copy()
            if not opened.feed(before + b'"'):
                fits[members] = False
                continue
            where = np.asarray(members)
            crossing = table.open_crossing[ids[where]]
            if opened.limits is not None:
                low, high = opened.limits
                chars, closes = table.open_chars[ids[where]], table.open_closes[ids[where]]
                fits[where[~crossing]] = ~((chars > high) | (closes & (chars < low)))[~crossing]
            for member in where[crossing].tolist():
                fits[member] = self.copy().feed(token_bytes[int(ids[member])])
        return fits


def row_view(address: int, words: int) -> npt.NDArray[np.uint32]:
    """The ``words`` uint32 words at ``address`` (a row of the step's bitmask) as a numpy array, not copied."""
    return np.frombuffer(_row_type(words).from_address(address), np.uint32)


@functools.cache
def _row_type(words: int) -> Any:
    return ctypes.c_uint32 * words


def table_of(ll_tokenizer: Any, vocab: int) -> TokenTable:
    """The :class:`TokenTable` of llguidance's tokenizer ``ll_tokenizer`` over ``vocab`` tokens (its special
    tokens, ids past the tokenizer's among them, never counted)."""
    special = [token for token in range(vocab) if ll_tokenizer.is_special_token(token)]
    return TokenTable([bytes(ll_tokenizer.decode_bytes([token])) for token in range(vocab)], special)
