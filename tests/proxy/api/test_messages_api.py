"""Anthropic Messages translation and builders, checked against the Anthropic SDK's own types.

Requests are translated to the canonical request by hand-written cases; built
messages and streamed events are validated strictly with the SDK's pydantic
models and replayed through the SDK's stream accumulator.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from proxima.proxy.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    BadRequest,
    ContextTooLong,
)
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.surfaces.messages.errors import error_of
from proxima.proxy.surfaces.messages.events import (
    MessageHead,
    MessagesStream,
    message_object,
    tool_input,
)
from proxima.proxy.surfaces.messages.schema import MessagesRequest
from proxima.proxy.surfaces.messages.translate import canonical_request
from proxima.proxy.tools import ContentDelta, ParsedOutput, ToolCall, ToolCallDelta, ToolChoice

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "input_schema": SCHEMA,
}


def req(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64, **body})


# ------------------------------------------------------------------------ translation


def test_system_blocks_and_a_tool_round_trip_become_canonical_messages() -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me "},
                {"type": "text", "text": "check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    system = [{"type": "text", "text": "You help."}, {"type": "text", "text": "Be brief."}]
    assert canonical_request(req(system=system, messages=messages)).input.messages == [
        {"role": "system", "content": "You help.\nBe brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "a\nb"},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize(
    ("tool_choice", "choice", "parallel"),
    [
        ({"type": "auto"}, ToolChoice("auto"), None),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoice("required"), False),
        ({"type": "none"}, ToolChoice("none"), None),
        ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather"), None),
    ],
)
def test_tool_choice_and_sampling_translate_to_the_canonical_request(
    tool_choice: dict[str, Any], choice: ToolChoice, parallel: bool | None
) -> None:
    canonical = canonical_request(
        req(
            messages=[{"role": "user", "content": "Q"}],
            tools=[WEATHER],
            tool_choice=tool_choice,
            stop_sequences=["END"],
            temperature=0.3,
            top_p=0.8,
            top_k=5,
            metadata={"user_id": "u1"},
        )
    )
    chat, sampling = canonical.input, canonical.sampling
    assert isinstance(chat, ChatInput)
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": SCHEMA,
            },
        }
    ]
    assert chat.tool_choice == choice
    assert chat.parallel_tool_calls == parallel
    assert (sampling.max_tokens, sampling.stop, canonical.user) == (64, ["END"], "u1")
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.3, 0.8, 5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "context_management.edits[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        ({"n": 2}, "n"),
    ],
)
def test_unsupported_requests_are_400s_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "Q"}], **body}
    with pytest.raises(BadRequest) as info:
        canonical_request(req(**body))
    assert info.value.param == param


def test_a_redacted_thinking_block_is_refused_saying_what_to_send_back() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
            {"role": "user", "content": "Q2"},
        ]
    }
    with pytest.raises(BadRequest) as info:
        canonical_request(req(**body))
    assert info.value.param == "messages[1].content[0].type"
    assert "never produces" in str(info.value) and "thinking blocks" in str(info.value)


def test_errors_use_anthropics_envelope_and_types() -> None:
    assert error_of(BadRequest("bad", param="max_tokens")) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: bad"},
    }
    assert error_of(ContextTooLong("long"))["error"]["type"] == "invalid_request_error"
    assert error_of(AuthenticationFailed("who"))["error"]["type"] == "authentication_error"
    assert error_of(BackendUnavailable("down"))["error"]["type"] == "overloaded_error"


# --------------------------------------------------------------------------- builders


def head() -> MessageHead:
    return MessageHead("msg_0123", "tiny")


@pytest.mark.parametrize(
    ("parsed", "finish", "stop", "reason", "sequence"),
    [
        (ParsedOutput("Hi", []), "stop", None, "end_turn", None),
        (ParsedOutput("Hi", []), "stop", "END", "stop_sequence", "END"),
        (ParsedOutput("Hi", []), "length", None, "max_tokens", None),
        (
            ParsedOutput(None, [ToolCall("call_1", "f", '{"a": 1}')]),
            "tool_calls",
            None,
            "tool_use",
            None,
        ),
    ],
)
def test_message_object_validates_as_the_sdk_message(
    parsed: ParsedOutput, finish: str, stop: str | None, reason: str, sequence: str | None
) -> None:
    obj = message_object(
        head(), parsed, finish, stop_sequence=stop, input_tokens=3, output_tokens=4
    )
    message = Message.model_validate(obj)
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)
    assert message.usage.input_tokens == 3 and message.usage.output_tokens == 4
    if parsed.tool_calls:
        (block,) = message.content
        assert block.type == "tool_use" and block.input == {"a": 1} and block.id == "call_1"
    else:
        assert [b.text for b in message.content] == ["Hi"]


def test_tool_input_is_always_an_object() -> None:
    assert tool_input('{"a": [1]}') == {"a": [1]}
    assert tool_input("") == {}
    assert tool_input("[1, 2]") == {}
    assert tool_input("not json") == {}


_EVENT_CLASSES = {
    cls.model_fields["type"].annotation.__args__[0]: cls
    for cls in typing.get_args(typing.get_args(RawMessageStreamEvent)[0])
}


def replay(chunks: list[bytes]) -> tuple[list[str], Any]:
    """Each SSE event validated strictly, then accumulated as the SDK's ``messages.stream`` does."""
    snapshot, bufs, names = None, {}, []
    for chunk in chunks:
        name_line, data_line = chunk.decode().strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        names.append(data["type"])
        if data["type"] in ("ping", "error"):
            continue
        event = _EVENT_CLASSES[data["type"]].model_validate(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return names, snapshot


def test_stream_of_text_then_tool_call_is_accumulated_by_the_sdk() -> None:
    stream = MessagesStream(head())
    chunks = stream.start(input_tokens=7)
    chunks += stream.feed([ContentDelta("Let me "), ContentDelta("look.")])
    chunks += stream.feed([ToolCallDelta(0, "", id="call_5", name="get_weather")])
    chunks += stream.feed([ToolCallDelta(0, '{"city": '), ToolCallDelta(0, '"Paris"}')])
    chunks += stream.finish("tool_calls", stop_sequence=None, output_tokens=12)
    names, message = replay(chunks)
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text, call = message.content
    assert text.text == "Let me look."
    assert (call.id, call.name, call.input) == ("call_5", "get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 12)


def test_stream_stopped_by_a_sequence_and_a_failed_stream() -> None:
    stream = MessagesStream(head())
    chunks = stream.start(input_tokens=1) + stream.feed([ContentDelta("ab")])
    _, message = replay(chunks + stream.finish("stop", stop_sequence="END", output_tokens=3))
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    stream = MessagesStream(head())
    names, _ = replay(stream.start(input_tokens=1) + stream.fail(BackendUnavailable("down")))
    assert names[-1] == "error"
    error = json.loads(stream.fail(BackendUnavailable("down"))[0].decode().split("data: ")[1])
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "down"}}


def test_hosted_service_options_are_accepted() -> None:
    canonical = canonical_request(
        req(
            messages=[{"role": "user", "content": "Q"}],
            cache_control={"type": "ephemeral"},
            service_tier="auto",
            metadata={"user_id": "u"},
        )
    )
    assert canonical.input.messages == [{"role": "user", "content": "Q"}]
