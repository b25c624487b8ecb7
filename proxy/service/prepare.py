"""Prompt preparation: a canonical request to token ids and generation parameters.

One path per input kind, and one context check for both:

- chat: canonical messages are rendered token-exactly against the session's
  earlier completions (``proxima.proxy.rendering.chat_template.ChatRenderer.build_prompt``);
- text: one string (tokenized without special tokens) or one list of token
  ids; its parent is the latest completion of the session whose prompt plus
  output it strictly extends;
- ``max_tokens`` is checked against the context window and the server's
  limit, and defaults to what is left of the context.

The result, ``Prepared``, is everything the generation driver and the
recorder need; it holds no API-specific field.

Rendering and tokenizing are CPU work on the event loop's thread. A prompt
over ``OFFLOAD_CHARS`` characters (a few milliseconds of work) goes to one
worker thread instead, so a multi-megabyte message delays only itself, not
``/health`` and every other client; big prompts queue behind each other on
that thread. The worker has its own ``ChatRenderer`` (its caches are not
shared across threads). Smaller prompts stay inline, where a thread hop would
cost more than the work. Measured with the tests' tokenizer on a loaded
2-core machine (fresh renders, medians): 1k characters block the loop 0.5 ms
inline and take 3.1 ms offloaded; 4k: 1.2 vs 6.9 ms; 16k: 12 vs 17 ms; 64k:
80 vs 85 ms. At the threshold the loop is blocked ~12 ms at most, and above it
the hop adds a third or less to the request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from proxima.proxy.config import Settings
from proxima.proxy.errors import BadRequest, ContextTooLong
from proxima.proxy.policies.deployments import Deployment
from proxima.proxy.rendering.chat_template import ChatRenderer, PromptPlan
from proxima.proxy.rendering.parents import RenderedTexts
from proxima.proxy.rendering.reasoning import ReasoningParser
from proxima.proxy.rendering.sampling import ReasoningBudget, Sampling
from proxima.proxy.rendering.structured import Grammar, ReasoningFirst, checked_output_grammar
from proxima.proxy.service.canonical import CanonicalMessage, CanonicalRequest, ChatInput
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.proxy.tools import ToolCallParser, ToolChoice, parser_for_choice
from proxima.proxy.tools.fallback import template_renders_tools

# Prompts with more characters than this are rendered and tokenized off the event loop.
OFFLOAD_CHARS = 16_384
# Tokens at a prompt's end read to tell whether it leaves a reasoning block open.
_PROMPT_TAIL = 16

T = TypeVar("T")


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to generate.

    ``parser`` and ``tool_choice`` are set for chat input only; ``messages``
    and ``tools`` are what is recorded as the request (None for text).
    """

    response_id: str
    created: int
    n: int
    prompt_ids: list[int]
    parent_id: str | None
    params: (
        Sampling  # completed: its budget, logprobs, grammar (``proxima.proxy.rendering.sampling``)
    )
    session: SessionRecord | None
    logprobs: bool = False
    messages: list[CanonicalMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    parser: ToolCallParser | None = None
    tool_choice: ToolChoice | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    deployment: Deployment | None = None  # who serves it (``proxima.proxy.policies.deployments``)
    reasoning: ReasoningParser | None = None  # a thinking model's (chat input only)
    in_reasoning: bool = False  # the reply starts inside the reasoning (the prompt opened it)
    # The record of ``parent_id``, from the session's history: the store keeps only what
    # each completion adds to it (``proxima.proxy.store.chains``).
    parent: CompletionRecord | None = None
    # The template's text of ``messages`` and the template variables it was rendered with
    # (chat input only), kept for the next turn (``RenderedTexts``).
    rendered: tuple[str, dict[str, Any] | None] | None = None
    # The policy that serves it: a LoRA adapter's name, or None for the base model
    # (``proxima.proxy.policies.adapters``; the credential decides).
    adapter: str | None = None

    @property
    def completion_ids(self) -> list[str]:
        """The recorded id of each choice: the response id, then ``{id}-{i}``."""
        return [self.response_id if i == 0 else f"{self.response_id}-{i}" for i in range(self.n)]


class PromptPreparer:
    """Turns canonical requests into ``Prepared`` ones for one model and tokenizer."""

    def __init__(
        self,
        *,
        settings: Settings,
        tokenizer: Any,
        context_length: int,
        tool_parser: ToolCallParser,
        reasoning_parser: ReasoningParser | None = None,
        offload_chars: int = OFFLOAD_CHARS,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        plain = ChatRenderer(tokenizer)
        # A template that drops tools: a declared fallback renders them, or requests with
        # tools are a 400 (never dropped silently): proxima.proxy.tools.fallback.
        self.renders_tools = template_renders_tools(
            lambda messages, tools: plain.render_text(messages, tools, add_generation_prompt=True)
        )
        fallback = None if self.renders_tools else settings.tool_fallback
        if fallback is not None and fallback != tool_parser.name:
            raise ValueError(
                f"--tool-fallback {fallback} writes calls the {tool_parser.name!r} tool parser "
                f"does not read; serve with --tool-parser {fallback}"
            )
        self.tool_fallback = fallback
        # The parent's prompt text of a turn, kept from when the parent was prepared.
        self.rendered = RenderedTexts()
        self.renderer = ChatRenderer(  # event loop only
            tokenizer, rendered=self.rendered, tool_fallback=fallback
        )
        self.context_length = context_length
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.offload_chars = offload_chars
        self._worker_renderer = ChatRenderer(  # worker only
            tokenizer, rendered=self.rendered, tool_fallback=fallback
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxima-prompt")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def render(self, chat: ChatInput, history: Sequence[CompletionRecord]) -> PromptPlan:
        """``ChatRenderer.build_prompt``, on the worker thread for a long conversation
        that is not a turn extending a parent whose prompt text was kept (such a turn
        renders the conversation once and tokenizes only its new messages: less work
        than a thread hop costs)."""
        if chat.tools and not self.renders_tools and self.tool_fallback is None:
            raise BadRequest(
                "This model's chat template does not render tools, so the model would never "
                "see them. Serve with --tool-fallback hermes to write them into the system "
                "prompt in hermes' format, or send the request without 'tools'.",
                param="tools",
            )
        if _chat_chars(chat) > self.offload_chars and not self._extends_kept(chat, history):
            build = self._worker_renderer.build_prompt
            return await self._off_loop(
                build, chat.messages, chat.tools, list(history), chat.template_kwargs
            )
        return self.renderer.build_prompt(chat.messages, chat.tools, history, chat.template_kwargs)

    def _extends_kept(self, chat: ChatInput, history: Sequence[CompletionRecord]) -> bool:
        if not history:
            return False
        parent = self.renderer.find_parent(chat.messages, chat.tools, history)
        return parent is not None and self.rendered.get(parent.id) is not None

    async def chat(
        self,
        request: CanonicalRequest,
        chat: ChatInput,
        session: SessionRecord | None,
        history: Sequence[CompletionRecord],
    ) -> Prepared:
        plan = await self.render(chat, history)
        parser, in_reasoning, first = self.reasoning_parser, False, None
        if parser is not None:
            tail = self.tokenizer.decode(plan.prompt_ids[-_PROMPT_TAIL:], skip_special_tokens=False)
            in_reasoning = parser.starts_in_reasoning(tail)
            if in_reasoning or not tail.rstrip().endswith(parser.end):  # thinking not off
                first = ReasoningFirst(parser.start, parser.end, opened=in_reasoning)
        grammar = await checked_output_grammar(
            response_format=chat.response_format,
            tool_choice=chat.tool_choice,
            tools=chat.tools,
            tool_parser=self.tool_parser.name,
            parallel_tool_calls=chat.parallel_tool_calls,
            reasoning=first,
        )
        prepared = self._prepared(request, plan.prompt_ids, plan.parent_id, session, grammar)
        if self.tool_fallback is not None and (chat.tools or _has_tool_turns(chat.messages)):
            # The template renders no tools: the fallback wrote them, the calls and results.
            prepared.sampling["tool_format"] = f"{self.tool_fallback} (--tool-fallback)"
        prepared.messages = chat.messages
        prepared.tools = chat.tools
        prepared.rendered = (plan.text, chat.template_kwargs)
        prepared.parser = parser_for_choice(self.tool_parser, chat.tool_choice)
        prepared.tool_choice = chat.tool_choice
        if parser is not None:
            prepared.reasoning, prepared.in_reasoning = parser, in_reasoning
            if chat.reasoning_budget is not None:
                budget = self._budget(chat.reasoning_budget, parser, in_reasoning)
                prepared.params = replace(prepared.params, reasoning_budget=budget)
        return prepared

    def _budget(self, limit: int, parser: ReasoningParser, in_reasoning: bool) -> ReasoningBudget:
        """``limit`` reasoning tokens, then ``\n</think>\n\n`` (the template's own closing)."""
        decode = self.tokenizer.decode

        def is_open(ids: list[int]) -> bool:
            split = parser.parse(decode(ids, skip_special_tokens=True), in_reasoning=in_reasoning)
            return split.reasoning is not None and not split.closed

        close = self.tokenizer.encode(f"\n{parser.end}\n\n", add_special_tokens=False)
        return ReasoningBudget(limit=limit, close_ids=close, is_open=is_open)

    async def text_prompt(self, prompt: Any) -> list[int]:
        """``text_prompt_ids``, on the worker thread for a long prompt."""
        if isinstance(prompt, str | list) and len(prompt) > self.offload_chars:
            return await self._off_loop(self.text_prompt_ids, prompt)
        return self.text_prompt_ids(prompt)

    def text(
        self,
        request: CanonicalRequest,
        prompt_ids: list[int],
        session: SessionRecord | None,
        history: Sequence[CompletionRecord],
    ) -> Prepared:
        return self._prepared(request, prompt_ids, _text_parent(prompt_ids, history), session)

    def text_prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a text prompt: one string, or one list of ids (or a list of one)."""
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1:
            return self.text_prompt_ids(prompt[0])
        else:
            raise BadRequest("prompt must be one string or one list of token ids.", param="prompt")
        if not ids:
            raise BadRequest("prompt is empty.", param="prompt")
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab}).", param="prompt")
        return ids

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The completion budget: ``requested``; without it the server's ``default_max_tokens``
        (every surface alike, capped by what the context leaves). Too large: an error, or with
        ``clamp_max_tokens`` what the context and the limit leave."""
        ctx = self.context_length
        if prompt_len >= ctx:
            raise ContextTooLong(
                f"This model's maximum context length is {ctx} tokens. However, your "
                f"messages resulted in {prompt_len} tokens. Please reduce the length "
                "of the messages.",
                param="messages",
                prompt_tokens=prompt_len,
                context_length=ctx,
            )
        left = min(ctx - prompt_len, self.settings.max_tokens_limit)
        if requested is None:
            return min(self.settings.default_max_tokens, left)
        if self.settings.clamp_max_tokens:
            return min(requested, left)
        if requested > self.settings.max_tokens_limit:
            raise BadRequest(
                f"max_tokens is too large: {requested}. This server accepts at most "
                f"{self.settings.max_tokens_limit}.",
                param="max_tokens",
            )
        if prompt_len + requested > ctx:
            raise ContextTooLong(
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages "
                "or completion.",
                param="max_tokens",
                prompt_tokens=prompt_len,
                max_tokens=requested,
                context_length=ctx,
            )
        return requested

    def _params(
        self, sampling: Sampling, max_tokens: int, top_logprobs: int, grammar: Grammar | None
    ) -> Sampling:
        """``sampling`` completed for generation: its budget and what only this model knows."""
        if sampling.n > self.settings.max_n:
            raise BadRequest(f"n must be at most {self.settings.max_n}.", param="n")
        return replace(
            sampling,
            max_tokens=max_tokens,
            max_tokens_default=sampling.max_tokens is None,
            top_logprobs=top_logprobs,
            logit_bias=self._logit_bias(sampling.logit_bias),
            grammar=grammar,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[str, float] | None:
        """``bias`` checked against the vocabulary (keys and ranges are checked per API)."""
        if not bias:
            return None
        vocab = len(self.tokenizer)  # tens of microseconds with a fast tokenizer
        for key in bias:
            if not key.isdigit() or int(key) >= vocab:
                raise BadRequest(
                    f"logit_bias names token {key!r}, not an id in this model's vocabulary "
                    f"[0, {vocab}).",
                    param="logit_bias",
                )
        return {key: float(value) for key, value in bias.items()}

    def _prepared(
        self,
        request: CanonicalRequest,
        prompt_ids: list[int],
        parent_id: str | None,
        session: SessionRecord | None,
        grammar: Grammar | None = None,
    ) -> Prepared:
        max_tokens = self.max_tokens(request.sampling.max_tokens, len(prompt_ids))
        params = self._params(request.sampling, max_tokens, request.top_logprobs, grammar)
        return Prepared(
            response_id=request.id_prefix + uuid.uuid4().hex,
            created=int(time.time()),
            n=request.sampling.n,
            prompt_ids=prompt_ids,
            parent_id=parent_id,
            params=params,
            session=session,
            logprobs=request.logprobs,
            sampling=params.record(),
        )


def _chat_chars(chat: ChatInput) -> int:
    """About how many characters rendering ``chat`` will tokenize."""
    size = sum(len(m["content"]) for m in chat.messages)
    size += sum(len(str(m["tool_calls"])) for m in chat.messages if "tool_calls" in m)
    return size + (len(str(chat.tools)) if chat.tools else 0)


def _has_tool_turns(messages: Sequence[CanonicalMessage]) -> bool:
    """Whether a conversation holds tool calls or tool results."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def _text_parent(prompt_ids: list[int], history: Sequence[CompletionRecord]) -> str | None:
    """The latest completion whose prompt plus output ``prompt_ids`` strictly extends."""
    for c in reversed(history):
        prefix = c.prompt_ids + c.output_ids
        if len(prompt_ids) > len(prefix) and prompt_ids[: len(prefix)] == prefix:
            return c.id
    return None
