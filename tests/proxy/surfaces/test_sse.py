"""Server-sent event framing: every event stays one line for every reader."""

from __future__ import annotations

import json

import httpx
from proxima.proxy.surfaces.sse import named_sse, sse

# NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR: JSON leaves them raw, str.splitlines() breaks on
# them. The other characters splitlines breaks on (\x0b, \x0c, \x1c-\x1e) are control
# characters, which JSON always escapes.
TEXT = "a\x85b\u2028c\u2029d \u201cquoted\u201d \u2014 \x0b\x1c"


def _lines(frame: bytes) -> list[str]:
    """The lines httpx's ``iter_lines`` gives for one event (a splitlines, as many SSE readers)."""
    resp = httpx.Response(200, content=frame)
    return [line for line in resp.iter_lines() if line]


def test_a_data_event_with_unicode_line_breaks_is_one_line() -> None:
    lines = _lines(sse({"choices": [{"delta": {"content": TEXT}}]}))
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == TEXT


def test_a_named_event_with_unicode_line_breaks_is_two_lines() -> None:
    lines = _lines(named_sse({"type": "content_block_delta", "delta": {"text": TEXT}}))
    assert lines[0] == "event: content_block_delta"
    assert len(lines) == 2
    assert json.loads(lines[1].removeprefix("data: "))["delta"]["text"] == TEXT


def test_text_without_line_breaks_is_sent_as_utf8_unchanged() -> None:
    frame = sse({"text": "\u201cdéjà vu\u201d \u2014 日本"})
    assert "\u201cdéjà vu\u201d \u2014 日本".encode() in frame
