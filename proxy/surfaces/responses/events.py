"""Generated replies -> OpenAI Responses API objects and streamed events.

``response_object`` builds the non-streaming ``response``; ``ResponsesStream``
turns the tool-call parser's events (``ContentDelta``, ``ToolCallDelta``) into
the event sequence the OpenAI SDK's stream accumulator expects::

    response.created, response.in_progress
    per output item:
      response.output_item.added
      message:       response.content_part.added, response.output_text.delta...,
                     response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta...,
                     response.function_call_arguments.done
      response.output_item.done
    response.completed            (response.incomplete when cut at max_output_tokens)

Every event has a ``sequence_number`` counting from 0. Text becomes a
``message`` item with one ``output_text`` part; each tool call a
``function_call`` item whose ``call_id`` is the id the session records, so
the items the client sends back are recognized as the same turn. A reply that
is neither text nor calls is one empty message, as OpenAI returns it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from proxima.proxy.errors import ProximaError, public_message
from proxima.proxy.rendering.reasoning import ReasoningDelta
from proxima.proxy.service.events import Completion, Delta, Done, Event, Failed, Finish, Part
from proxima.proxy.surfaces.openai_common import logprob_content
from proxima.proxy.surfaces.sse import named_sse
from proxima.proxy.tools import ContentDelta, ParsedOutput, ToolCallDelta


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every snapshot of one response repeats: its id, and the request's settings.

    ``settings`` are the request fields a response echoes (``instructions``,
    ``tools``, ``temperature``, ...), as ``translate.echoed_settings``
    gives them.
    """

    response_id: str
    created_at: int
    model: str
    settings: dict[str, Any]
    tool_namespaces: dict[str, str] = field(default_factory=dict)
    """Tool name -> the ``namespace`` tool that declared it; its calls name that namespace."""
    seal: Callable[[str], str] | None = None
    """Reasoning text -> its ``encrypted_content`` (when the request ``include``s it)."""

    def reasoning_item(self, item_id: str, status: str, text: str | None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": [] if text is None else [_reasoning_part(text)],
            "encrypted_content": None,
            "status": status,
        }
        if text is not None and self.seal is not None:
            item["encrypted_content"] = self.seal(text)
        return item

    def call_item(
        self, item_id: str, status: str, call_id: str, name: str, args: str
    ) -> dict[str, Any]:
        item = _call_item(item_id, status, call_id, name, args)
        if name in self.tool_namespaces:
            item["namespace"] = self.tool_namespaces[name]
        return item

    def snapshot(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.settings,
        }


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _message_item(item_id: str, status: str, text: str | None, logprobs: Any) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(item_id: str, status: str, call_id: str, name: str, args: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": args,
    }


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(
    head: ResponseHead,
    parsed: ParsedOutput,
    finish_reason: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The output items of a finished reply: its reasoning and text (if any), then its calls."""
    status = _status(finish_reason)
    items = []
    if parsed.reasoning:
        items.append(head.reasoning_item(_item_id("rs"), status, parsed.reasoning))
    if parsed.content or not parsed.tool_calls:
        items.append(_message_item(_item_id("msg"), status, parsed.content or "", logprobs))
    for call in parsed.tool_calls:
        items.append(
            head.call_item(_item_id("fc"), "completed", call.id, call.name, call.arguments)
        )
    return items


def response_object(
    head: ResponseHead,
    parsed: ParsedOutput,
    finish_reason: str,
    *,
    input_tokens: int,
    output_tokens: int,
    logprobs: list[dict[str, Any]] | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """The non-streaming ``response`` for one finished reply."""
    return head.snapshot(
        _status(finish_reason),
        output_items(head, parsed, finish_reason, logprobs),
        usage(input_tokens, output_tokens, reasoning_tokens),
    )


@dataclass(slots=True)
class _OpenItem:
    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponsesStream:
    """The SSE events of one streamed response, fed the parser's events as they come.

    ``start`` -> ``feed``... -> ``finish`` (or ``fail``); each returns the
    encoded events to send. ``feed`` takes the logprob entries of the tokens
    that produced the events; they ride on the next text delta.
    """

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._pending_logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_sse(event)

    def start(self) -> list[bytes]:
        snapshot = self.head.snapshot("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, events: list[Part], logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        self._pending_logprobs.extend(logprobs or [])
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                if ev.text:
                    out += self._text(ev.text)
            elif isinstance(ev, ToolCallDelta):
                out += self._call(ev)
            elif isinstance(ev, ReasoningDelta) and ev.text:
                out += self._reasoning(ev.text)
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out = self._open_part(
            "reasoning",
            lambda: self.head.reasoning_item(_item_id("rs"), "in_progress", None),
            _reasoning_part(""),
        )
        assert self._open is not None
        self._open.text.append(text)
        out.append(self._part_event("response.reasoning_text.delta", delta=text))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = self._open_part(
            "message",
            lambda: _message_item(_item_id("msg"), "in_progress", None, None),
            _text_part("", None),
        )
        assert self._open is not None
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        self._open.text.append(text)
        self._open.logprobs.extend(logprobs)
        out.append(self._part_event("response.output_text.delta", delta=text, logprobs=logprobs))
        return out

    def _open_part(
        self, kind: str, item: Callable[[], dict[str, Any]], part: dict[str, Any]
    ) -> list[bytes]:
        """Open ``item()`` and its one empty content part, unless an item of ``kind`` is open."""
        if self._open is not None and self._open.item["type"] == kind:
            return []
        out = self._close()
        out += self._add(item())
        out.append(self._part_event("response.content_part.added", part=part))
        return out

    def _part_event(self, kind: str, **fields: Any) -> bytes:
        """An event of the open item's content part (its only one: ``content_index`` 0)."""
        return self._event(
            kind,
            item_id=self._open_id(),
            output_index=self._open_index(),
            content_index=0,
            **fields,
        )

    def _call(self, ev: ToolCallDelta) -> list[bytes]:
        out: list[bytes] = []
        if ev.id is not None:
            out += self._close()
            item = self.head.call_item(_item_id("fc"), "in_progress", ev.id, ev.name or "", "")
            out += self._add(item)
        if ev.arguments:
            assert self._open is not None and self._open.item["type"] == "function_call"
            self._open.text.append(ev.arguments)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self._open_id(),
                    output_index=self._open_index(),
                    delta=ev.arguments,
                )
            )
        return out

    def _open_id(self) -> str:
        assert self._open is not None
        item_id: str = self._open.item["id"]
        return item_id

    def _open_index(self) -> int:
        assert self._open is not None
        return self._open.index

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self._open = _OpenItem(index=len(self._items), item=item)
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=self._open.index, item=item)]

    def _close(self, status: str = "completed") -> list[bytes]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        text = "".join(opened.text)
        ids = {"item_id": opened.item["id"], "output_index": opened.index}
        out = []
        if opened.item["type"] == "message":
            part = _text_part(text, opened.logprobs)
            out.append(
                self._event(
                    "response.output_text.done",
                    **ids,
                    content_index=0,
                    text=text,
                    logprobs=opened.logprobs,
                )
            )
            out.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
            final = {**opened.item, "status": status, "content": [part]}
        elif opened.item["type"] == "reasoning":
            part = _reasoning_part(text)
            out.append(
                self._event("response.reasoning_text.done", **ids, content_index=0, text=text)
            )
            out.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
            final = self.head.reasoning_item(opened.item["id"], status, text)
        else:
            args = {"arguments": text, "name": opened.item["name"]}
            out.append(self._event("response.function_call_arguments.done", **ids, **args))
            final = {**opened.item, "status": "completed", "arguments": text}
        self._items[opened.index] = final
        out.append(self._event("response.output_item.done", output_index=opened.index, item=final))
        return out

    def finish(
        self,
        finish_reason: str,
        *,
        input_tokens: int,
        output_tokens: int,
        reasoning_tokens: int = 0,
    ) -> list[bytes]:
        """Close the open item and send the final response."""
        status = _status(finish_reason)
        out: list[bytes] = []
        if all(item["type"] == "reasoning" for item in self._items):
            out += self._close(status)  # a reply that is only reasoning still has a message
            out += self._text_item_if_empty()
        if self._open is not None and self._open.item["type"] == "message":
            # Tokens that produced no more text (the end token) still count in the item's logprobs.
            self._open.logprobs.extend(self._pending_logprobs)
        out += self._close(status)
        snapshot = self.head.snapshot(
            status, self._items, usage(input_tokens, output_tokens, reasoning_tokens)
        )
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._event(kind, response=snapshot))
        return out

    def _text_item_if_empty(self) -> list[bytes]:
        """An empty reply is one empty message, streamed like any other."""
        out = self._add(_message_item(_item_id("msg"), "in_progress", None, None))
        part = _text_part("", None)
        ids = {"item_id": self._open_id(), "output_index": self._open_index()}
        out.append(self._event("response.content_part.added", **ids, content_index=0, part=part))
        return out

    def fail(self, exc: ProximaError) -> list[bytes]:
        """An ``error`` event, then ``response.failed`` with what was generated so far."""
        out = [self._event("error", code=exc.code, message=public_message(exc), param=exc.param)]
        error = {"code": "server_error", "message": public_message(exc)}
        snapshot = self.head.snapshot("failed", self._items, error=error)
        out.append(self._event("response.failed", response=snapshot))
        return out


