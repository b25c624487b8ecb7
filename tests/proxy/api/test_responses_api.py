"""Responses API translation and builders, checked against the OpenAI SDK's own types.

Requests are translated to the canonical request by hand-written cases; built
responses and streamed events are validated strictly with the SDK's pydantic
models and replayed through the SDK's stream accumulator.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from proxima.proxy.errors import BackendUnavailable, BadRequest
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.surfaces.responses.events import (
    ResponseHead,
    ResponsesStream,
    response_object,
)
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.proxy.surfaces.responses.translate import (
    canonical_request,
    echoed_settings,
    input_messages,
)
from proxima.proxy.tools import ContentDelta, ParsedOutput, ToolCall, ToolCallDelta, ToolChoice

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def req(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **body})


# ------------------------------------------------------------------------ translation


def test_string_input_is_one_user_message_after_instructions() -> None:
    canonical = canonical_request(req(input="Hi", instructions="Be brief.", max_output_tokens=7))
    assert canonical.input.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert canonical.sampling.max_tokens == 7
    assert canonical.input.tools is None


def test_output_items_sent_back_become_one_assistant_turn() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me ", "annotations": []}]
            + [{"type": "output_text", "text": "check.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "two"}],
        },
        {"role": "developer", "content": "Now answer."},
    ]
    assert canonical_request(req(input=items)).input.messages == [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"x": 1}},
                },
                {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "one"},
        {"role": "tool", "tool_call_id": "call_b", "content": "two"},
        {"role": "system", "content": "Now answer."},
    ]


def test_previous_conversation_comes_first_and_instructions_replace_its_system() -> None:
    previous = [
        {"role": "system", "content": "old"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert input_messages(req(input="Q2"), previous) == [
        *previous,
        {"role": "user", "content": "Q2"},
    ]
    assert input_messages(req(input="Q2", instructions="new"), previous)[:2] == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "Q"},
    ]


def test_tools_tool_choice_and_text_format_translate_to_the_canonical_request() -> None:
    canonical = canonical_request(
        req(
            input="Q",
            tools=[WEATHER, {**WEATHER, "name": "other", "strict": True}],
            tool_choice={"type": "function", "name": "get_weather"},
            text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
            parallel_tool_calls=False,
            temperature=0.5,
            top_p=0.9,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
            store=False,
        )
    )
    chat = canonical.input
    assert isinstance(chat, ChatInput) and chat.tools is not None
    assert chat.tools[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER["description"],
            "parameters": WEATHER["parameters"],
        },
    }
    assert chat.tools[1]["function"]["strict"] is True
    assert chat.tool_choice == ToolChoice("function", "get_weather")
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    sampling = canonical.sampling
    assert (chat.parallel_tool_calls, sampling.temperature, sampling.top_p) == (False, 0.5, 0.9)
    assert (canonical.logprobs, canonical.top_logprobs) == (True, 2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Q", "tools": [{"type": "image_generation"}]}, "tools[0].type"),
        (
            {"input": "Q", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "x"}]}]},
            "tools[0].tools[0].type",
        ),
        (
            {"input": "Q", "tools": [{"type": "file_search", "vector_store_ids": []}]},
            "tools[0].type",
        ),
        ({"input": "Q", "tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
        ({"input": "Q", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": []}, "input"),
        ({"input": "Q", "background": True}, "background"),
        ({"input": "Q", "conversation": "conv_1"}, "conversation"),
        ({"input": "Q", "truncation": "auto"}, "truncation"),
        ({"input": "Q", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "Q", "reasoning": {"summary": "everything"}}, "reasoning.summary"),
        ({"input": "Q", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "Q", "n": 2}, "n"),
        ({"input": "Q", "seed": 1}, "seed"),
        ({"input": "Q", "moderation": {"model": "omni"}}, "moderation"),
    ],
)
def test_unsupported_requests_are_400s_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        canonical_request(req(**body))
    assert info.value.param == param
    assert info.value.status_code == 400


# --------------------------------------------------------------------------- builders


LOGPROB = {"token": "L", "logprob": -0.5, "bytes": [76], "top_logprobs": []}


def head(**body: Any) -> ResponseHead:
    return ResponseHead("resp_0123", 1700000000, "tiny", echoed_settings(req(input="Q", **body)))


def test_response_object_validates_as_the_sdk_response() -> None:
    parsed = ParsedOutput(
        content="Checking.", tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')]
    )
    obj = response_object(
        head(tools=[WEATHER]), parsed, "tool_calls", input_tokens=5, output_tokens=9
    )
    response = Response.model_validate(obj)
    assert response.status == "completed"
    assert response.output_text == "Checking."
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        "call_1",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert response.usage is not None and response.usage.total_tokens == 14


def test_cut_reply_is_incomplete_and_empty_reply_is_one_empty_message() -> None:
    cut = Response.model_validate(
        response_object(head(), ParsedOutput("abc", []), "length", input_tokens=1, output_tokens=3)
    )
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    empty = Response.model_validate(
        response_object(head(), ParsedOutput("", []), "stop", input_tokens=1, output_tokens=1)
    )
    assert [item.type for item in empty.output] == ["message"] and empty.output_text == ""


# The SDK's event class for each ``type``, to validate every event strictly against its own.
_EVENT_CLASSES = {
    cls.model_fields["type"].annotation.__args__[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def replay(chunks: list[bytes], tools: list[dict[str, Any]] | None = None) -> list[Any]:
    """Each SSE event validated strictly, then fed to the SDK's stream accumulator."""
    state = ResponseStreamState(input_tools=tools or [], text_format=omit)
    seen = []
    for chunk in chunks:
        name_line, data_line = chunk.decode().strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        _EVENT_CLASSES[data["type"]].model_validate(data)
        event = construct_type(type_=ResponseStreamEvent, value=data)  # type: ignore[arg-type]
        seen += state.handle_event(event)
    return seen


def test_stream_of_text_then_call_is_accumulated_by_the_sdk() -> None:
    stream = ResponsesStream(head(tools=[WEATHER]))
    chunks = stream.start()
    chunks += stream.feed([ContentDelta("Let me ")], logprobs=[LOGPROB])
    chunks += stream.feed([ContentDelta("look.")])
    chunks += stream.feed([ToolCallDelta(0, "", id="call_9", name="get_weather")])
    chunks += stream.feed([ToolCallDelta(0, '{"city": ')], [])
    chunks += stream.feed([ToolCallDelta(0, '"Paris"}')])
    chunks += stream.finish("tool_calls", input_tokens=4, output_tokens=20)
    events = replay(chunks, [WEATHER])
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "Let me look."
    assert final.output[0].content[0].logprobs[0].token == "L"
    call = final.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_9",
        "get_weather",
        {"city": "Paris"},
    )
    assert final.usage.output_tokens == 20


def test_stream_of_nothing_sends_one_empty_message_and_cut_stream_is_incomplete() -> None:
    stream = ResponsesStream(head())
    events = replay(stream.start() + stream.finish("stop", input_tokens=1, output_tokens=1))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ""
    stream = ResponsesStream(head())
    chunks = stream.start() + stream.feed([ContentDelta("ab")])
    events = replay(chunks + stream.finish("length", input_tokens=1, output_tokens=2))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"


def test_failed_stream_ends_with_an_error_event_and_a_failed_response() -> None:
    stream = ResponsesStream(head())
    chunks = stream.start() + stream.feed([ContentDelta("ab")])
    events = replay(chunks + stream.fail(BackendUnavailable("no backend")))
    assert events[-2].type == "error" and events[-2].message == "no backend"
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "no backend"
