"""Completions stored as what they add to their parent; whole prompts rebuilt on read.

A turn of an agent session extends an earlier completion of the same session, its
parent: its prompt is the parent's ``prompt_ids + output_ids`` and then the new
messages' tokens, and its request messages are the parent's request messages, the
parent's reply, then the new messages. Storing every completion's whole prompt and
message list costs O(turns x context) per session; a row stores instead:

- ``prompt_prefix``: how many leading prompt tokens are the parent's
  ``prompt_ids + output_ids`` (0: none, ``prompt_ids`` is the whole prompt); the
  column ``prompt_ids`` holds the rest;
- ``messages_prefix``: how many leading request messages are the parent's
  ``request_messages`` followed by its ``response_message``; the column
  ``request_messages`` holds the rest;
- ``tools_from_parent``: ``request_tools`` is the parent's (the column is NULL).

A prefix is taken only when it is exactly the parent's (same values, same types, same
key order, so JSON renders the same), and only from a parent of the same session (a
session is read and deleted as a whole). ``CompletionRecord``\\ s always carry the
whole prompt and message list: ``split`` is applied on write, ``rebuild`` on read.
Rebuilt records of one session share the message dicts they have in common: read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from proxima.proxy.store.errors import StoreError
from proxima.proxy.store.records import CompletionRecord


@dataclass(frozen=True, slots=True)
class Split:
    """What a completion row stores of its prompt, messages and tools."""

    prompt_prefix: int
    prompt_ids: list[int]
    messages_prefix: int
    request_messages: list[dict[str, Any]] | None
    tools_from_parent: bool
    request_tools: list[dict[str, Any]] | None


def identical(a: Any, b: Any) -> bool:
    """Equal JSON values that also serialize alike: same types (``1`` is not ``1.0`` or
    ``True``) and the same key order (templates render ``tojson`` in key order).

    Compared in C: Python equality, then the two values' JSON (which tells 1 from 1.0
    and ``True``, and one key order from another); values JSON cannot hold (an int over
    64 bits) are compared field by field.
    """
    if a is b:
        return True
    try:
        return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)
    except TypeError:  # orjson.JSONEncodeError included
        return _identical(a, b)


def _identical(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            if ka != kb or not _identical(va, vb):
                return False
        return True
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def chat_sequence(record: CompletionRecord) -> list[dict[str, Any]]:
    """The parent's messages a child's request may start with: request, then reply."""
    if record.request_messages is None:
        return []
    if record.response_message is None:
        return list(record.request_messages)
    return [*record.request_messages, record.response_message]


def split(record: CompletionRecord, parent: CompletionRecord | None) -> Split:
    """``record``'s stored form against ``parent`` (its parent of the same session, or None)."""
    if parent is None or parent.id != record.parent_id or parent.session_id != record.session_id:
        return Split(0, record.prompt_ids, 0, record.request_messages, False, record.request_tools)
    prompt = record.prompt_ids
    head, out = parent.prompt_ids, parent.output_ids
    n_head, n_seq = len(head), len(head) + len(out)
    prompt_prefix = 0
    if len(prompt) >= n_seq and prompt[:n_head] == head and prompt[n_head:n_seq] == out:
        prompt_prefix = n_seq
    messages_prefix = 0
    request = record.request_messages
    if request is not None:
        previous = chat_sequence(parent)
        limit = min(len(previous), len(request))
        if identical(request[:limit], previous[:limit]):  # a turn extending its parent
            messages_prefix = limit
        else:
            while messages_prefix < limit and identical(
                request[messages_prefix], previous[messages_prefix]
            ):
                messages_prefix += 1
    tools_from_parent = record.request_tools is not None and identical(
        record.request_tools, parent.request_tools
    )
    return Split(
        prompt_prefix,
        prompt[prompt_prefix:] if prompt_prefix else prompt,
        messages_prefix,
        request[messages_prefix:] if request is not None and messages_prefix else request,
        tools_from_parent,
        None if tools_from_parent else record.request_tools,
    )


def rebuild(
    parent: CompletionRecord | None,
    *,
    completion_id: str,
    prompt_prefix: int,
    prompt_ids: list[int],
    messages_prefix: int,
    request_messages: list[dict[str, Any]] | None,
    tools_from_parent: bool,
    request_tools: list[dict[str, Any]] | None,
) -> tuple[list[int], list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The whole ``(prompt_ids, request_messages, request_tools)`` of a stored row.

    Raises ``StoreError`` when the row needs a parent it does not have.
    """
    if not (prompt_prefix or messages_prefix or tools_from_parent):
        return prompt_ids, request_messages, request_tools
    if parent is None:
        raise StoreError(f"completion {completion_id} is stored against a parent that is missing")
    if prompt_prefix:
        n_head = len(parent.prompt_ids)
        if prompt_prefix > n_head + len(parent.output_ids):
            raise StoreError(f"completion {completion_id}: prompt prefix longer than its parent")
        if prompt_prefix <= n_head:
            full = parent.prompt_ids[:prompt_prefix]
        else:
            full = [*parent.prompt_ids, *parent.output_ids[: prompt_prefix - n_head]]
        full.extend(prompt_ids)
        prompt_ids = full
    if messages_prefix:
        previous = chat_sequence(parent)
        if messages_prefix > len(previous):
            raise StoreError(f"completion {completion_id}: messages prefix longer than its parent")
        request_messages = [*previous[:messages_prefix], *(request_messages or [])]
    if tools_from_parent:
        request_tools = parent.request_tools
    return prompt_ids, request_messages, request_tools


def resolve_all(
    ids: list[str],
    parent_of: Mapping[str, str | None],
    build: Callable[[str, CompletionRecord | None], CompletionRecord],
) -> dict[str, CompletionRecord]:
    """Records of ``ids``, each built after its parent (``build(id, parent record)``).

    ``parent_of`` maps every id that can be built to its parent id; a parent outside
    it is given to ``build`` as None (``rebuild`` raises if it was needed).
    """
    done: dict[str, CompletionRecord] = {}
    for start in ids:
        if start in done:
            continue
        chain = [start]  # ancestors not yet built, nearest last
        seen = {start}
        while True:
            parent_id = parent_of.get(chain[-1])
            if parent_id is None or parent_id in done or parent_id not in parent_of:
                break
            if parent_id in seen:
                raise StoreError(f"completion {start}: its parents form a cycle")
            chain.append(parent_id)
            seen.add(parent_id)
        for cid in reversed(chain):
            parent_id = parent_of.get(cid)
            done[cid] = build(cid, done.get(parent_id) if parent_id is not None else None)
    return done
