"""Structured output on the host: a request's JSON schema compiled into a grammar whose matcher masks its tokens.

The library is llguidance (the ``structured`` extra): no dependencies, one abi3 wheel for every
Python, grammars compiled lazily in a millisecond or so, and a mask computed in some 20 µs per
token over a 150k vocabulary (docs/serving.md has the figures against xgrammar and outlines-core).

Each structured request holds a :class:`GrammarState`. Before each step in which it samples,
the packer writes its row of the step's token bitmask (int32, bit ``t`` of word ``t // 32``: token
``t`` is allowed) from the matcher; the runner applies the mask on the device before any other
sampling work. After the token comes back the matcher takes it: a token it refuses fails the
request, and once the grammar is complete the request finishes (its EOS would be the one token
left). The matcher has seen every token before it writes the next mask: steps holding such a
request run synchronously, or (``structured_overlap``) are queued owing their mask, which is
computed once the previous step's tokens were taken, on a thread of its own while the loop packs
the next step (``corelib.engine.step_masks``).

A grammar is compiled once per distinct schema (an LRU cache) and bounded by the parser limits
below, so a hostile schema costs a bounded amount of work and is refused in one line. Strings whose
``maxLength`` makes llguidance walk the vocabulary at every character have their bounds counted
beside the grammar instead (``corelib.engine.string_bounds``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from corelib.engine.string_bounds import Bounds, LostTrack, StringTracker, TokenTable, bounds_of, row_view, table_of
from corelib.support.structured import StructuredOutputsError, StructuredOutputsParams
from corelib.support.text import TOKENIZER_LIMIT, Tokenizer
from corelib.trust.files import read_text

INSTALL_HINT = "pip install 'corelib[structured]' (the llguidance package)"
MAX_CACHED_GRAMMARS = 256
# Bounds on the work one grammar may take (llguidance's parser limits, about a tenth of its defaults'
# lexer budget): every schema of the JSON Schema test suites fits many times over, and a hostile one
# stops within some tens of milliseconds of compile or mask work instead of seconds.
LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,
    "max_grammar_size": 200_000,
    "verbose_errors": False,  # an error names the problem, not the parser's state
}
# Compact JSON: no whitespace between the tokens of the output (a small model would spend its tokens on it).
COMPILE_OPTIONS = {"whitespace_flexible": False}
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a character a JSON string holds unescaped
# llguidance's slices: the tokens of each slice go into the mask at once wherever the grammar allows every one of
# them, instead of each being walked. Its default slices are strings of up to 10 and 30 characters, so inside a
# string of maxLength n the last 10 characters walk nearly the whole vocabulary (2-3 ms a row at 152k tokens). A
# slice per length up to 10, then coarser, takes the walk down to the tokens longer than what is left of the
# string; the masks are the same (a test compares them). Built once with the tokenizer: under a second more.
SLICES = (r"[\x20\x0A\x0D\x09]+",
          *(f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 20, 24, 30)),
          f"{_STRING_CHAR}+")


def llguidance_module() -> Any:
    """The llguidance module; StructuredOutputsError saying what to install when it is missing."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputsError("structured_outputs", f"structured output needs the llguidance package: "
                                                           f"{INSTALL_HINT}") from None
    version = getattr(llguidance, "__version__", "")
    if _release(version) < LLGUIDANCE_MIN:  # 1.7 takes a tokenizer's several EOS ids
        raise StructuredOutputsError("structured_outputs", f"structured output needs llguidance "
                                                           f"{'.'.join(map(str, LLGUIDANCE_MIN))} or newer, not "
                                                           f"{version or 'an unknown version'}: {INSTALL_HINT}")
    return llguidance


#: the oldest llguidance structured output runs with (as pyproject's extras ask)
LLGUIDANCE_MIN = (1, 7)


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string; (0,) where it does not start with two numbers."""
    parts = version.split(".")[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else (0,)


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``, checked without a tokenizer; StructuredOutputsError naming the
    schema when llguidance refuses it (an unknown keyword, a bad pattern, a schema beyond the limits)."""
    ll = llguidance_module()
    field = "structured_outputs.json" if params.json is not None else "structured_outputs.json_object"
    try:
        grammar = str(ll.LLMatcher.grammar_from_json_schema(params.schema, overrides=COMPILE_OPTIONS))
        error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    except (ValueError, TypeError, RuntimeError) as problem:
        raise StructuredOutputsError(field, f"{field}: the schema cannot be compiled: {_one_line(problem)}") from None
    if error:
        raise StructuredOutputsError(field, f"{field}: the schema cannot be compiled: {_one_line(messages[0])}")
    return grammar


def parser_limits() -> Any:
    return llguidance_module().LLParserLimits(**LIMITS)


