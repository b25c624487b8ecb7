"""``ChunkReader``: the whole-read fast path gives exactly the chunk-by-chunk path's tokens.

Streams are built as SGLang sends them (incremental or cumulative chunks, a queued
request's abort that repeats its last token, a weight version that changes mid-stream,
top logprobs) and cut into reads at random; every read's deltas are compared with those
of the general path alone, and the concatenated tokens with the stream's own.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from proxima.proxy.backends.errors import BackendOperationFailed, BackendRejected
from proxima.proxy.backends.stream_chunks import ChunkReader, NonFiniteLogprob, TokenDelta


def _stream(rng: random.Random, *, incremental: bool) -> tuple[list[bytes], list[tuple]]:
    """``data:`` fields of one stream, and its tokens as (id, logprob, weight version)."""
    n = rng.randint(1, 40)
    tops = rng.random() < 0.2
    version = "3"
    tokens: list[tuple[int, float, str]] = []
    fields = []
    for i in range(n):
        if rng.random() < 0.1:
            version = str(int(version) + 1)  # a weight update between two decode steps
        tokens.append((rng.randrange(1000), -rng.random() * 5, version))
        start = len(tokens) - 1 if incremental else 0
        meta: dict[str, Any] = {
            "id": "r",
            "finish_reason": {"type": "length", "length": n} if i == n - 1 else None,
            "prompt_tokens": 7,
            "completion_tokens": len(tokens),
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for t, lp, _ in tokens[start:]],
        }
        if tops:
            meta["output_top_logprobs"] = [[[lp, t, None]] for t, lp, _ in tokens[start:]]
        chunk = {"text": "", "output_ids": [t for t, _, _ in tokens[start:]], "meta_info": meta}
        fields.append(json.dumps(chunk).encode())
        if incremental and i == n - 2 and rng.random() < 0.2:
            # The abort of a queued request: its last token again, with all logprobs.
            meta = {**meta, "output_token_logprobs": [[lp, t, None] for t, lp, _ in tokens]}
            fields.append(json.dumps({**chunk, "meta_info": meta}).encode())
    return [*fields, b"[DONE]"], [(t, lp) for t, lp, _ in tokens]


def _reads(fields: list[bytes], rng: random.Random) -> list[list[bytes]]:
    out, i = [], 0
    while i < len(fields):
        k = rng.randint(1, 6)
        out.append(fields[i : i + k])
        i += k
    return out


def _general(reader: ChunkReader, fields: list[bytes]) -> list[TokenDelta]:
    """The chunk-by-chunk path alone, on the same fields."""
    if fields and fields[-1] == b"[DONE]":
        fields = fields[:-1]
        reader.done = True
    return reader._general([json.loads(f) for f in fields])


@pytest.mark.parametrize("seed", range(40))
def test_reads_give_the_chunk_by_chunk_deltas(seed: int) -> None:
    rng = random.Random(seed)
    fields, tokens = _stream(rng, incremental=seed % 4 != 0)
    fast, slow = ChunkReader("u"), ChunkReader("u")
    got: list[TokenDelta] = []
    for read in _reads(fields, rng):
        deltas = list(fast.read(read))
        assert deltas == _general(slow, read)
        got += deltas
    assert fast.done and fast.seen == slow.seen == len(tokens)
    assert [t for d in got for t in d.token_ids] == [t for t, _ in tokens]
    assert [lp for d in got for lp in d.logprobs] == [lp for _, lp in tokens]
    assert got[-1].finish_reason is not None and got[-1].finish_reason.type == "length"
    for delta in got:  # one weight version per delta: every token keeps its own
        assert delta.weight_version is not None


def test_fields_after_done_are_ignored() -> None:
    fields, tokens = _stream(random.Random(1), incremental=True)
    reader = ChunkReader("u")
    got = [d for d in reader.read([*fields, fields[0]])]
    assert [t for d in got for t in d.token_ids] == [t for t, _ in tokens]
    assert list(reader.read(fields[:1])) == []


def test_an_error_chunk_comes_after_the_tokens_before_it() -> None:
    fields, _ = _stream(random.Random(2), incremental=True)
    error = json.dumps({"error": {"message": "out of memory"}}).encode()
    reader = ChunkReader("u")
    deltas = reader.read([fields[0], fields[1], error, fields[2]])
    assert [len(d.token_ids) for d in deltas] == [2]  # the chunks before it, not after it
    assert isinstance(reader.failure, BackendRejected)
    assert "out of memory" in str(reader.failure)


@pytest.mark.parametrize("bad", [b"{not json", b'{"a": 1}, {"b": 2}'])
def test_a_malformed_chunk_is_a_backend_failure(bad: bytes) -> None:
    fields, _ = _stream(random.Random(3), incremental=True)
    with pytest.raises(BackendOperationFailed, match="malformed /generate chunk"):
        list(ChunkReader("u").read([fields[0], bad]))


def test_a_null_logprob_is_refused_on_the_fast_path() -> None:
    chunk = {
        "output_ids": [5, 6],
        "meta_info": {"completion_tokens": 2, "output_token_logprobs": [[-1.0, 5], [None, 6]]},
    }
    with pytest.raises(NonFiniteLogprob, match="token 6"):
        list(ChunkReader("u").read([json.dumps(chunk).encode()] * 1))


def test_incremental_chunks_of_one_version_take_the_fast_path() -> None:
    class Counting(ChunkReader):
        general = 0

        def _general(self, chunks: list[Any]):  # type: ignore[no-untyped-def]
            Counting.general += 1
            return super()._general(chunks)

    rng = random.Random(5)
    fields = []
    for i in range(30):
        meta = {"completion_tokens": i + 1, "weight_version": "2",
                "output_token_logprobs": [[-0.5, i, None]], "finish_reason": None}  # fmt: skip
        fields.append(json.dumps({"output_ids": [i], "meta_info": meta}).encode())
    reader = Counting("u")
    got = [
        t
        for read in _reads([*fields, b"[DONE]"], rng)
        for d in reader.read(read)
        for t in d.token_ids
    ]
    assert got == list(range(30)) and Counting.general == 0
