"""The body side of the lean HTTP/1.1 client (``wire.py``): chunked framing and event fields.

``dechunk`` takes the complete chunks at the start of a buffer (one call per read, however
many chunks it completed); ``DataStream`` gives a server-sent event stream's ``data:`` fields
to a caller that runs its own read loop (no generator between the connection and it), a read
of exactly one event in one chunk taken by ``_one_event``'s few bytes operations, any other by
``dechunk`` and one regular expression over the lines the read completed (``_DataFields``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Protocol

from proxima.proxy.backends.wire_conn import Conn

_MAX_HEAD = 64 * 1024  # the longest chunk size line or trailers (a response head's limit)
# A server-sent event's ``data:`` field: the rest of its line after one optional space
# (a CR before the line's LF stays in it: JSON and ``[DONE]`` readers strip it).
_DATA_FIELD = re.compile(rb"^data: ?(.*)", re.MULTILINE)


class _DataFields:
    """A server-sent event stream's ``data:`` fields, piece by piece: the lines a piece
    completed, found by one regular expression; the rest waits for the next piece."""

    __slots__ = ("rest",)

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, piece: bytes) -> list[bytes]:
        if self.rest:
            piece = self.rest + piece
        end = piece.rfind(b"\n") + 1
        self.rest = piece[end:]
        return _DATA_FIELD.findall(piece, 0, end) if end else []

    def flush(self) -> list[bytes]:
        """The fields of a last line without its line end."""
        rest, self.rest = self.rest, b""
        return _DATA_FIELD.findall(rest) if rest else []


class WireBody(Protocol):
    """What ``DataStream`` uses of a response (``wire.WireResponse``)."""

    _source: Conn
    _chunked: bool
    _complete: bool
    _waiting_since: float | None

    def _taken(self, buf: bytearray) -> tuple[bytes, bool]: ...
    def _waiter(self) -> asyncio.Future[None] | None: ...
    def _watch_reads(self) -> None: ...
    def _stop_watch(self) -> None: ...


class DataStream:
    """A server-sent event stream's ``data:`` fields, taken by the caller's own loop::

        while True:
            fields = stream.take()        # what arrived since the last wait
            ...
            if stream.ended:
                break
            waiter = stream.waiter()      # None at the end of the stream
            if waiter is not None:
                await waiter

    No generator lies between the connection and the reader (each one costs a resume per
    read), and a read that holds exactly one event in one chunk (the backend's pace: one
    token per read) is taken by a few bytes operations (``_one_event``), without the
    chunk decoder or a regular expression run over the JSON. ``close`` (in a ``finally``)
    ends the read timeout's watchdog. Failures are ``BackendConnectionError`` s.
    """

    __slots__ = ("resp", "buf", "fields", "ended")

    def __init__(self, resp: WireBody):
        self.resp = resp
        self.buf = resp._source.buf
        self.fields = _DataFields()
        self.ended = False
        resp._watch_reads()

    def take(self) -> list[bytes]:
        """The ``data:`` fields of the lines completed since the last take (maybe none);
        ``ended`` once the body has ended."""
        resp, buf = self.resp, self.buf
        if buf and resp._chunked and not self.fields.rest and resp._source.error is None:
            field = _one_event(buf)
            if field is not None:
                resp._waiting_since = None
                return [field]
        piece, ended = resp._taken(buf)
        out = self.fields.feed(piece) if piece else []
        if ended:
            out += self.fields.flush()
            self.ended = resp._complete = True
        return out

    def waiter(self) -> asyncio.Future[None] | None:
        """The future that is done when more bytes arrived (or the stream broke: the next
        ``take`` raises it); None at the end of the stream."""
        return self.resp._waiter()

    def close(self) -> None:
        self.resp._stop_watch()


def _one_event(buf: bytearray) -> bytes | None:
    """The ``data:`` field of ``buf`` when it holds exactly one chunk whose payload is one
    ``data: ...`` line and its blank line (taken out of ``buf``); else None (``buf`` as it
    was): what ``dechunk`` and ``_DataFields`` would give, by C-level bytes operations."""
    eol = buf.find(b"\r\n", 0, 10)
    if eol <= 0:
        return None
    start, stop = eol + 2, len(buf) - 2
    try:
        size = int(buf[:eol], 16)
    except ValueError:
        return None
    if (
        size != stop - start
        or not buf.startswith(b"data: ", start)
        or not buf.endswith(b"\n\n\r\n")
        or buf.count(b"\n", start) != 3
        or buf.find(b"\r", start, stop) >= 0
    ):
        return None
    field = bytes(buf[start + 6 : stop - 2])
    buf.clear()
    return field


def dechunk(buf: bytearray) -> tuple[list[bytearray], int, bool]:
    """The complete chunks at the start of ``buf``: their payloads, bytes used, and whether
    the last chunk (size 0, then any trailers and an empty line) was among them.

    ``ValueError`` for a size that is not hexadecimal, a chunk that does not end with
    CRLF, or a size line or trailer longer than a response head may be.
    """
    payloads: list[bytearray] = []
    pos = 0
    end_of_buf = len(buf)
    find, starts = buf.find, buf.startswith  # bound once: this loop runs per chunk
    while True:
        eol = find(b"\r\n", pos)
        if eol < 0:
            if end_of_buf - pos > _MAX_HEAD:
                raise ValueError("a chunk size line is too long")
            return payloads, pos, False
        try:
            size = int(buf[pos:eol], 16)
        except ValueError:  # chunk extensions (";name=value") after the size, or not a size
            head = buf[pos:eol]
            size = int(head[: head.index(b";")] if b";" in head else head, 16)
        if size <= 0:
            if size < 0:
                raise ValueError(f"negative chunk size {size}")
            end = find(b"\r\n\r\n", eol)  # the size line's CRLF, trailers, empty line
            if end < 0:
                if end_of_buf - eol > _MAX_HEAD:
                    raise ValueError("the trailers are too long")
                return payloads, pos, False
            return payloads, end + 4, True
        start = eol + 2
        stop = start + size
        if end_of_buf < stop + 2:
            return payloads, pos, False
        if not starts(b"\r\n", stop):
            raise ValueError("a chunk does not end with CRLF")
        payloads.append(buf[start:stop])
        pos = stop + 2
