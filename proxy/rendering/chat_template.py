"""Messages to token ids, token-exact across the turns of a session.

The proxy, not the backend, turns messages into token ids (docs/design.md,
"Token-exact multi-turn"). Three steps:

1. ``normalize_messages`` validates OpenAI messages and brings them to one
   canonical form, used both for rendering and for comparing turns.
2. ``ChatRenderer.build_prompt`` looks for an earlier completion of the
   session that the new messages extend (its request messages plus its
   assistant reply, then something new). If there is one, the prompt is that
   completion's exact ``prompt_ids + output_ids`` followed by the tokens of
   the new messages only; otherwise the whole conversation is rendered fresh
   and starts a new branch of the session's tree.

Why the reused tokens are exact: the chat template renders the earlier turn
to a text ``T_prev`` and the whole conversation to ``T_full``. When
``T_full`` starts with ``T_prev`` (the template does not rewrite history),
the new messages are the text after ``T_prev``, and the earlier reply ended
where its end-of-turn marker (the tokenizer's eos, ``<|im_end|>`` for Qwen)
sits in ``T_prev``. So the prompt continues after the marker if the model
generated it, or at the marker if the reply was cut (``length``, a stop
string), because then the marker has to be added. What the model saw and what
the trainer trains on are then the same tokens by construction.

That holds only when the template renders the earlier reply as the tokens the
model generated. A template that rewrites it (Qwen3 and DeepSeek-R1 drop an
earlier turn's reasoning; a template may re-serialize a tool call) would make
``parent tokens + new tokens`` a prompt the model never sees in deployment,
so then the whole conversation is rendered fresh: the template's own prompt,
a new chain of the session's tree.

Canonical message::

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str,                          # "" for None; text parts joined
     "tool_calls": [{"id": str, "type": "function",
                     "function": {"name": str, "arguments": dict | str}}],
                                              # assistant only, when non-empty
     "reasoning_content": str,                # assistant only, when given
     "tool_call_id": str,                     # tool only
     "name": str}                             # when given

``arguments`` is the parsed JSON object, or the raw string when it is not one
(templates render objects with ``tojson``). ``developer`` messages become
``system``. Records' ``request_messages`` should be stored canonical; they
are re-normalized when compared, which is idempotent.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from proxima.proxy import errors
from proxima.proxy.rendering.unicode import InvalidString, check_unicode
from proxima.proxy.store.chains import identical
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.tools.fallback import with_tools_in_system

_ENCODE_CACHE_SIZE = 4096
# Tokens of a parent's prompt decoded to check it ended with this request's generation prompt.
_PROMPT_TAIL = 32

logger = logging.getLogger(__name__)

Message = dict[str, Any]

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Text parts of a list ``content`` are joined like this (as vLLM does).
_PART_SEPARATOR = "\n"


class InvalidMessages(errors.BadRequest):
    """``messages`` cannot be served; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str = "messages") -> None:
        super().__init__(message, param=param)


# ----------------------------------------------------------------------- normalize


def normalize_messages(messages: Any) -> list[Message]:
    """Validate OpenAI chat messages and return them in canonical form.

    Raises ``InvalidMessages`` (a 400) naming the field, for an empty list,
    an unknown role, a non-text content part, a tool message without
    ``tool_call_id``, or a field of the wrong type. Unknown fields (``refusal``,
    ``audio``, ``annotations``, a null ``function_call``) are dropped.
    """
    if not isinstance(messages, list):
        raise InvalidMessages("'messages' must be a list of message objects.")
    if not messages:
        raise InvalidMessages("'messages' must contain at least one message.")
    return [normalize_message(message, index) for index, message in enumerate(messages)]


