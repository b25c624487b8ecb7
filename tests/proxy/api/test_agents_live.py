"""Unmodified agents (OpenAI SDK sync/async, streaming or not, LangChain) against a live proxy.

Each runs the scripted 3-turn conversation with a tool call on the taught tiny
model, then the stored trajectory is checked token by token.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI
from proxima.proxy.testing.live import LiveProxy
from transformers import AutoTokenizer

from tests.proxy.scripts import (
    ANSWER,
    CALL_TEXT,
    QUESTION,
    THANKS,
    TOOL_RESULT,
    TOOLS,
    WEATHER_TOOL,
    WELCOME,
)


def check_trajectory(
    proxy: LiveProxy, session_id: str, returned: list[str]
) -> list[dict[str, Any]]:
    """The stored completions are exact: text, logprobs, versions, token-exact turns."""
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    completions = proxy.trajectory(session_id)["completions"]
    assert len(completions) == len(returned)
    for c, text in zip(completions, returned, strict=True):
        decoded = tokenizer.decode(c["output_ids"], skip_special_tokens=True)
        assert decoded == c["response_text"] == text
        assert len(c["output_logprobs"]) == len(c["output_ids"]) == len(c["output_versions"]) > 0
        assert all(lp <= 0.0 for lp in c["output_logprobs"])
        assert c["output_ids"][-1] == tokenizer.eos_token_id  # stopped on its own, end token kept
    for prev, nxt in zip(completions, completions[1:], strict=False):
        exact = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][: len(exact)] == exact
        assert nxt["parent_id"] == prev["id"]
    return completions


def _assistant(message: Any) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


def test_openai_sync_non_streaming(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="sync")
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw = dict(model=live_proxy.model_name, tools=TOOLS, temperature=0, max_tokens=80)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    r1 = client.chat.completions.create(messages=messages, **kw)
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r1.id.startswith("chatcmpl-")

    messages += [
        _assistant(r1.choices[0].message),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    r2 = client.chat.completions.create(messages=messages, **kw)
    assert r2.choices[0].message.content == ANSWER
    assert r2.choices[0].finish_reason == "stop"

    messages += [_assistant(r2.choices[0].message), {"role": "user", "content": THANKS}]
    r3 = client.chat.completions.create(messages=messages, **kw)
    assert r3.choices[0].message.content == WELCOME
    assert r3.usage.completion_tokens == len(WELCOME.encode()) + 1

    check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])


async def _stream_turn(
    client: AsyncOpenAI, model: str, messages: list[dict[str, Any]]
) -> tuple[dict[str, Any], str]:
    """One streamed turn, reassembled into an assistant message the way SDK users do."""
    content, calls, finish = "", {}, None
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=80, stream=True
    )
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return message, finish


async def test_openai_async_streaming(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session(group_id="async")
    client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    m1, f1 = await _stream_turn(client, live_proxy.model_name, messages)
    assert f1 == "tool_calls"
    assert m1["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(m1["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    messages += [
        m1,
        {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": TOOL_RESULT},
    ]
    m2, f2 = await _stream_turn(client, live_proxy.model_name, messages)
    assert (m2["content"], f2) == (ANSWER, "stop")
    messages += [m2, {"role": "user", "content": THANKS}]
    m3, _ = await _stream_turn(client, live_proxy.model_name, messages)
    assert m3["content"] == WELCOME
    check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])
    await client.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
def test_langchain_bind_tools(live_proxy: LiveProxy, streaming: bool) -> None:
    s = live_proxy.new_session(group_id="langchain")
    llm = ChatOpenAI(
        model=live_proxy.model_name,
        base_url=s["base_url"],
        api_key=s["api_key"],
        temperature=0,
        max_tokens=80,
        streaming=streaming,
    ).bind_tools([WEATHER_TOOL])
    messages: list[Any] = [HumanMessage(QUESTION)]
    ai1 = llm.invoke(messages)
    assert ai1.tool_calls[0]["name"] == "get_weather"
    assert ai1.tool_calls[0]["args"] == {"city": "Paris"}
    messages += [ai1, ToolMessage(content=TOOL_RESULT, tool_call_id=ai1.tool_calls[0]["id"])]
    ai2 = llm.invoke(messages)
    assert ai2.content == ANSWER
    messages += [ai2, HumanMessage(THANKS)]
    ai3 = llm.invoke(messages)
    assert ai3.content == WELCOME
    check_trajectory(live_proxy, s["session_id"], [CALL_TEXT, ANSWER, WELCOME])


def test_edited_history_starts_a_branch(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    kw = dict(model=live_proxy.model_name, tools=TOOLS, temperature=0, max_tokens=80)
    first = [{"role": "user", "content": QUESTION}]
    r1 = client.chat.completions.create(messages=first, **kw)
    # The agent rewrites history (e.g. compaction): no earlier completion is extended.
    edited = [
        {"role": "user", "content": "Tell me: " + QUESTION},
        _assistant(r1.choices[0].message),
        {"role": "user", "content": THANKS},
    ]
    client.chat.completions.create(messages=edited, **kw)
    c1, c2 = live_proxy.trajectory(s["session_id"])["completions"]
    assert c1["parent_id"] is None and c2["parent_id"] is None
