"""The lean client's body side: a read of one event in one chunk, taken by bytes operations,
gives what the chunk decoder and the line reader give; ``data_stream`` on real sockets.

``_one_event`` is the path of one token per read (a GPU's pace); every buffer it does not
take must be left as it was, for the general path.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from proxima.proxy.backends.errors import BackendConnectionError
from proxima.proxy.backends.wire import WirePool
from proxima.proxy.backends.wire_body import _DataFields, _one_event, dechunk

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _general(buf: bytes) -> list[bytes] | None:
    """The fields of ``buf`` by ``dechunk`` and ``_DataFields`` when it is exactly complete
    chunks with nothing left over; None otherwise."""
    payloads, used, ended = dechunk(bytearray(buf))
    if used != len(buf) or ended:
        return None
    fields = _DataFields()
    out = fields.feed(b"".join(payloads))
    return out if not fields.rest else None


PAYLOADS = [
    b'data: {"a": 1}\n\n',
    b"data: [DONE]\n\n",
    b'data:{"no": "space"}\n\n',  # the general path's
    b'data: {"crlf": 1}\r\n\r\n',
    b"data: a\ndata: b\n\n",  # two fields in one event
    b": a comment\ndata: x\n\n",
    b"event: e\ndata: y\n\n",
    b"data: unfinished\n",
    b'data: {"text": "\xe2\x80\xa8 and \xc2\x85"}\n\n',
    b"data: \n\n",
    b"data: cr\rinside\n\n",
]


def _chunk(payload: bytes, size: int | None = None, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(payload) if size is None else size, ext, payload)


def test_one_event_matches_the_general_path_or_leaves_the_buffer() -> None:
    rng = random.Random(7)
    cases = [_chunk(p) for p in PAYLOADS]
    cases += [_chunk(p, ext=b";x=1") for p in PAYLOADS[:2]]  # a chunk extension
    cases += [_chunk(PAYLOADS[0], size=len(PAYLOADS[0]) - 1)]  # a wrong size
    cases += [_chunk(PAYLOADS[0]) + _chunk(PAYLOADS[1])]  # two chunks in one read
    cases += [_chunk(PAYLOADS[0]) + b"0\r\n\r\n", b"0\r\n\r\n", b"zz\r\ndata: x\n\n\r\n"]
    for i in range(200):  # random JSON-ish lines (line breaks in half of them), cut or whole
        alphabet = b'abc{}":, ' + (b"\n\r" if i % 2 else b"")
        text = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        cases.append(_chunk(b"data: " + text + b"\n\n"))
        whole = _chunk(b"data: " + text + b"\n\n")
        cases.append(whole[: rng.randrange(1, len(whole))])
    taken = 0
    for case in cases:
        buf = bytearray(case)
        field = _one_event(buf)
        if field is None:
            assert buf == case, case  # left as it was, for the general path
            continue
        taken += 1
        assert buf == b""
        assert [field] == _general(case), case
    assert taken > 100  # the common shape is taken


async def test_data_stream_over_reads_of_every_shape() -> None:
    """One event per read, several per read, events cut across reads: the fields in order,
    the connection back to the pool at the end."""
    events = [b'data: {"i": %d}\n\n' % i for i in range(6)] + [b"data: [DONE]\n\n"]
    chunks = [_chunk(e) for e in events]
    body = HEAD + b"".join(chunks) + b"0\r\n\r\n"
    cuts = [len(HEAD) + len(chunks[0]), len(HEAD) + len(chunks[0]) + 5]
    cuts += [len(body) - len(chunks[-1]) - 5 - 9, len(body) - 3]
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.02)
        await asyncio.sleep(1)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = WirePool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        async with await pool.post("/generate", b"{}") as resp:
            fields = [f async for batch in resp.data_batches() for f in batch]
        assert fields == [e[6:-2] for e in events]
        assert pool.idle == 1  # read to its end: kept alive
    finally:
        pool.close()
        server.close()


async def test_a_data_stream_that_stalls_times_out_as_a_lost_backend() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + _chunk(b"data: 1\n\n"))  # then nothing
        await asyncio.sleep(5)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = WirePool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout=0.2)
    try:
        async with await pool.post("/generate", b"{}") as resp:
            got: list[bytes] = []
            with pytest.raises(BackendConnectionError, match="no data from the backend"):
                async for batch in resp.data_batches():
                    got += batch
        assert got == [b"1"]
    finally:
        pool.close()
        server.close()
