"""Text in and out: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

Without a tokenizer the engine works on token ids only. Output text is decoded with special
tokens skipped. Streaming decodes incrementally: a few tokens of context are re-decoded with
each new token, so the pieces concatenate to the full decode even where one character spans
several byte-level tokens or a word-start marker depends on its neighbour.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from corelib.errors import ConfigError
from corelib.trust.files import read_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_LIMIT = 256 << 20  # the largest tokenizer.json files are a few tens of MB
_INCOMPLETE = "\ufffd"  # what a decoder yields for a character whose bytes have not all arrived


class Tokenizer:
    """Encode prompts and decode outputs with a Hugging Face ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(
                f"{path} needs the tokenizers package: pip install 'tokenizers>=0.15'"
            ) from None
        text = read_text(path, "the tokenizer", TOKENIZER_LIMIT)  # a regular file, bounded: never a FIFO
        try:
            self._tokenizer = HFTokenizer.from_str(text)
        except Exception as error:  # noqa: BLE001 - the library raises plain Exception for a bad file
            raise ConfigError(f"{path} cannot be read as a tokenizer: {' '.join(str(error).split())}") from None
        self.path = path

    @classmethod
    def from_directory(cls, directory: str | Path | None) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no ``tokenizer.json``."""
        if not directory:
            return None
        path = Path(directory).expanduser() / TOKENIZER_FILE
        return cls(path) if os.path.lexists(path) else None  # anything there but a tokenizer is an error

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the vocabulary's longest entry: no token covers more text, so a text of more than
        ``n * longest_token_chars`` characters has more than ``n`` tokens (byte-level vocabularies write one
        character per byte)."""
        return max((len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer adds (a BOS, for Llama) unless told not to.

        A rendered chat template already holds its special tokens as text, so it is encoded without.
        Through the batch call, which lets go of the GIL while it works (the single call holds it
        throughout: a long prompt would stop every other thread, an HTTP server's event loop among them).
        """
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_special(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` with their special tokens kept (``skip_special_tokens=False``)."""
        return self.decode(token_ids, skip_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode if skip_special_tokens else self.decode_special)


class IncrementalDecoder:
    """Turns one request's tokens, as they arrive, into text pieces that add up to the full decode.

    ``decode`` is a tokenizer's (or any function of token ids to text, for a model without one).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window that is decoded again for each new token
        self._read = 0  # tokens before this index have been turned into text

    @property
    def num_tokens(self) -> int:
        """Token ids pushed so far."""
        return len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text that ``token_ids`` complete ('' while a character is still incomplete)."""
        self._ids.extend(token_ids)
        decode = self._decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
