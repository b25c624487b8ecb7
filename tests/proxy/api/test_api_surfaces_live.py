"""The Responses and Messages APIs against a live proxy, driven by the real SDKs.

The OpenAI SDK (``responses.create``, streamed and not, and its ``stream``
helper), the OpenAI Agents SDK's default Responses model, the Anthropic SDK
(``messages.create`` and ``messages.stream``) and LangChain's ``ChatAnthropic``
run the scripted tool conversation on the taught tiny model. Each stored
trajectory is checked token by token: exact decode, one logprob and one
version per token, and every turn's prompt is the previous turn's exact
prompt + output + the new tokens, whichever API each turn came through.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import jsonschema
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, ToolMessage
from openai import AsyncOpenAI, OpenAI
from proxima.proxy.testing.live import LiveProxy
from pydantic import BaseModel

from tests.proxy.api.test_agents_live import check_trajectory
from tests.proxy.scripts import (
    ANSWER,
    CALL_TEXT,
    QUESTION,
    THANKS,
    TOOL_RESULT,
    WEATHER_TOOL,
    WELCOME,
)

FUNCTION = WEATHER_TOOL["function"]
# The same tool in each API's shape: it renders to the same template tokens.
RESPONSES_TOOL = {"type": "function", **FUNCTION}
ANTHROPIC_TOOL = {
    "name": FUNCTION["name"],
    "description": FUNCTION["description"],
    "input_schema": FUNCTION["parameters"],
}
GREEDY = {"temperature": 0}


def root_url(proxy: LiveProxy, session: dict[str, Any]) -> str:
    """Anthropic clients append ``/v1/messages`` themselves: the session's base_url minus ``/v1``."""
    assert session["base_url"].endswith("/v1")
    return session["base_url"].removesuffix("/v1")


def _items(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def _call(response: Any) -> Any:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    return calls[0]


# ------------------------------------------------------------------------ Responses


def test_openai_responses_tool_round_trip(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="responses")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw: dict[str, Any] = dict(
        model=live_proxy.model_name, tools=[RESPONSES_TOOL], max_output_tokens=80, **GREEDY
    )
    history: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    r1 = client.responses.create(input=history, **kw)
    assert r1.id.startswith("resp_") and r1.status == "completed"
    call = _call(r1)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})

    # Turn 2 sends turn 1's output items back, with the tool's output.
    history += _items(r1) + [
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    ]
    r2 = client.responses.create(input=history, **kw)
    assert r2.output_text == ANSWER
    history += _items(r2) + [{"role": "user", "content": THANKS}]
    r3 = client.responses.create(input=history, **kw)
    assert r3.output_text == WELCOME
    assert r3.usage is not None and r3.usage.output_tokens == len(WELCOME.encode()) + 1
    completions = check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])
    assert [c["id"] for c in completions] == [r1.id, r2.id, r3.id]


def test_openai_responses_streamed_and_previous_response_id(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="responses-stream")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw: dict[str, Any] = dict(
        model=live_proxy.model_name, tools=[RESPONSES_TOOL], max_output_tokens=80, **GREEDY
    )
    events = list(client.responses.create(input=QUESTION, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    r1 = events[-1].response
    call = _call(r1)

    # Turn 2 continues turn 1 by id and sends only the tool's output, through the helper.
    with client.responses.stream(
        include=["message.output_text.logprobs"],
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}],
        **kw,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        r2 = stream.get_final_response()
    assert "".join(deltas) == r2.output_text == ANSWER
    r2_logprobs = r2.output[0].content[0].logprobs
    assert r2.usage is not None and len(r2_logprobs) == r2.usage.output_tokens  # end token too
    r3 = client.responses.create(
        previous_response_id=r2.id,
        input=[{"role": "user", "content": THANKS}],
        include=["message.output_text.logprobs"],
        **kw,
    )
    assert r3.output_text == WELCOME
    completions = check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])
    # The reported logprobs are the recorded ones, which the trainer uses.
    assert [lp.logprob for lp in r2_logprobs] == completions[1]["output_logprobs"]
    r3_logprobs = r3.output[0].content[0].logprobs
    assert [lp.logprob for lp in r3_logprobs] == completions[2]["output_logprobs"]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_runs_a_function_tool_agent(live_proxy: LiveProxy, streamed: bool) -> None:
    set_tracing_disabled(True)
    s = live_proxy.new_session(group_id="agents-sdk")
    client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"])
    cities: list[str] = []

    async def get_weather(_: Any, arguments: str) -> str:
        cities.append(json.loads(arguments)["city"])
        return TOOL_RESULT

    tool = FunctionTool(
        name=FUNCTION["name"],
        description=FUNCTION["description"],
        params_json_schema=FUNCTION["parameters"],
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )
    agent = Agent(
        name="weather",
        model=OpenAIResponsesModel(model=live_proxy.model_name, openai_client=client),
        tools=[tool],
        model_settings=ModelSettings(temperature=0, max_tokens=80),
    )
    if streamed:
        result = Runner.run_streamed(agent, QUESTION)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds  # the Responses events, as they arrived
    else:
        result = await Runner.run(agent, QUESTION)
    assert cities == ["Paris"]
    assert result.final_output == ANSWER
    completions = check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER])
    assert all(c["id"].startswith("resp_") for c in completions)  # served by /v1/responses
    await client.close()


