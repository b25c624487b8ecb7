"""The lean HTTP/1.1 generation client against scripted servers on real loopback sockets.

Each server here writes exact bytes (chunk sizes, split writes, early
closes), so the client's framing, pooling and retry rules are checked on
what crosses the socket, not on what a framework chooses to send.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendOperationFailed,
    BackendRejected,
)
from proxima.proxy.backends.protocol import GenerateRequest, SamplingParams
from proxima.proxy.backends.sglang import SGLangClient
from proxima.proxy.backends.wire import WirePool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQUEST = GenerateRequest(
    input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=2), return_logprob=True
)


class Scripted:
    """A loopback server whose every connection runs ``handler``; counts connections."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request (head and body, none without a content-length: a GET); False
        when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
            return False
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        self.requests.append(head + await reader.readexactly(length))
        return True


@asynccontextmanager
async def scripted(
    handler_of: Callable[[Scripted], Handler],
) -> AsyncIterator[tuple[Scripted, str]]:
    srv = Scripted(lambda r, w: handler_of(srv)(r, w))
    server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def _token(i: int, n: int, text: str = "x") -> dict:
    meta = {
        "id": "r",
        "completion_tokens": i + 1,
        "prompt_tokens": 2,
        "finish_reason": {"type": "length", "length": n} if i == n - 1 else None,
        "output_token_logprobs": [[-0.5, 100 + i, text]],
    }
    return {"text": text, "output_ids": [100 + i], "meta_info": meta}


def _chunked(pieces: list[bytes]) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _write_slowly(writer: asyncio.StreamWriter, parts: list[bytes]) -> None:
    """One write per part, each flushed apart, so the client reads them separately."""
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.01)


async def test_chunks_that_split_a_line_and_a_utf8_character() -> None:
    body = _sse(_token(0, 2, "é")) + _sse(_token(1, 2, "日本")) + b"data: [DONE]\n\n"
    cuts = [
        body.index("é".encode()) + 1,  # inside the two bytes of é
        body.index(b"\n\n") - 7,  # inside the first line
        body.index("日".encode()) + 2,  # inside the three bytes of 日
    ]
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    # Each chunk also crosses a TCP write: a size line alone, then its data.
    wire = [HEAD]
    for framed in _chunked(pieces):
        size, _, rest = framed.partition(b"\r\n")
        wire += [size + b"\r\n", rest]

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await srv.read_request(reader):
                await _write_slowly(writer, wire)

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        for _ in range(2):
            deltas = [d async for d in client.generate_stream(REQUEST)]
            assert [d.token_ids for d in deltas] == [[100], [101]]
            assert deltas[-1].finish_reason is not None
        assert srv.connections == 1  # read to the end: the connection was reused
        client.close()
    sent = srv.requests[0]
    assert sent.startswith(b"POST /generate HTTP/1.1\r\n")
    assert json.loads(sent.split(b"\r\n\r\n", 1)[1])["stream"] is True


async def test_lines_keep_multibyte_text_whole() -> None:
    text = "añb日本c\r\nsecond line 🙂\nthird"
    raw = text.encode()
    pieces = [raw[i : i + 1] for i in range(len(raw))]  # one byte per chunk

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            await _write_slowly(writer, [HEAD, b"".join(_chunked(pieces))])

        return h

    async with scripted(handler) as (_, url):
        pool = WirePool(url)
        async with await pool.post("/x", b"{}") as resp:
            lines = [line.decode() async for line in resp.lines()]
        assert lines == ["añb日本c", "second line 🙂", "third"]
        assert pool.idle == 1


async def test_a_stale_pooled_connection_is_retried_once_on_a_new_one() -> None:
    """The server drops an idle keep-alive connection as the request arrives on it."""

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first_connection = srv.connections == 1
            await srv.read_request(reader)
            body = _sse(_token(0, 1)) + b"data: [DONE]\n\n"
            writer.write(HEAD + b"".join(_chunked([body])))
            await writer.drain()
            if first_connection:
                # Keep-alive promised, then closed without an answer to the next request.
                await srv.read_request(reader)

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        assert len([d async for d in client.generate_stream(REQUEST)]) == 1
        deltas = [d async for d in client.generate_stream(REQUEST)]
        assert [d.token_ids for d in deltas] == [[100]]
        # The second request went out twice: on the stale connection, then on a new one.
        assert srv.connections == 2 and len(srv.requests) == 3


def _answers_nothing(srv: Scripted) -> Handler:
    """Every connection reads one request, then closes without answering."""

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)

    return h