class GrammarCache:
    """Grammars by schema, compiled once each (least recently used dropped past ``capacity``); thread-safe."""

    def __init__(self, capacity: int = MAX_CACHED_GRAMMARS) -> None:
        self.capacity = capacity
        self._grammars: OrderedDict[str, str | StructuredOutputsError] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)

    def grammar(self, params: StructuredOutputsParams) -> str:
        """``params``' grammar; a schema refused once is refused again from the cache, with the same error."""
        key = params.key
        with self._lock:
            found = self._grammars.get(key)
            if found is not None:
                self._grammars.move_to_end(key)
        if found is None:
            try:
                found = grammar_of(params)
            except StructuredOutputsError as error:
                if "llguidance package" in str(error):
                    raise  # the library is missing, not the schema wrong: nothing to remember
                found = error
            with self._lock:
                self.compiled += 1
                self._grammars[key] = found
                while len(self._grammars) > self.capacity:
                    self._grammars.popitem(last=False)
        if isinstance(found, StructuredOutputsError):
            raise StructuredOutputsError(found.field, str(found))
        return found


_CHECKED = GrammarCache()  # the server's check of a request's schema, before it reaches the engine


def check_grammar(params: StructuredOutputsParams) -> None:
    """Compile ``params``' grammar (once per distinct schema, bounded by the parser limits) without a
    tokenizer: what the HTTP server runs, off its event loop, so that a bad schema is refused up front."""
    _CHECKED.grammar(params)


def mask_threads() -> int:
    """The threads that write a step's masks: llguidance's own default (80 % of the CPUs this process may run
    on, at most 32, at least one)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus * 4 // 5))


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool, one per process."""
    return llguidance_module().LLExecutor(num_threads=mask_threads())


def compute_rows(states: list[tuple[GrammarState, int]], address: int, row_bytes: int, rows: int) -> None:
    """Each state's matcher's mask into its row of the ``rows`` x ``row_bytes`` bitmask at ``address`` (the bounds
    counted beside the grammar are applied apart: :meth:`GrammarState.restrict`), the rows computed in parallel
    by llguidance's thread pool (one per process, made on first use) without the GIL: a step's masks are the
    host's work between two steps, since the grammar needs the token just sampled."""
    if states:
        _executor().unsafe_compute_mask_ptr([(state.matcher, row) for state, row in states], address, row_bytes,
                                            rows)


