"""Signed reasoning (encrypted_content, thinking signatures) and the thinking options."""

from __future__ import annotations

from typing import Any

import pytest
from proxima.proxy.errors import BadRequest
from proxima.proxy.rendering.reasoning_seal import ReasoningSeal
from proxima.proxy.surfaces import reasoning_options
from proxima.proxy.surfaces.messages.schema import MessagesRequest
from proxima.proxy.surfaces.messages.translate import canonical_request
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.proxy.surfaces.responses.translate import input_messages

SEAL = ReasoningSeal(b"k" * 32)


def test_a_sealed_reasoning_opens_to_what_was_sealed() -> None:
    token = SEAL.seal("msg_1", "1 plus 2 is 3. ✓")
    opened = SEAL.open(token, param="p")
    assert (opened.completion_id, opened.reasoning) == ("msg_1", "1 plus 2 is 3. ✓")
    # The same key from the same secret on another replica opens it too.
    assert (
        ReasoningSeal.from_secrets(None, "admin")
        .open(ReasoningSeal.from_secrets(None, "admin").seal("a", "r"), param="p")
        .reasoning
        == "r"
    )


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        "garbage",
        SEAL.seal("msg_1", "R")[:-1] + "x",  # the MAC edited
        ReasoningSeal(b"other").seal("msg_1", "R"),  # another server's key
        "prx1." + SEAL.seal("msg_1", "R").split(".")[1][:-2] + "." + "A" * 43,
    ],
)
def test_anything_else_is_a_400_naming_the_field(token: Any) -> None:
    with pytest.raises(BadRequest, match="not issued by this server") as info:
        SEAL.open(token, param="input[1].encrypted_content")
    assert info.value.param == "input[1].encrypted_content"


def _messages(thinking: dict[str, Any], *, signature: str) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 2000,
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    "role": "assistant",
                    "content": [thinking | {"signature": signature}, {"type": "text", "text": "A"}],
                },
                {"role": "user", "content": "Q2"},
            ],
        }
    )


def test_thinking_blocks_map_to_reasoning_content_only_when_signed() -> None:
    block = {"type": "thinking", "thinking": "R"}
    canonical = canonical_request(_messages(block, signature=SEAL.seal("msg_1", "R")), seal=SEAL)
    assert canonical.input.messages[1] == {
        "role": "assistant",
        "content": "A",
        "reasoning_content": "R",
    }
    edited = _messages({"type": "thinking", "thinking": "R!"}, signature=SEAL.seal("msg_1", "R"))
    with pytest.raises(BadRequest, match="does not match") as info:
        canonical_request(edited, seal=SEAL)
    assert info.value.param == "messages[1].content[0].signature"


def test_reasoning_items_map_to_the_assistant_turn_they_start() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Q"},
                {"type": "reasoning", "summary": [], "encrypted_content": SEAL.seal("r", "R")},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "S"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
            ],
        }
    )
    messages = input_messages(req, seal=SEAL)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["reasoning_content"] == "R" and messages[1]["tool_calls"]
    assert messages[3] == {"role": "assistant", "content": "A", "reasoning_content": "S"}


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        (None, (None, None)),
        ({"type": "adaptive"}, (None, None)),
        ({"type": "disabled"}, ({"enable_thinking": False}, None)),
        ({"type": "enabled", "budget_tokens": 1024}, (None, 1024)),
    ],
)
def test_thinking_options_of_a_thinking_model(
    thinking: dict[str, Any] | None, expected: tuple[Any, Any]
) -> None:
    assert reasoning_options.messages_thinking(thinking, thinks=True, max_tokens=2000) == expected


@pytest.mark.parametrize(
    ("thinking", "param"),
    [
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 2000}, "thinking.budget_tokens"),  # >= max_tokens
        ({"type": "sometimes"}, "thinking.type"),
    ],
)
def test_bad_thinking_options_are_400s(thinking: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        reasoning_options.messages_thinking(thinking, thinks=True, max_tokens=2000)
    assert info.value.param == param
    # A model that does not think refuses enabled whatever its budget.
    with pytest.raises(BadRequest):
        reasoning_options.messages_thinking(
            {"type": "enabled", "budget_tokens": 1024}, thinks=False, max_tokens=2000
        )


def test_responses_effort_none_turns_thinking_off() -> None:
    from proxima.proxy.surfaces.responses.translate import canonical_request as responses_request

    req = ResponsesRequest.model_validate(
        {"model": "m", "input": "Q", "reasoning": {"effort": "none", "summary": "auto"}}
    )
    thinking = responses_request(req, thinks=True).input
    assert thinking.template_kwargs == {"enable_thinking": False}
    assert responses_request(req, thinks=False).input.template_kwargs is None