# ------------------------------------------------------------------------- Messages


def _assistant_blocks(message: Any) -> list[dict[str, Any]]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def test_anthropic_messages_create_and_stream(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="anthropic")
    client = anthropic.Anthropic(base_url=root_url(live_proxy, s), api_key=s["api_key"])
    kw: dict[str, Any] = dict(
        model=live_proxy.model_name, max_tokens=80, tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    m1 = client.messages.create(messages=messages, **kw)
    assert m1.id.startswith("msg_") and m1.stop_reason == "tool_use"
    (use,) = m1.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})

    messages += [
        {"role": "assistant", "content": _assistant_blocks(m1)},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}],
        },
    ]
    with client.messages.stream(messages=messages, **kw) as stream:
        text = "".join(stream.text_stream)
        m2 = stream.get_final_message()
    assert text == m2.content[0].text == ANSWER
    assert m2.stop_reason == "end_turn"
    messages += [
        {"role": "assistant", "content": _assistant_blocks(m2)},
        {"role": "user", "content": THANKS},
    ]
    m3 = client.messages.create(messages=messages, **kw)
    assert [b.text for b in m3.content] == [WELCOME]
    assert m3.usage.output_tokens == len(WELCOME.encode()) + 1
    completions = check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])
    assert [c["id"] for c in completions] == [m1.id, m2.id, m3.id]
    counted = client.messages.count_tokens(
        model=live_proxy.model_name, messages=messages[:1], tools=[ANTHROPIC_TOOL]
    )
    assert counted.input_tokens == m1.usage.input_tokens == len(completions[0]["prompt_ids"])


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_anthropic(live_proxy: LiveProxy, streaming: bool) -> None:
    s = live_proxy.new_session(group_id="langchain-anthropic")
    llm = ChatAnthropic(
        model=live_proxy.model_name,
        base_url=root_url(live_proxy, s),
        api_key=s["api_key"],
        temperature=0,
        max_tokens=80,
        streaming=streaming,
    ).bind_tools([WEATHER_TOOL])
    messages: list[Any] = [HumanMessage(QUESTION)]
    ai1 = llm.invoke(messages)
    assert [(c["name"], c["args"]) for c in ai1.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [ai1, ToolMessage(content=TOOL_RESULT, tool_call_id=ai1.tool_calls[0]["id"])]
    ai2 = llm.invoke(messages)
    assert ai2.text == ANSWER
    completions = check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER])
    assert all(c["id"].startswith("msg_") for c in completions)  # served by /v1/messages
    assert all(c["sampling"]["temperature"] == 0 for c in completions)