class GrammarState:
    """One request's matcher: writes its row of the token bitmask, takes each sampled token. Where its schema
    has strings whose length bounds are counted beside the grammar (``corelib.engine.string_bounds``), the
    matcher's grammar has them taken out and ``tracker`` takes the tokens they forbid out of each mask."""

    def __init__(self, matcher: Any, tracker: StringTracker | None = None) -> None:
        self._matcher = matcher
        self._tracker = tracker

    @property
    def matcher(self) -> Any:
        """llguidance's matcher (for :func:`compute_rows`)."""
        return self._matcher

    @property
    def counts_bounds(self) -> bool:
        """Whether :meth:`restrict` takes anything out: the schema has strings counted beside the grammar."""
        return self._tracker is not None

    def fill(self, address: int, nbytes: int) -> None:
        """Write the mask of the next token into the ``nbytes`` bytes at ``address`` (one row of int32 words)."""
        self._matcher.unsafe_compute_mask_ptr(address, nbytes)
        if self._tracker is not None:
            self.restrict(row_view(address, nbytes // 4))

    def restrict(self, row: npt.NDArray[np.uint32]) -> None:
        """Take the tokens the counted strings' bounds forbid out of ``row``, the mask the matcher wrote (a view of
        the step's bitmask, written in place)."""
        tracker = self._tracker
        if tracker is not None:
            tracker.restrict(row)

    def advance(self, token: int) -> str | None:
        """Take the sampled ``token``: None to go on, "done" when the grammar is complete, else why it failed."""
        matcher = self._matcher
        if matcher.is_stopped() and not matcher.is_error():
            return "done"  # the mask allowed only the end (EOS): the output is complete
        if not matcher.consume_token(token):
            return f"structured output: token {token} does not fit the grammar ({_one_line(matcher.get_error())})"
        if matcher.is_error():
            return f"structured output: {_one_line(matcher.get_error())}"
        tracker = self._tracker
        if tracker is not None and tracker.table.plain(token):
            try:
                fits = tracker.feed_token(token)
            except LostTrack as lost:
                return f"structured output: token {token} left the JSON the string bounds follow ({lost})"
            if not fits:
                return f"structured output: token {token} breaks a string's minLength or maxLength"
        return "done" if matcher.is_stopped() else None


class StructuredOutputs:
    """The engine's side of structured output: the tokenizer as llguidance sees it, built once on first use,
    the grammar cache, and a matcher per request."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.grammars = GrammarCache()
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        # Matchers per grammar that never take a token: each request's is a copy of one of them (some µs, where
        # making one costs about a millisecond at a 150k vocabulary), least recently used dropped past the cache's
        # size. Copies of one matcher share its lexer, and llguidance lets one mask at a time use a lexer: with one
        # template the rows of a step would be written one after another whatever the thread pool. So a grammar
        # has up to ``templates_per_grammar`` independent ones (one per mask thread), made as requests arrive and
        # handed out in turn.
        self.templates_per_grammar = mask_threads()
        self._templates: OrderedDict[str, _Templates] = OrderedDict()
        # Per schema, the strings whose bounds are counted beside the grammar (None: none is), and the
        # vocabulary's bytes they are counted over, built with the first such schema.
        self.count_string_bounds = True  # False leaves every bound to llguidance's grammar (benchmarks compare)
        self._bounds: OrderedDict[str, Bounds | None] = OrderedDict()
        self._table: TokenTable | None = None

    def state(self, params: StructuredOutputsParams | Mapping[str, Any]) -> GrammarState:
        """A fresh matcher for ``params``; StructuredOutputsError (one line) when it cannot be served."""
        typed = StructuredOutputsParams.of(params)
        grammar = self.grammars.grammar(typed)  # the schema as given: a bad one is refused as it is
        bounds = self.bounds(typed)
        tracker = None
        if bounds is not None:
            grammar = self.grammars.grammar(StructuredOutputsParams(json=bounds.grammar_schema))
            tracker = StringTracker(bounds, self.token_table())
        key = _template_key(typed, bounds)
        with self._lock:
            templates = self._templates.get(key)
            if templates is not None:
                self._templates.move_to_end(key)
                template = templates.next_one()
                if template is not None:
                    return GrammarState(template.deep_copy(), tracker)
        ll = llguidance_module()
        template = ll.LLMatcher(self.ll_tokenizer(), grammar, limits=parser_limits())
        if template.is_error():
            problem = _one_line(template.get_error())
            raise StructuredOutputsError("structured_outputs", f"structured_outputs: the grammar cannot be used "
                                                               f"with this tokenizer: {problem}")
        with self._lock:
            templates = self._templates.setdefault(key, _Templates(self.templates_per_grammar))
            self._templates.move_to_end(key)
            templates.add(template)
            while len(self._templates) > self.grammars.capacity:
                self._templates.popitem(last=False)
        return GrammarState(template.deep_copy(), tracker)

    def bounds(self, params: StructuredOutputsParams) -> Bounds | None:
        """The strings of ``params``' schema counted beside the grammar (None where none is), once per schema."""
        if params.json is None or not self.count_string_bounds:
            return None
        with self._lock:
            if params.key in self._bounds:
                self._bounds.move_to_end(params.key)
                return self._bounds[params.key]
        found = bounds_of(params.schema)
        with self._lock:
            self._bounds[params.key] = found
            while len(self._bounds) > self.grammars.capacity:
                self._bounds.popitem(last=False)
        return found

    def token_table(self) -> TokenTable:
        """Each token's bytes as llguidance sees them, scanned for the string bounds (built once, with the first
        schema that needs it: a few tenths of a second at a 150k vocabulary)."""
        ll_tokenizer = self.ll_tokenizer()
        with self._lock:
            if self._table is None:
                self._table = table_of(ll_tokenizer, self.vocab_size)
            return self._table

    def templates(self, params: StructuredOutputsParams | Mapping[str, Any]) -> int:
        """How many independent matchers ``params``' grammar has so far."""
        typed = StructuredOutputsParams.of(params)
        key = _template_key(typed, self.bounds(typed))
        with self._lock:
            found = self._templates.get(key)
            return 0 if found is None else len(found.matchers)

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the checkpoint's tokenizer, over the model's whole vocabulary (ids past the
        tokenizer's are never allowed). Built once: one to two seconds for a 150k vocabulary."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise StructuredOutputsError("structured_outputs", "structured output needs the checkpoint's "
                                                                       "tokenizer (tokenizer.json): use a checkpoint "
                                                                       "with one (model.path)")
                ll = llguidance_module()
                if self._tokenizer.vocab_size > self.vocab_size:
                    raise StructuredOutputsError("structured_outputs", f"structured output: the tokenizer has "
                                                                       f"{self._tokenizer.vocab_size} tokens, more "
                                                                       f"than the model's {self.vocab_size}")
                text = read_text(self._tokenizer.path, "the tokenizer", TOKENIZER_LIMIT)
                self._ll_tokenizer = ll.LLTokenizer(text, n_vocab=self.vocab_size,
                                                    eos_token=self.eos_token_ids or None, slices=list(SLICES))
            return self._ll_tokenizer


def _template_key(params: StructuredOutputsParams, bounds: Bounds | None) -> str:
    """What a grammar's independent matchers are kept under: the schema, and whether its matchers' grammar has the
    counted strings' bounds taken out."""
    return params.key if bounds is None else f"counted:{params.key}"


class _Templates:
    """A grammar's independent matchers, handed out in turn once there are as many as wanted."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.matchers: list[Any] = []
        self._turn = 0

    def next_one(self) -> Any:
        """The next matcher to copy; None while fewer than wanted exist (the caller makes one)."""
        if len(self.matchers) < self.wanted:
            return None
        self._turn = (self._turn + 1) % len(self.matchers)
        return self.matchers[self._turn]

    def add(self, matcher: Any) -> None:
        if len(self.matchers) < self.wanted:
            self.matchers.append(matcher)


def _one_line(message: object, limit: int = 200) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else f"{text[:limit]}..."
