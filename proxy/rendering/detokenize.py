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

A byte-level tokenizer's decode (GPT-2's, Qwen's, Llama 3's: a token's text is its bytes,
decoded as UTF-8) does not depend on a token's neighbours once the text before it is final:
new tokens whose own texts are whole characters (no U+FFFD) are their texts joined, from
the single-token cache, with no decode at all. The decodes that are left (a character split
across tokens: text in other scripts, or a random model's bytes) join the tokens' bytes and
decode them as UTF-8 in Python (``_ByteLevelText``), at less than half the cost of the call
into the Rust tokenizer; each token's bytes are checked once against its own decode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel

# The most tokens decoded before the unread ones (the window, so that spaces, merges and
# multi-byte characters at the boundary decode as they do in the full text): the window
# reaches back to the last token with text of its own, past special tokens (skipped).
_WINDOW = 64


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``decode(ids)`` without special tokens and without clean-up of spaces.

    The Rust tokenizer is called directly only under transformers' own
    ``decode`` and ``_decode`` (a subclass that overrides them keeps its say).
    """
    rust = _rust_of(tokenizer)
    if rust is not None:
        return partial(rust.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _rust_of(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer ``text_decoder`` calls directly, if it may."""
    rust = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(rust, Tokenizer)
        and _qualname(cls, "_decode") == "PreTrainedTokenizerFast._decode"
        and _qualname(cls, "decode") == "PreTrainedTokenizerBase.decode"
    ):
        return rust
    return None


def byte_level(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is decoded by its Rust tokenizer (``text_decoder``) and that
    decoder is byte-level alone: a token's text is then its own bytes' (module docstring)."""
    rust = _rust_of(tokenizer)
    return rust is not None and type(rust.decoder) is ByteLevel


def _qualname(cls: type, name: str) -> str:
    return getattr(getattr(cls, name, None), "__qualname__", "")


def _byte_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for: the printable
    Latin-1 characters (but the soft hyphen) stand for themselves, every other byte, in
    order, for the characters from U+0100 on (what ``decoders.ByteLevel`` undoes)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in printable)
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


_BYTE_OF = _byte_alphabet()


class _ByteLevelText:
    """``text_decoder`` of a byte-level tokenizer, without the call into Rust when every
    token's bytes are known: the tokens' bytes joined and decoded as UTF-8, invalid
    sequences replaced as the tokenizer replaces them (one U+FFFD per maximal invalid
    subsequence). A token's bytes come from its vocabulary entry and are kept only when
    they decode, alone, to the tokenizer's own decode of it (a skipped special token: no
    bytes); any other token (an added token whose text is not in the byte alphabet, say)
    sends the sequences that hold it to the tokenizer."""

    __slots__ = ("_bytes", "_decode", "_opaque", "_rust")

    def __init__(self, rust: Tokenizer, decode: Callable[[list[int]], str]):
        self._rust = rust
        self._decode = decode
        self._bytes: dict[int, bytes] = {}
        self._opaque: set[int] = set()

    def __call__(self, ids: list[int]) -> str:
        try:
            data = b"".join(map(self._bytes.__getitem__, ids))
        except KeyError:
            if not self._learn(ids):
                return self._decode(ids)
            data = b"".join(map(self._bytes.__getitem__, ids))
        return data.decode("utf-8", "replace")

    def _learn(self, ids: list[int]) -> bool:
        """Each new token's bytes (or its mark as one the tokenizer decodes); whether every
        token of ``ids`` has bytes now."""
        for token in ids:
            if token in self._bytes or token in self._opaque:
                continue
            own = self._decode([token])
            entry = self._rust.id_to_token(token)
            if own == "":  # a special token (skipped), or no text at all
                self._bytes[token] = b""
            elif entry is not None and all(c in _BYTE_OF for c in entry):
                data = bytes(_BYTE_OF[c] for c in entry)
                if data.decode("utf-8", "replace") == own:
                    self._bytes[token] = data
                else:
                    self._opaque.add(token)
            else:
                self._opaque.add(token)
        return self._opaque.isdisjoint(ids)


# Each byte-level tokenizer's ``_ByteLevelText`` (its token bytes, learnt once per process).
_BYTE_LEVEL: weakref.WeakKeyDictionary[Any, _ByteLevelText] = weakref.WeakKeyDictionary()


def _decoder_of(tokenizer: Any) -> Callable[[list[int]], str]:
    """``text_decoder(tokenizer)``, through the tokens' bytes for a byte-level one."""
    rust = _rust_of(tokenizer)
    if rust is None or type(rust.decoder) is not ByteLevel:
        return text_decoder(tokenizer)
    try:
        text = _BYTE_LEVEL.get(tokenizer)
        if text is None:
            text = _BYTE_LEVEL[tokenizer] = _ByteLevelText(rust, text_decoder(tokenizer))
    except TypeError:  # not weakly referenceable: its own, for this reply
        return _ByteLevelText(rust, text_decoder(tokenizer))
    return text