def _json_reply(body: bytes | dict, status: int = 200) -> bytes:
    """A response with a content-length body (a dict is sent as its JSON)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status, len(body)) + body


async def test_admin_gets_on_a_dropped_idle_connection_go_once_more_on_a_new_one() -> None:
    """The server's keep-alive timeout closes an idle connection as the next GET reaches it.

    A health probe every 5 s against a server that closes idle connections after
    5 s met this race about once in a hundred probes, and a live backend was taken
    out of the pool. ``/health``, ``/model_info`` and ``/v1/models`` are idempotent:
    they are sent again on a new connection.
    """

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first_connection = srv.connections == 1
            while await srv.read_request(reader):
                if first_connection and len(srv.requests) > 1:
                    return  # closed without an answer to the request that arrived
                if srv.requests[-1].startswith(b"GET /model_info"):
                    writer.write(_json_reply({"model_path": "m", "weight_version": "3"}))
                else:
                    writer.write(_json_reply({}))
                await writer.drain()

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        assert await client.health()
        assert await client.health()  # on the dropped connection, then on a new one
        assert srv.connections == 2 and len(srv.requests) == 3
        assert (await client.model_info()).weight_version == "3"  # the new one is kept
        assert srv.connections == 2


async def test_an_admin_get_dropped_twice_is_a_failed_probe() -> None:
    async with scripted(_answers_nothing) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        assert not await client.health()
        assert srv.connections == 2  # once more, not forever
        with pytest.raises(BackendConnectionError, match="/model_info"):
            await client.model_info()
        assert srv.connections == 4


async def test_a_new_connection_that_fails_is_not_retried() -> None:
    """/generate is not idempotent: a fresh connection's failure is the caller's to handle."""

    async with scripted(_answers_nothing) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        with pytest.raises(BackendConnectionError):
            [d async for d in client.generate_stream(REQUEST)]
        assert srv.connections == 1 and len(srv.requests) == 1


async def test_a_backend_that_closes_mid_chunk() -> None:
    body = _sse(_token(0, 3)) + _sse(_token(1, 3))
    cut = len(_sse(_token(0, 3))) + 20  # the first event whole, the second begun

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            first, second = _chunked([body[:cut], body[cut:]])[:2]
            await _write_slowly(writer, [HEAD, first, second[:-10]])  # then the process dies

        return h

    async with scripted(handler) as (_, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        got = []
        with pytest.raises(BackendConnectionError, match="closed the connection mid-response"):
            async for delta in client.generate_stream(REQUEST):
                got.append(delta.token_ids)
        assert got == [[100]]  # the complete event before the cut was delivered
        assert client._wire.idle == 0


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    """A client that disconnects: the backend sees its connection close (SGLang then aborts)."""

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD + _chunked([_sse(_token(0, 100))])[0])
            await writer.drain()
            await srv.read_request(reader)  # waits for the next request or the close

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        stream = client.generate_stream(REQUEST)
        assert (await anext(stream)).token_ids == [100]
        await stream.aclose()
        await asyncio.wait_for(srv.closed_by_client.wait(), 5)
        assert client._wire.idle == 0


async def test_read_timeout_and_refused_connection() -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD)  # and then nothing
            await asyncio.sleep(5)

        return h

    async with scripted(handler) as (_, url):
        pool = WirePool(url, read_timeout=0.2)
        async with await pool.post("/generate", b"{}") as resp:
            with pytest.raises(BackendConnectionError, match="no data from the backend"):
                await resp.read()
    with pytest.raises(BackendConnectionError, match="cannot connect"):
        await WirePool("http://127.0.0.1:1").post("/generate", b"{}")


@pytest.mark.parametrize(
    ("status", "body", "error", "match"),
    [
        (400, b'{"error": {"message": "prompt too long"}}', BackendRejected, "prompt too long"),
        (400, b'{"error": "unknown field `seed`"}', BackendRejected, "unknown field"),
        (503, b"overloaded", BackendOperationFailed, "answered 503: overloaded"),
    ],
)
async def test_error_statuses_with_content_length_bodies(
    status: int, body: bytes, error: type[Exception], match: str
) -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await srv.read_request(reader):
                writer.write(_json_reply(body, status))

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        with pytest.raises(error, match=match):
            [d async for d in client.generate_stream(REQUEST)]
        with pytest.raises(error, match=match):
            await client.generate(REQUEST)
        assert srv.connections == 1  # an error body read to its end keeps the connection


async def test_an_error_inside_the_stream_is_a_rejection() -> None:
    """SGLang reports some failures as a ``data: {"error": ...}`` event in a 200 stream."""
    body = _sse({"error": {"message": "input too long", "code": 400}}) + b"data: [DONE]\n\n"

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD + b"".join(_chunked([body])))

        return h

    async with scripted(handler) as (_, url), httpx.AsyncClient() as http:
        with pytest.raises(BackendRejected, match="input too long"):
            [d async for d in SGLangClient(url, http=http).generate_stream(REQUEST)]


async def test_a_stream_without_done_is_a_lost_backend() -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            # A complete chunked body that never said [DONE], then the connection closes.
            writer.write(HEAD + b"".join(_chunked([_sse(_token(0, 3))])))

        return h

    async with scripted(handler) as (_, url), httpx.AsyncClient() as http:
        with pytest.raises(BackendConnectionError, match="ended early"):
            [d async for d in SGLangClient(url, http=http).generate_stream(REQUEST)]


def _versioned(i: int, n: int, version: str) -> dict:
    chunk = _token(i, n)
    chunk["meta_info"]["weight_version"] = version
    return chunk


async def test_chunks_that_arrive_together_are_one_delta_per_weight_version() -> None:
    """A consumer that fell behind gets what piled up as one delta; versions never mix."""
    versions = ["3", "3", "3", "4", "4"]
    body = b"".join(_sse(_versioned(i, 5, v)) for i, v in enumerate(versions))
    # One chunk per event, all in one write: the client reads them in one go.
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e] + [b"data: [DONE]\n\n"]

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await srv.read_request(reader):
                writer.write(HEAD + b"".join(_chunked(events)))
                await writer.drain()

        return h

    async with scripted(handler) as (srv, url), httpx.AsyncClient() as http:
        client = SGLangClient(url, http=http)
        for _ in range(2):
            deltas = [d async for d in client.generate_stream(REQUEST)]
            assert [d.token_ids for d in deltas] == [[100, 101, 102], [103, 104]]
            assert [d.weight_version for d in deltas] == ["3", "4"]
            assert [d.logprobs for d in deltas] == [[-0.5] * 3, [-0.5] * 2]
            assert deltas[0].finish_reason is None and deltas[1].finish_reason is not None
        assert srv.connections == 1
        client.close()


async def test_tokens_before_an_error_in_the_same_read_are_still_yielded() -> None:
    body = _sse(_token(0, 3)) + _sse({"error": {"message": "out of memory"}})

    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD + b"".join(_chunked([body, b"data: [DONE]\n\n"])))

        return h

    async with scripted(handler) as (_, url), httpx.AsyncClient() as http:
        seen: list[list[int]] = []
        with pytest.raises(BackendRejected, match="out of memory"):
            async for d in SGLangClient(url, http=http).generate_stream(REQUEST):
                seen.append(d.token_ids)
        assert seen == [[100]]


@pytest.mark.parametrize(
    ("framing", "error"),
    [
        (b"zz\r\nabc\r\n0\r\n\r\n", "invalid literal"),  # a size that is not hexadecimal
        (b"3\r\nabcXY0\r\n\r\n", "does not end with CRLF"),
    ],
)
async def test_broken_chunk_framing_is_a_lost_backend(framing: bytes, error: str) -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD + framing)
            await writer.drain()
            await asyncio.sleep(5)

        return h

    async with scripted(handler) as (_, url):
        pool = WirePool(url)
        async with await pool.post("/x", b"{}") as resp:
            with pytest.raises(BackendConnectionError, match=error):
                [p async for p in resp.pieces()]
        assert pool.idle == 0


async def test_bytes_past_the_end_of_a_response_retire_the_connection() -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await srv.read_request(reader):
                writer.write(HEAD + b"".join(_chunked([b"ok\n"])) + b"junk")
                await writer.drain()

        return h

    async with scripted(handler) as (srv, url):
        pool = WirePool(url)
        for _ in range(2):
            async with await pool.post("/x", b"{}") as resp:
                assert [line async for line in resp.lines()] == [b"ok"]
            assert pool.idle == 0  # what came after the end cannot be a next response
        assert srv.connections == 2


async def test_extra_request_headers_are_sent_and_checked() -> None:
    def handler(srv: Scripted) -> Handler:
        async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(HEAD + b"".join(_chunked([b"ok\n"])))
            await writer.drain()

        return h

    async with scripted(handler) as (srv, url):
        pool = WirePool(url)
        async with await pool.post("/x", b"{}", {"Authorization": "Bearer k"}) as resp:
            assert await resp.read() == b"ok\n"
        assert b"\r\nAuthorization: Bearer k\r\n" in srv.requests[0]
        for bad in ({"X-A": "v\r\nX-Injected: 1"}, {"X:A": "v"}):
            with pytest.raises(ValueError, match="line break"):
                await pool.post("/x", b"{}", bad)
        assert len(srv.requests) == 1
