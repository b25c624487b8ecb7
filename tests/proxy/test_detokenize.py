"""Streamed text always concatenates to the non-streamed text."""

from __future__ import annotations

import copy
import random

import pytest
from proxima.proxy.rendering.detokenize import IncrementalDetokenizer, _ByteLevelText, text_decoder
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tiny_tokenizer()


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(30))
def test_random_bytes_round_trip(tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Arbitrary token ids, invalid UTF-8 included (what a random model emits)."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 80))]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(chunk) for chunk in _chunks(ids, rng)) + detok.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == detok.text


def test_multibyte_characters_are_held_until_complete(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("héllo wörld ✓", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.finish() == "héllo wörld ✓"


def test_stop_string_is_never_streamed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("The answer is 42. END and more", add_special_tokens=False)
    cut = len(tokenizer.encode("The answer is 42. END", add_special_tokens=False))
    detok = IncrementalDetokenizer(tokenizer, stop=[" END"])
    streamed = "".join(detok.add([i]) for i in ids[:cut])
    assert " E" not in streamed  # a possible stop prefix is held back
    streamed += detok.finish(matched_stop=" END")
    assert streamed == "The answer is 42."


@pytest.mark.parametrize("seed", range(5))
def test_direct_rust_decoding_matches_transformers(tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    """The fast path skips transformers' layers, not its result (special tokens included)."""
    rng = random.Random(seed)
    special = tokenizer.all_special_ids
    ids = [
        rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(tokenizer))
        for _ in range(60)
    ]
    decode = text_decoder(tokenizer)
    assert decode.func.__self__ is tokenizer._tokenizer  # the Rust call, no Python layers
    for end in range(len(ids) + 1):
        assert decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tokenizer) -> None:  # type: ignore[no-untyped-def]
    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("quiet words", add_special_tokens=False)
    detok = IncrementalDetokenizer(shouting)
    assert "".join(detok.add([i]) for i in ids) + detok.finish() == "QUIET WORDS"


def _spaced_tokenizer():  # type: ignore[no-untyped-def]
    """A WordPiece tokenizer: each word's space is the decoder's, put before every token but
    the text's first, and its special tokens are skipped (so a window of only special tokens
    would make the next word the text's first, without its space)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "and": 2, "more": 3, "x": 4, "##y": 5, ".": 6}
    rust = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    rust.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", sep_token="[SEP]")


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_a_word_after_special_tokens_keeps_its_space(size: int) -> None:
    spaced = _spaced_tokenizer()
    ids = [4, 5, 1, 2, 1, 1, 3, 6, 0, 1, 2, 4, 1, 1, 1, 1, 1, 1, 1, 3]
    detok = IncrementalDetokenizer(spaced)
    text = "".join(detok.add(ids[i : i + size]) for i in range(0, len(ids), size))
    text += detok.finish()
    assert text == spaced.decode(ids, skip_special_tokens=True) == "xy and more. and x more"


def test_a_long_reply_is_not_copied_per_batch(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The text handed out is kept as pieces: ``text`` is whole only when asked for."""
    ids = tokenizer.encode("word " * 3000, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert detok.text == streamed  # joined on demand, mid-stream
    assert streamed + detok.finish() == "word " * 3000 == detok.text


def test_a_byte_level_tokenizer_joins_whole_characters_without_decoding(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("plain words, then ✓ and 日本 again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:  # the single-token cache, warm
        detok._token_text(token)
    decodes: list[list[int]] = []
    decode = detok._decode
    detok._decode = lambda batch: decodes.append(batch) or decode(batch)  # type: ignore[method-assign]
    text = "".join(detok.add([token]) for token in ids) + detok.finish()
    assert text == "plain words, then ✓ and 日本 again"
    # Only the tokens of a split character, and the end, were decoded.
    multibyte = sum(1 for t in ids if "\ufffd" in tokenizer.decode([t]))
    assert len(decodes) <= 2 * multibyte + 2


@pytest.mark.parametrize("seed", range(5))
def test_byte_level_text_joins_token_bytes_as_the_tokenizer_decodes(tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Arbitrary sequences (split and invalid UTF-8, special tokens) decode through the
    tokens' bytes exactly as through the tokenizer, and without calling it once learnt."""
    rng = random.Random(seed)
    special = tokenizer.all_special_ids
    rust_decode = text_decoder(tokenizer)
    calls: list[list[int]] = []
    text = _ByteLevelText(tokenizer._tokenizer, lambda ids: calls.append(ids) or rust_decode(ids))
    for _ in range(200):
        ids = [
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
            for _ in range(rng.randint(0, 12))
        ]
        assert text(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(len(c) == 1 for c in calls)  # only each token's own check, once
    assert len(calls) == len(set(map(tuple, calls))) <= len(tokenizer)


def test_an_added_token_outside_the_byte_alphabet_is_decoded_by_the_tokenizer() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<tool ✓>"])
    added = tokenizer.convert_tokens_to_ids("<tool ✓>")
    ids = tokenizer.encode("ok ", add_special_tokens=False) + [added]
    detok = IncrementalDetokenizer(tokenizer)
    assert isinstance(detok._decode, _ByteLevelText)
    text = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "✓" in text and added in detok._decode._opaque
