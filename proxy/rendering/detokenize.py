"""Incremental detokenization for streaming.

Text is emitted only once it is final: a token sequence that ends in the
middle of a multi-byte character decodes to U+FFFD, so that tail is held back
until the next token completes it; text that could be the start of a stop
string is held back until it is known not to be one. The concatenation of all
deltas equals ``decode(output_ids)`` (minus a matched stop string and what
follows it), which is what the non-streaming response returns.

A fast (Rust-backed) tokenizer is called directly: its ``decode`` is what
``PreTrainedTokenizerFast.decode`` runs under transformers' Python layers,
at a quarter of the cost per call. Any other tokenizer goes through its own
``decode``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenizers import Tokenizer

# Decode a window this many tokens before the unread ones so that merges and
# multi-byte characters at the boundary decode as they do in the full text.
_WINDOW = 6


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``decode(ids)`` without special tokens and without clean-up of spaces.

    The Rust tokenizer is called directly only under transformers' own
    ``decode`` and ``_decode`` (a subclass that overrides them keeps its say).
    """
    rust = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(rust, Tokenizer)
        and _qualname(cls, "_decode") == "PreTrainedTokenizerFast._decode"
        and _qualname(cls, "decode") == "PreTrainedTokenizerBase.decode"
    ):
        return partial(rust.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _qualname(cls: type, name: str) -> str:
    return getattr(getattr(cls, name, None), "__qualname__", "")


# Each tokenizer's text of single tokens: streamed tokens arrive one at a time, so the
# "prefix" window decoded before each new token is one token, the same ones again and again.
_SINGLE_TOKENS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, stop: list[str] | None = None):
        self._decode = text_decoder(tokenizer)
        try:
            self._single = _SINGLE_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: a cache of its own
            self._single = {}
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # final text decoded so far
        self._emitted = 0  # characters of _text already handed out
        self._stop = [s for s in stop or [] if s]

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became final."""
        self._ids.extend(token_ids)
        prefix = self._window(self._prefix_offset, self._read_offset)
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return self._release(final=False)
        self._text += full[len(prefix) :]
        # The next decode starts a few tokens back, so boundaries decode as in the full text.
        self._prefix_offset = max(self._read_offset, len(self._ids) - _WINDOW)
        self._read_offset = len(self._ids)
        return self._release(final=False)

    def _window(self, start: int, end: int) -> str:
        """The text of ``ids[start:end]``; single tokens come from the tokenizer's cache."""
        if end - start != 1:
            return self._decode(self._ids[start:end])
        token = self._ids[start]
        text = self._single.get(token)
        if text is None:
            text = self._single[token] = self._decode([token])
        return text

    def finish(self, matched_stop: str | None = None) -> str:
        """Flush everything (incomplete bytes included); cut at a matched stop string."""
        tail = self._decode(self._ids[self._prefix_offset :])
        head = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._text += tail[len(head) :]
        self._read_offset = len(self._ids)
        if matched_stop:
            cut = self._text.find(matched_stop, max(0, self._emitted - len(matched_stop)))
            if cut >= 0:
                self._text = self._text[:cut]
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        end = len(self._text)
        if not final and self._stop:
            end -= self._stop_prefix_len()
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that starts some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop), len(self._text)), best, -1):
                if self._text.endswith(stop[:k]):
                    best = k
                    break
        return best
