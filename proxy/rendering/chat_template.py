"""Messages to token ids, token-exact across the turns of a session.

The proxy, not the backend, turns messages into token ids (docs/design.md,
"Token-exact multi-turn"). Two steps:

1. ``normalize_messages`` (``proxima.proxy.rendering.chat_messages``) validates
   OpenAI messages and brings them to one canonical form, used both for
   rendering and for comparing turns.
2. ``ChatRenderer.build_prompt`` looks for an earlier completion of the
   session that the new messages extend (its request messages plus its
   assistant reply, then something new: ``proxima.proxy.rendering.parents``).
   If there is one, the prompt is that completion's exact ``prompt_ids +
   output_ids`` followed by the tokens of the new messages only; otherwise the
   whole conversation is rendered fresh and starts a new branch of the
   session's tree.

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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from proxima.proxy.rendering.chat_messages import InvalidMessages, Message
from proxima.proxy.rendering.parents import Candidate, RenderedTexts, find_parent
from proxima.proxy.store.chains import identical
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.tools.fallback import fallback_messages

_ENCODE_CACHE_SIZE = 4096
# Tokens of a parent's prompt decoded to check it ended with this request's generation prompt.
_PROMPT_TAIL = 32

logger = logging.getLogger(__name__)


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
        generated: Mapping[int, str] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` and the OpenAI ``tools`` list.

        With a tool fallback, the fallback writes the tools, the calls and their
        results into the messages first (``proxima.proxy.tools.fallback``);
        ``generated`` holds the text the model generated for recorded replies
        with calls, by message index (``generated_replies``).

        Not memoized: a cache key must keep key order (``tojson`` does), and
        building one costs about half a render (0.3-0.6 ms on a 40-turn
        conversation against 0.4-1.5 ms for the render), while tokenizing the
        text costs 10-50 times more and is memoized in ``encode``.
        """
        tool_list = list(tools) if tools else None
        if self.tool_fallback:
            messages = fallback_messages(messages, tool_list, self.tool_fallback, generated)
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
        parent = find_parent(messages, tools, history)
        generated = self.generated_replies(parent.record, history) if parent else None
        full = self.render_text(
            messages, tools, add_generation_prompt=True, template_kwargs=kwargs, generated=generated
        )
        if parent is not None:
            plan = self._extend(parent, messages, full, tools, kwargs, generated)
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
        parent = find_parent(messages, tools, history)
        return None if parent is None else parent.record

    def _opened(
        self,
        record: CompletionRecord,
        request: list[Message],
        tools: Sequence[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
        generated: Mapping[int, str] | None = None,
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
        return self.render_text(
            request, tools, add_generation_prompt=True, template_kwargs=kwargs, generated=generated
        )

    def _extend(
        self,
        parent: Candidate,
        messages: Sequence[Message],
        full: str,
        tools: Sequence[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
        generated: Mapping[int, str] | None = None,
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
            opened = self._opened(record, list(messages[: size - 1]), tools, kwargs, generated)
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

    def generated_replies(
        self, parent: CompletionRecord, history: Sequence[CompletionRecord]
    ) -> dict[int, str] | None:
        """With a tool fallback: the text each reply with tool calls of ``parent``'s chain
        was generated as, by its message index (None without a fallback).

        The chain is ``parent``, its parent, and so on (``parent_id``); a chat
        completion's reply is the message after its request. The fallback writes these
        replies as generated instead of re-serializing their calls (whose JSON the
        model may have spaced or ordered otherwise), so every turn of a tool loop
        renders its parent's reply as exactly the parent's output tokens.
        """
        if not self.tool_fallback:
            return None
        by_id: dict[str, CompletionRecord] | None = None
        texts: dict[int, str] = {}
        record: CompletionRecord | None = parent
        for _ in range(len(history) + 1):  # a chain is at most the whole history
            if record is None or not record.request_messages or record.response_message is None:
                break
            if record.response_message.get("tool_calls"):
                texts[len(record.request_messages)] = self._generated_text(record)
            if record.parent_id is None:
                break
            if by_id is None:
                by_id = {r.id: r for r in history}
            record = by_id.get(record.parent_id)
        return texts

    def _generated_text(self, record: CompletionRecord) -> str:
        """The text of a completion's output tokens, less a generated end-of-turn marker."""
        output = record.output_ids
        if output and output[-1] == self.end_of_turn_id:
            output = output[:-1]
        return self._decode(output)

    def _renders_as_generated(self, record: CompletionRecord, opened: str, reply: str) -> bool:
        """Whether the parent's tokens are the text the template renders for its turn.

        ``reply`` is the template's text of the reply (between the generation
        prompt and the end-of-turn marker), which must be the text of the
        generated tokens (less a generated end-of-turn marker); and the
        parent's prompt must end with ``opened``'s generation prompt (a request
        that turns thinking on or off changes it). Only the prompt's last
        ``_PROMPT_TAIL`` tokens are decoded: the generation prompt is shorter.
        """
        if self._generated_text(record) != reply:
            return False
        # A tail that starts inside a multi-byte character decodes to U+FFFD there.
        return opened.endswith(self._decode(record.prompt_ids[-_PROMPT_TAIL:]).lstrip("\ufffd"))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self._tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
