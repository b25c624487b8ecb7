"""A new turn's parent: the earlier completion of the session it extends, and its text.

``find_parent`` compares messages only (nothing is rendered): the parent is the completion
whose request messages plus reply the new messages strictly extend, with the same tools (the
longest such prefix, then the most recent). ``RenderedTexts`` keeps the template's text of
recent completions' requests, so extending a parent does not render its conversation again.
``proxima.proxy.rendering.chat_template.ChatRenderer`` uses both to reuse the parent's tokens.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxima.proxy.rendering.chat_messages import (
    InvalidMessages,
    Message,
    messages_equivalent,
    normalize_message,
)
from proxima.proxy.store.chains import identical
from proxima.proxy.store.records import CompletionRecord

logger = logging.getLogger(__name__)


class RenderedTexts:
    """The template's text of recent completions' requests, by completion id.

    A turn extends its parent by checking that the parent's own prompt text starts
    the new conversation's text; the parent's request was rendered when the parent
    was prepared, so that text is kept here (and used only when the new request's
    messages and tools up to the parent are identical to the parent's, so it is
    exactly what rendering them again would give) instead of rendering the whole
    conversation a second time every turn. Bounded in characters (least recently
    added dropped first; a dropped text is rendered again when needed); shared by
    the renderers of the event loop and of the worker thread.
    """

    def __init__(self, max_chars: int = 32 * 2**20) -> None:
        self.max_chars = max_chars  # 32 Mi characters: 32-128 MiB of str by default
        self._texts: OrderedDict[str, tuple[str, dict[str, Any] | None]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, completion_id: str) -> tuple[str, dict[str, Any] | None] | None:
        """The completion's prompt text and the template variables it was rendered with."""
        with self._lock:
            return self._texts.get(completion_id)

    def add(
        self,
        completion_ids: Sequence[str],
        text: str,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        entry = (text, template_kwargs or None)
        with self._lock:
            for cid in completion_ids:
                old = self._texts.pop(cid, None)
                if old is not None:
                    self._chars -= len(old[0])
                self._texts[cid] = entry  # choices of one request share the string
                self._chars += len(text)
            while self._chars > self.max_chars and self._texts:
                _, dropped = self._texts.popitem(last=False)
                self._chars -= len(dropped[0])


@dataclass(frozen=True, slots=True)
class Candidate:
    """A completion that can be extended, with its messages in canonical form."""

    record: CompletionRecord
    request: list[Message]
    reply: Message


def find_parent(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    history: Sequence[CompletionRecord],
) -> Candidate | None:
    """The completion the new messages extend (longest prefix, then most recent)."""
    if len(messages) < 3:  # a parent's request (one message or more) and reply, and more
        return None
    # The records' messages as stored (JSON): normalized below before they are compared.
    candidates: list[tuple[int, int, CompletionRecord, list[dict[str, Any]], dict[str, Any]]]
    candidates = []
    for position, record in enumerate(history):
        stored_request, stored_reply = record.request_messages, record.response_message
        if not stored_request or stored_reply is None:
            continue  # a /v1/completions record, or a reply that was never returned
        if len(stored_request) + 1 < len(messages):
            candidates.append(
                (len(stored_request) + 1, position, record, stored_request, stored_reply)
            )
    candidates.sort(key=lambda item: (item[0], item[1]), reverse=True)
    tool_list = list(tools or [])
    for size, _, record, stored_request, stored_reply in candidates:
        try:
            # The reply is the likeliest difference (siblings of n > 1), so it goes first.
            reply = normalize_message(stored_reply, size - 1)
            if not messages_equivalent(messages[size - 1], reply):
                continue
            request: list[Message] = []
            for index in range(size - 2, -1, -1):
                if stored_request[index] == messages[index]:  # equal to a canonical one
                    request.append(messages[index])
                    continue
                stored = normalize_message(stored_request[index], index)
                if not messages_equivalent(messages[index], stored):
                    break
                request.append(stored)
            else:
                # Tools that differ only in key order render different prompts (tojson).
                if identical(list(record.request_tools or []), tool_list):
                    return Candidate(record=record, request=request[::-1], reply=reply)
        except InvalidMessages:
            logger.warning("stored messages of completion %s are not valid", record.id)
    return None
