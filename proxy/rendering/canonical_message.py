"""The canonical chat message: what every API surface's messages become.

``proxima.proxy.rendering.chat_messages.normalize_messages`` makes ``CanonicalMessage``\\ s
from OpenAI chat messages (the Responses and Messages surfaces first write their items in
that shape); the chat template renders them and the store records them as a completion's
``request_messages``. A tool call's ``arguments`` is the parsed JSON object, or the raw
string when it holds none.

A reply is an ``AssistantReply``: OpenAI's shape as the chat API returns it (``content``
null beside tool calls, ``arguments`` the string the model wrote), recorded as the
completion's ``response_message`` and normalized when a later turn is compared with it.

In the store (JSON columns) and on the wire they are plain objects: ``as_json`` and
``as_json_list`` give them that type, unchanged.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, cast

Role = Literal["system", "user", "assistant", "tool"]


class CanonicalFunction(TypedDict):
    """The function a tool call names, and its arguments."""

    name: str
    arguments: dict[str, Any] | str


class CanonicalToolCall(TypedDict):
    """One call of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: CanonicalFunction


class CanonicalMessage(TypedDict):
    """One message of a conversation, as the chat template renders it."""

    role: Role  # a ``developer`` message is a ``system`` one
    content: str  # "" for None; text parts joined
    tool_calls: NotRequired[list[CanonicalToolCall]]  # assistant only, when non-empty
    reasoning_content: NotRequired[str]  # assistant only, when given
    tool_call_id: NotRequired[str]  # tool only
    name: NotRequired[str]  # when given


class AssistantReply(TypedDict):
    """The model's reply as the chat API returns it and the store records it."""

    role: Literal["assistant"]
    content: str | None  # None only beside tool calls
    tool_calls: NotRequired[list[CanonicalToolCall]]  # when it calls tools
    reasoning_content: NotRequired[str]  # a thinking model's reasoning


def as_json(message: CanonicalMessage | AssistantReply) -> dict[str, Any]:
    """``message`` as the plain JSON object a store column holds: the same dict, typed
    so (a TypedDict is a dict at run time)."""
    return cast("dict[str, Any]", message)


def as_json_list(messages: list[CanonicalMessage]) -> list[dict[str, Any]]:
    """``messages`` as the plain JSON objects a store column holds: the same list."""
    return cast("list[dict[str, Any]]", messages)
