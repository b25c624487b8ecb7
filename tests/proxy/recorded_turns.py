"""What the proxy records for one chat turn, built without a model, for the rendering tests.

``recorded_turn`` has the model "generate" ``reply_text`` on ``plan``'s prompt: its tokens
and the end-of-turn marker (none when ``finished`` is false: a reply cut at ``max_tokens``,
finish reason ``length``), and the response message built the way the proxy builds it: the
reasoning split off by ``reasoning_parser`` when one is named (as ``reasoning_content``), the
rest read by the hermes tool parser (string arguments). Ids are ``cmpl-<n>`` from one counter
unless ``cid`` names one; other ``CompletionRecord`` fields (``response_text``) pass through.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

from proxima.proxy.rendering.chat_messages import Message
from proxima.proxy.rendering.chat_template import ChatRenderer, PromptPlan
from proxima.proxy.rendering.reasoning import get_reasoning_parser
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.tools import get_tool_parser

_ids = itertools.count()


def recorded_turn(
    renderer: ChatRenderer,
    messages: list[Message],
    plan: PromptPlan,
    reply_text: str,
    *,
    tools: list[dict[str, Any]] | None,
    finished: bool = True,
    reasoning_parser: str | None = None,
    cid: str | None = None,
    **fields: Any,
) -> CompletionRecord:
    """The record of one generated turn (see the module docstring)."""
    output_ids = renderer.encode(reply_text) + ([renderer.end_of_turn_id] if finished else [])
    content, reasoning = reply_text, None
    if reasoning_parser is not None:
        parser = get_reasoning_parser(reasoning_parser)
        assert parser is not None, reasoning_parser
        split = parser.parse(reply_text, in_reasoning=False)
        content, reasoning = split.content, split.reasoning
    parsed = get_tool_parser("hermes").parse(content)
    response: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        response["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    if reasoning is not None:
        response["reasoning_content"] = reasoning
    return CompletionRecord(
        id=cid if cid is not None else f"cmpl-{next(_ids)}",
        session_id="s",
        parent_id=plan.parent_id,
        prompt_ids=plan.prompt_ids,
        output_ids=output_ids,
        output_logprobs=[0.0] * len(output_ids),
        output_versions=[0] * len(output_ids),
        finish_reason="stop" if finished else "length",
        created_at=datetime.now(UTC),
        request_messages=messages,
        request_tools=tools,
        response_message=response,
        **fields,
    )