# ------------------------------------------------------------------ driver events


def _logprobs(entries: Any) -> list[dict[str, Any]] | None:
    return logprob_content(entries) if entries is not None else None


def response_from(head: ResponseHead, completion: Completion) -> dict[str, Any]:
    """The ``response`` object of a non-streaming generation (one choice)."""
    (finish,) = completion.choices
    assert finish.parsed is not None
    return response_object(
        head,
        finish.parsed,
        finish.finish_reason,
        input_tokens=completion.usage.prompt_tokens,
        output_tokens=completion.usage.completion_tokens,
        logprobs=_logprobs(finish.logprobs),
        reasoning_tokens=completion.usage.reasoning_tokens,
    )


async def response_events(head: ResponseHead, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The streamed response: the driver's events as Responses API events."""
    stream = ResponsesStream(head)
    for chunk in stream.start():
        yield chunk
    finish_reason = "stop"
    async for event in events:
        if isinstance(event, Delta):
            chunks = stream.feed(event.parts, _logprobs(event.logprobs))
        elif isinstance(event, Finish):
            finish_reason = event.finish_reason
            chunks = stream.feed(event.tail)
        elif isinstance(event, Done):
            usage = event.usage
            chunks = stream.finish(
                finish_reason,
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                reasoning_tokens=usage.reasoning_tokens,
            )
        elif isinstance(event, Failed):
            chunks = stream.fail(event.error)
        for chunk in chunks:
            yield chunk
