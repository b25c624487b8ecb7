"""Multi-turn prompts of a thinking model: the template's own prompt, every turn."""

from __future__ import annotations

from typing import Any

import pytest
from proxima.proxy.rendering.chat_messages import Message, normalize_messages
from proxima.proxy.rendering.chat_template import ChatRenderer, PromptPlan
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.testing.tiny_model import THINKING_CHAT_TEMPLATE, build_tiny_tokenizer

from tests.proxy.recorded_turns import recorded_turn

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
]
# Like DeepSeek-R1's: every assistant turn's reasoning is dropped, the last one's too.
DROPS_ALL = THINKING_CHAT_TEMPLATE.replace("loop.index0 > ns.last_query", "false")


def tokenizer_with(template: str) -> Any:
    tokenizer = build_tiny_tokenizer(thinking=True)
    tokenizer.chat_template = template
    return tokenizer


def record_turn(
    renderer: ChatRenderer,
    messages: list[Message],
    tools: list[dict[str, Any]] | None,
    plan: PromptPlan,
    reply_text: str,
) -> CompletionRecord:
    """What the proxy records when the model generates ``reply_text`` and its end marker."""
    return recorded_turn(
        renderer, messages, plan, reply_text, tools=tools, reasoning_parser="qwen3"
    )


@pytest.mark.parametrize("template", [THINKING_CHAT_TEMPLATE, DROPS_ALL], ids=["qwen3", "r1"])
@pytest.mark.parametrize("echo_reasoning", [True, False], ids=["echoed", "dropped"])
def test_three_turns_are_each_the_templates_prompt(template: str, echo_reasoning: bool) -> None:
    """Every recorded prompt equals apply_chat_template of its request.

    Before the fix, with the R1-style template, turn 2's prompt held turn 1's
    reasoning tokens (the rendered history was a prefix, so it was extended).
    """
    tokenizer = tokenizer_with(template)
    renderer = ChatRenderer(tokenizer)
    questions = ["What is 1 plus 2?", "And 2 plus 2?", "And 3 plus 3?"]
    replies = [
        "<think>\n1 plus 2 is 3.\n</think>\n\nThe answer is 3.",
        "<think>\n2 plus 2 is 4.\n</think>\n\nThe answer is 4.",
        "<think>\n3 plus 3 is 6.\n</think>\n\nThe answer is 6.",
    ]
    sent: list[dict[str, Any]] = []
    history: list[CompletionRecord] = []
    for question, reply in zip(questions, replies, strict=True):
        sent.append({"role": "user", "content": question})
        messages = normalize_messages(sent)
        plan = renderer.build_prompt(messages, None, history)
        expected = tokenizer.apply_chat_template(sent, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(plan.prompt_ids) == expected
        assert plan.parent_id is None  # each turn's template drops the reasoning before it
        record = record_turn(renderer, messages, None, plan, reply)
        history.append(record)
        assert record.response_message is not None
        back = dict(record.response_message)
        if not echo_reasoning:
            back.pop("reasoning_content")
        sent.append(back)
    assert "1 plus 2 is 3." not in tokenizer.decode(history[-1].prompt_ids)


def first_call_turn(
    arguments: str,
) -> tuple[Any, ChatRenderer, list[dict[str, Any]], CompletionRecord, dict[str, Any]]:
    """Qwen3-style template: "Add 1 and 2." answered by the reasoning "I add." and one ``add``
    call whose arguments are written ``arguments``. Returns the tokenizer, the renderer, the
    messages sent so far, the turn's record and its response message."""
    tokenizer = tokenizer_with(THINKING_CHAT_TEMPLATE)
    renderer = ChatRenderer(tokenizer)
    sent: list[dict[str, Any]] = [{"role": "user", "content": "Add 1 and 2."}]
    turn1 = normalize_messages(sent)
    plan1 = renderer.build_prompt(turn1, TOOLS, [])
    call = f'<tool_call>\n{{"name": "add", "arguments": {arguments}}}\n</tool_call>'
    c1 = record_turn(renderer, turn1, TOOLS, plan1, f"<think>\nI add.\n</think>\n\n{call}")
    assert c1.response_message is not None
    return tokenizer, renderer, sent, c1, c1.response_message


def templates_prompt(tokenizer: Any, sent: list[dict[str, Any]]) -> str:
    """``apply_chat_template`` of ``sent`` with the tools: the prompt the template writes."""
    text: str = tokenizer.apply_chat_template(
        sent, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    return text


def test_a_tool_loop_keeps_its_reasoning_and_extends_token_exactly() -> None:
    """Within one user turn the Qwen3-style template keeps the reasoning: tokens reused."""
    tokenizer, renderer, sent, c1, reply = first_call_turn('{"a": 1, "b": 2}')
    assert reply["reasoning_content"] == "I add."
    call_id = reply["tool_calls"][0]["id"]
    sent += [reply, {"role": "tool", "tool_call_id": call_id, "content": "3"}]
    plan2 = renderer.build_prompt(normalize_messages(sent), TOOLS, [c1])
    assert plan2.parent_id == c1.id
    assert plan2.prompt_ids[: len(c1.prompt_ids) + len(c1.output_ids)] == (
        c1.prompt_ids + c1.output_ids
    )
    assert tokenizer.decode(plan2.prompt_ids) == templates_prompt(tokenizer, sent)


def test_a_reply_the_template_renders_differently_starts_a_new_chain() -> None:
    """The template writes the call's JSON its own way: the generated spacing is not reused."""
    tokenizer, renderer, sent, c1, reply = first_call_turn('{"a":1}')  # no space
    call_id = reply["tool_calls"][0]["id"]
    sent += [reply, {"role": "tool", "tool_call_id": call_id, "content": "1"}]
    plan2 = renderer.build_prompt(normalize_messages(sent), TOOLS, [c1])
    assert plan2.parent_id is None
    assert tokenizer.decode(plan2.prompt_ids) == templates_prompt(tokenizer, sent)


def test_reasoning_sent_back_must_match_the_recorded_reasoning() -> None:
    tokenizer, renderer, sent, c1, reply = first_call_turn('{"a": 1}')
    forged = {**reply, "reasoning_content": "Something else."}
    call_id = forged["tool_calls"][0]["id"]
    sent += [forged, {"role": "tool", "tool_call_id": call_id, "content": "1"}]
    plan2 = renderer.build_prompt(normalize_messages(sent), TOOLS, [c1])
    assert plan2.parent_id is None
    assert "Something else." in tokenizer.decode(plan2.prompt_ids)