def test_one_session_mixes_the_three_apis(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="mixed")
    chat = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    claude = anthropic.Anthropic(base_url=root_url(live_proxy, s), api_key=s["api_key"])
    model = live_proxy.model_name
    c1 = chat.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER_TOOL],
        max_tokens=80,
        **GREEDY,
    )
    call = c1.choices[0].message.tool_calls[0]
    m2 = claude.messages.create(
        model=model,
        max_tokens=80,
        tools=[ANTHROPIC_TOOL],
        extra_body=GREEDY,
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": call.id, "name": call.function.name}
                    | {"input": json.loads(call.function.arguments)}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": TOOL_RESULT}
                ],
            },
        ],
    )
    assert m2.content[0].text == ANSWER
    r3 = chat.responses.create(
        model=model,
        tools=[RESPONSES_TOOL],
        max_output_tokens=80,
        **GREEDY,
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.id, "name": call.function.name}
            | {"arguments": call.function.arguments},
            {"type": "function_call_output", "call_id": call.id, "output": TOOL_RESULT},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": THANKS},
        ],
    )
    assert r3.output_text == WELCOME
    check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])


def test_cut_and_stopped_replies(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="stops")
    model = live_proxy.model_name
    claude = anthropic.Anthropic(base_url=root_url(live_proxy, s), api_key=s["api_key"])
    turn2 = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": TOOL_RESULT}],
        },
    ]
    kw: dict[str, Any] = dict(model=model, tools=[ANTHROPIC_TOOL], extra_body=GREEDY)
    stopped = claude.messages.create(messages=turn2, max_tokens=80, stop_sequences=["sunny"], **kw)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "sunny")
    assert [b.text for b in stopped.content] == [ANSWER.split("sunny")[0]]
    with claude.messages.stream(messages=turn2, max_tokens=3, **kw) as stream:
        cut = stream.get_final_message()
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3

    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    short = client.responses.create(model=model, input=QUESTION, max_output_tokens=3, **GREEDY)
    assert short.status == "incomplete"
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage is not None and short.usage.output_tokens == 3
    stored = live_proxy.trajectory(s["session_id"])["completions"]
    assert [c["finish_reason"] for c in stored] == ["stop", "length", "length"]


# ------------------------------------------ structured output and forced tool choice


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    degrees: int


TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "seconds": {"type": "boolean"}},
    "required": ["zone", "seconds"],
    "additionalProperties": False,
}


def test_responses_parse_helper_and_required_tool_choice(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="responses-structured")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    model = live_proxy.model_name
    parsed = client.responses.parse(
        model=model,
        input="Forecast for Paris as JSON.",
        text_format=Forecast,
        max_output_tokens=300,
    )
    assert isinstance(parsed.output_parsed, Forecast)
    assert Forecast.model_validate_json(parsed.output_text) == parsed.output_parsed
    events = list(
        client.responses.create(
            model=model,
            input="Hello there.",  # no reason to call a tool
            tools=[
                RESPONSES_TOOL,
                {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA},
            ],
            tool_choice={"type": "function", "name": "get_time"},
            max_output_tokens=300,
            stream=True,
        )
    )
    call = _call(events[-1].response)
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME_SCHEMA)
    stored = live_proxy.trajectory(s["session_id"])["completions"]
    assert [c["sampling"]["logit_transforms"] for c in stored] == [
        ["grammar:json_schema"],
        ["grammar:structural_tag"],
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_any_and_tool_choice_are_enforced(live_proxy: LiveProxy, stream: bool) -> None:
    s = live_proxy.new_session(group_id="anthropic-forced")
    client = anthropic.Anthropic(base_url=root_url(live_proxy, s), api_key=s["api_key"])
    time_tool = {"name": "get_time", "description": "The time.", "input_schema": TIME_SCHEMA}
    kw: dict[str, Any] = dict(
        model=live_proxy.model_name,
        max_tokens=300,
        messages=[{"role": "user", "content": QUESTION}],  # the taught model calls get_weather
        tools=[ANTHROPIC_TOOL, time_tool],
    )
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        if stream:
            with client.messages.stream(tool_choice=choice, **kw) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(tool_choice=choice, **kw)
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses and all(u.name in ("get_weather", "get_time") for u in uses)
        if choice["type"] == "tool":
            assert [u.name for u in uses] == ["get_time"]
            jsonschema.validate(uses[0].input, TIME_SCHEMA)
    structured = client.messages.create(
        model=live_proxy.model_name,
        max_tokens=300,
        messages=[{"role": "user", "content": "Forecast for Paris as JSON."}],
        extra_body={
            "output_config": {
                "format": {"type": "json_schema", "schema": Forecast.model_json_schema()}
            }
        },
    )
    Forecast.model_validate_json(structured.content[0].text)