# Each tokenizer's text of single tokens: streamed tokens arrive one at a time, so the
# "prefix" window decoded before each new token is one token, the same ones again and again.
_SINGLE_TOKENS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """One streamed reply's text, token batch by token batch (module docstring).

    Each ``add`` decodes once: the new tokens after a window of the last token read,
    whose own text comes from the tokenizer's single-token cache (more tokens when the
    last has no text of its own: a special token). The text handed out is kept as
    pieces, joined once by ``finish``, so a long reply costs no copy of its whole text
    per batch.
    """

    def __init__(self, tokenizer: Any, *, stop: list[str] | None = None):
        self._decode = _decoder_of(tokenizer)
        try:
            self._single = _SINGLE_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: a cache of its own
            self._single = {}
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent: list[str] = []  # the text handed out, piece by piece
        self._unsent = ""  # final text not handed out yet (a possible stop string's start)
        self._stop = [s for s in stop or [] if s]
        self._longest = max(map(len, self._stop), default=0)
        self._recent = ""  # the last ``_longest`` characters handed out
        self._text: str | None = None  # the whole text, once finished
        self._joinable = byte_level(tokenizer)

    @property
    def text(self) -> str:
        if self._text is not None:
            return self._text
        return "".join(self._sent) + self._unsent

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became final."""
        if self._joinable and self._read_offset == len(self._ids):
            # Byte-level, and the text so far is final: whole characters are their texts.
            if len(token_ids) == 1:
                token = token_ids[0]
                piece = self._single.get(token) or self._token_text(token)
            else:
                texts = list(map(self._single.get, token_ids))
                if None in texts:
                    texts = [self._token_text(token) for token in token_ids]
                piece = "".join(texts)  # type: ignore[arg-type]
            if "\ufffd" not in piece:
                self._ids.extend(token_ids)
                if piece and len(token_ids) == 1:  # the window: this token, with its text
                    self._read_offset = len(self._ids)
                    self._prefix_offset = self._read_offset - 1
                else:
                    self._advance()
                if self._stop or self._unsent:
                    self._unsent += piece
                    return self._release()
                if piece:
                    self._sent.append(piece)
                return piece
        self._ids.extend(token_ids)
        prefix = self._window(self._prefix_offset, self._read_offset)
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return self._release() if self._unsent else ""
        self._unsent += full[len(prefix) :]
        self._advance()
        return self._release()

    def _advance(self) -> None:
        """Every token is read: the next decode starts a window back, so the new tokens
        decode as they do in the full text (not as a text's first token, whose space a
        tokenizer may strip): from the last token with text of its own (past special
        tokens, which have none)."""
        self._read_offset = end = len(self._ids)
        start = end - 1
        while start > 0 and end - start < _WINDOW and not self._token_text(self._ids[start]):
            start -= 1
        self._prefix_offset = start

    def _window(self, start: int, end: int) -> str:
        """The text of ``ids[start:end]``; single tokens come from the tokenizer's cache."""
        if end - start != 1:
            return self._decode(self._ids[start:end]) if end > start else ""
        return self._token_text(self._ids[start])

    def _token_text(self, token: int) -> str:
        text = self._single.get(token)
        if text is None:
            text = self._single[token] = self._decode([token])
        return text

    def finish(self, matched_stop: str | None = None) -> str:
        """Flush everything (incomplete bytes included); cut at a matched stop string."""
        tail = self._decode(self._ids[self._prefix_offset :])
        head = self._window(self._prefix_offset, self._read_offset)
        self._read_offset = len(self._ids)
        sent = "".join(self._sent)
        text = sent + self._unsent + tail[len(head) :]
        if matched_stop:
            cut = text.find(matched_stop, max(0, len(sent) - len(matched_stop)))
            if cut >= 0:
                text = text[:cut]
        self._text = text
        self._unsent = ""
        return text[len(sent) :]

    def _release(self) -> str:
        """The unsent text, less the longest suffix of the text that starts a stop string."""
        piece = self._unsent
        if self._stop:
            hold = self._stop_prefix_len(self._recent + piece)
            if hold:
                piece = piece[: max(0, len(piece) - hold)]
            self._recent = (self._recent + piece)[-self._longest :]
        if piece:
            self._sent.append(piece)
            self._unsent = self._unsent[len(piece) :]
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that starts some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop), len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