def normalize_message(message: Any, index: int = 0) -> Message:
    """One message in canonical form; ``index`` places it in error messages."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidMessages(f"{where} must be an object.", param=where)
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidMessages(
            f"Invalid role {role!r} in {where}; expected one of: {', '.join(_ROLES)}.",
            param=f"{where}.role",
        )
    if role == "developer":
        role = "system"
    if "content" not in message and role != "assistant":
        raise InvalidMessages(f"{where} ({role}) is missing 'content'.", param=f"{where}.content")
    out: Message = {"role": role, "content": _text_content(message.get("content"), where)}
    if role == "assistant":
        tool_calls = _tool_calls(message.get("tool_calls"), where)
        if tool_calls:
            out["tool_calls"] = tool_calls
        reasoning = _reasoning_content(message, where)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    elif message.get("tool_calls"):
        raise InvalidMessages(
            f"{where}: only assistant messages may have 'tool_calls'.",
            param=f"{where}.tool_calls",
        )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidMessages(
                f"{where} (tool) must have a non-empty string 'tool_call_id'.",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidMessages(f"{where}.name must be a string.", param=f"{where}.name")
        out["name"] = name
    return out


def _reasoning_content(message: dict[str, Any], where: str) -> str | None:
    """An assistant message's reasoning: ``reasoning_content`` (DeepSeek, SGLang) or
    ``reasoning`` (newer vLLM), a string; None when absent or null."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidMessages(f"{where}.{key} must be a string.", param=f"{where}.{key}")
        return value
    return None


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidMessages(
            f"{where}.content must be a string, null, or a list of text parts.",
            param=f"{where}.content",
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidMessages(f"{param} must be an object.", param=param)
        kind = part.get("type")
        if kind != "text":
            raise InvalidMessages(
                f"Unsupported content part type {kind!r} in {param}: only 'text' parts "
                "are supported by this model.",
                param=f"{param}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidMessages(f"{param}.text must be a string.", param=f"{param}.text")
        texts.append(text)
    return _PART_SEPARATOR.join(texts)


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise InvalidMessages(f"{where}.tool_calls must be a list.", param=f"{where}.tool_calls")
    return [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(tool_calls)]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise InvalidMessages(f"{where} must be an object.", param=where)
    if call.get("type", "function") != "function":
        raise InvalidMessages(
            f"Unsupported tool call type {call.get('type')!r} in {where}; expected 'function'.",
            param=f"{where}.type",
        )
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise InvalidMessages(f"{where}.id must be a string.", param=f"{where}.id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidMessages(f"{where}.function must be an object.", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidMessages(
            f"{where}.function.name must be a non-empty string.", param=f"{where}.function.name"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = parse_tool_arguments(arguments, f"{where}.function.arguments")
    elif not isinstance(arguments, dict):
        raise InvalidMessages(
            f"{where}.function.arguments must be a JSON string.",
            param=f"{where}.function.arguments",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_arguments(arguments: str, param: str) -> dict[str, Any] | str:
    """A tool call's ``arguments`` in canonical form: the JSON object the string holds, or
    the string itself if it holds none. JSON escapes may decode to a lone surrogate: an
    ``InvalidMessages`` naming ``param`` (and the key inside it)."""
    try:
        parsed: Any = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        parsed = arguments
    if not isinstance(parsed, dict):
        parsed = arguments
    try:
        check_unicode(parsed, param)
    except InvalidString as exc:
        raise InvalidMessages(str(exc), param=exc.param) from exc
    return parsed


def messages_equivalent(a: Message, b: Message) -> bool:
    """Whether two canonical messages are the same turn.

    Role, content, ``tool_call_id`` and each call's name and parsed arguments
    must match exactly; call ids, ``name`` and ``reasoning_content`` are
    compared only when both sides have them (clients echo our ids and the
    reasoning back, or drop them).
    """
    if a["role"] != b["role"] or a["content"] != b["content"]:
        return False
    if a.get("tool_call_id") != b.get("tool_call_id"):
        return False
    if "name" in a and "name" in b and a["name"] != b["name"]:
        return False
    if (
        "reasoning_content" in a
        and "reasoning_content" in b
        and a["reasoning_content"] != b["reasoning_content"]
    ):
        return False
    calls_a, calls_b = a.get("tool_calls", []), b.get("tool_calls", [])
    if len(calls_a) != len(calls_b):
        return False
    for call_a, call_b in zip(calls_a, calls_b, strict=True):
        if call_a["id"] and call_b["id"] and call_a["id"] != call_b["id"]:
            return False
        if call_a["function"] != call_b["function"]:
            return False
    return True


# Arguments of the renderer itself: never a template variable a client may set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "return_assistant_tokens_mask",
        "tokenize",
        "return_dict",
    }
)


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` less the renderer's own arguments (checked with a 400 earlier)."""
    if not kwargs:
        return {}
    return {k: v for k, v in kwargs.items() if k not in RESERVED_TEMPLATE_KWARGS}


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    """JSON of a tool list in its own key order (absent and empty are the same).

    Key order matters: the template writes tools with ``tojson``, which keeps
    it, so tools that differ only in key order render different prompts.
    """
    return json.dumps(list(tools or []), ensure_ascii=False)


# ------------------------------------------------------------------------ renderer


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """The token ids to generate from, and where they came from.

    ``parent_id`` is the completion whose ``prompt_ids + output_ids`` start
    ``prompt_ids`` (None for a fresh render); ``appended_ids`` are the ids
    after that prefix: the new messages' tokens, or the whole prompt when fresh.
    """

    prompt_ids: list[int]
    parent_id: str | None
    appended_ids: list[int]
    text: str = ""  # the template's text of the whole conversation (generation prompt included)


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


class ChatRenderer:
    """Renders canonical messages with a Hugging Face tokenizer's chat template.

    ``end_of_turn`` is the marker that closes an assistant reply in the
    template; it defaults to the tokenizer's eos token and must be one token.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        end_of_turn: str | None = None,
        rendered: RenderedTexts | None = None,
        tool_fallback: str | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; chat completions need one")
        marker = end_of_turn or tokenizer.eos_token
        if not marker:
            raise ValueError("the tokenizer has no eos token; pass end_of_turn explicitly")
        marker_ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(marker_ids) != 1:
            raise ValueError(f"end-of-turn marker {marker!r} is not a single token")
        self._tokenizer = tokenizer
        # A template that does not render tools: they go in the system prompt in this format
        # (``proxima.proxy.tools.fallback``).
        self.tool_fallback = tool_fallback
        self.end_of_turn: str = marker
        self.end_of_turn_id: int = marker_ids[0]
        self._encodings: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.rendered = rendered if rendered is not None else RenderedTexts()
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render: Callable[..., Any] = render_jinja_template
        self._special_tokens = dict(tokenizer.special_tokens_map)  # the template's variables

    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` and the OpenAI ``tools`` list.

        Not memoized: a cache key must keep key order (``tojson`` does), and
        building one costs about half a render (0.3-0.6 ms on a 40-turn
        conversation against 0.4-1.5 ms for the render), while tokenizing the
        text costs 10-50 times more and is memoized in ``encode``.
        """
        tool_list = list(tools) if tools else None
        if tool_list and self.tool_fallback:
            messages = with_tools_in_system(messages, tool_list, self.tool_fallback)
            tool_list = None
        try:
            # What ``apply_chat_template(..., tokenize=False)`` does, less the per-call
            # ``special_tokens_map`` (half of its cost), which is fixed and computed once.
            rendered, _ = self._render(
                conversations=[list(messages)],
                tools=tool_list,
                chat_template=self._tokenizer.get_chat_template(None, tool_list),
                add_generation_prompt=add_generation_prompt,
                **{**_template_variables(template_kwargs), **self._special_tokens},
            )
            return str(rendered[0])
        except TemplateError as exc:
            raise InvalidMessages(f"The chat template rejected the messages: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become special tokens."""
        cached = self._encodings.get(text)
        if cached is not None:
            self._encodings.move_to_end(text)
            return list(cached)
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        self._encodings[text] = tuple(ids)
        if len(self._encodings) > _ENCODE_CACHE_SIZE:
            self._encodings.popitem(last=False)
        return ids

    def build_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        history: Sequence[CompletionRecord],
        template_kwargs: dict[str, Any] | None = None,
    ) -> PromptPlan:
        """The prompt for canonical ``messages``, reusing the session's tokens if possible.

        ``history`` is the session's completions, oldest first. The parent is
        the completion whose request messages plus reply the new messages
        strictly extend, with the same tools: the longest such prefix, then
        the most recent. Messages are compared before anything is rendered;
        the conversation is rendered once, and the parent's request too unless
        its text was kept (``RenderedTexts``). ``template_kwargs`` are extra
        variables of the template (``enable_thinking``).
        """
        kwargs = template_kwargs or None
        full = self.render_text(messages, tools, add_generation_prompt=True, template_kwargs=kwargs)
        parent = _find_parent(messages, tools, history)
        if parent is not None:
            plan = self._extend(parent, messages, full, tools, kwargs)
            if plan is not None:
                return plan
        prompt_ids = self.encode(full)
        return PromptPlan(prompt_ids=prompt_ids, parent_id=None, appended_ids=prompt_ids, text=full)

    def find_parent(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        history: Sequence[CompletionRecord],
    ) -> CompletionRecord | None:
        """The completion ``build_prompt`` would try to extend (compares, renders nothing)."""
        parent = _find_parent(messages, tools, history)
        return None if parent is None else parent.record

    def _opened(
        self,
        record: CompletionRecord,
        request: list[Message],
        tools: Sequence[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text of ``request`` with a generation prompt: the parent's prompt
        text. Kept from when the parent was prepared if ``request``, ``tools`` and the
        template variables are identical to the parent's (same values, types and key
        order), else rendered."""
        kept = self.rendered.get(record.id)
        if (
            kept is not None
            and identical(kwargs or None, kept[1])
            and identical(request, record.request_messages)
            and identical(list(tools or []), list(record.request_tools or []))
        ):
            return kept[0]
        return self.render_text(request, tools, add_generation_prompt=True, template_kwargs=kwargs)

    def _extend(
        self,
        parent: _Candidate,
        messages: Sequence[Message],
        full: str,
        tools: Sequence[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
    ) -> PromptPlan | None:
        """Parent tokens plus the new messages' tokens, or None if the template forbids it.

        ``full`` is the whole new conversation rendered with a generation
        prompt. The parent's tokens are reused only when the template renders
        the parent's turn, in this conversation, as exactly those tokens: the
        parent's prompt text (its request rendered with a generation prompt)
        must start ``full``, and the reply, up to the first end-of-turn marker
        after it, must be the generated text. A template that rewrites the reply
        (one that drops earlier turns' reasoning, as Qwen3's and DeepSeek-R1's
        do) fails the second test, and the prompt is the template's own
        rendering. Then ``full`` is exactly the parent's text, its reply, and
        what follows: only that last part is tokenized, and no other rendering
        of the conversation is needed when the parent's text was kept.
        """
        record = parent.record
        size = len(parent.request) + 1
        try:
            opened = self._opened(record, list(messages[: size - 1]), tools, kwargs)
        except InvalidMessages:
            logger.debug("template rejects the parent's messages", extra={"parent": record.id})
            return None
        if not full.startswith(opened):
            logger.debug("template rewrites history; rendering fresh", extra={"parent": record.id})
            return None
        marker_at = full.find(self.end_of_turn, len(opened))
        if marker_at < 0:
            logger.debug("reply has no end-of-turn marker; rendering fresh")
            return None
        generated_marker = bool(record.output_ids) and record.output_ids[-1] == self.end_of_turn_id
        if not self._renders_as_generated(record, opened, full[len(opened) : marker_at]):
            logger.debug(
                "template renders the reply unlike the generated tokens; rendering fresh",
                extra={"parent": record.id},
            )
            return None
        cut = marker_at + len(self.end_of_turn) if generated_marker else marker_at
        appended = self.encode(full[cut:])
        return PromptPlan(
            prompt_ids=[*record.prompt_ids, *record.output_ids, *appended],
            parent_id=record.id,
            appended_ids=appended,
            text=full,
        )

    def _renders_as_generated(self, record: CompletionRecord, opened: str, reply: str) -> bool:
        """Whether the parent's tokens are the text the template renders for its turn.

        ``reply`` is the template's text of the reply (between the generation
        prompt and the end-of-turn marker), which must be the text of the
        generated tokens (less a generated end-of-turn marker); and the
        parent's prompt must end with ``opened``'s generation prompt (a request
        that turns thinking on or off changes it). Only the prompt's last
        ``_PROMPT_TAIL`` tokens are decoded: the generation prompt is shorter.
        """
        output = record.output_ids
        if output and output[-1] == self.end_of_turn_id:
            output = output[:-1]
        if self._decode(output) != reply:
            return False
        # A tail that starts inside a multi-byte character decodes to U+FFFD there.
        return opened.endswith(self._decode(record.prompt_ids[-_PROMPT_TAIL:]).lstrip("\ufffd"))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self._tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A completion that can be extended, with its messages in canonical form."""

    record: CompletionRecord
    request: list[Message]
    reply: Message


def _find_parent(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    history: Sequence[CompletionRecord],
) -> _Candidate | None:
    """The completion the new messages extend (longest prefix, then most recent)."""
    candidates: list[tuple[int, int, CompletionRecord, list[Message], Message]] = []
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
                    return _Candidate(record=record, request=request[::-1], reply=reply)
        except InvalidMessages:
            logger.warning("stored messages of completion %s are not valid", record.id)
    return None
