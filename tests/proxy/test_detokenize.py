"""Streamed text always concatenates to the non-streamed text."""

from __future__ import annotations

import copy
import random

import pytest
from proxima.proxy.rendering.detokenize import IncrementalDetokenizer, text_decoder
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
