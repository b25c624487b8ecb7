"""The prompt is the chat template applied to the request the client sent.

Every recorded ``prompt_ids`` must equal ``tokenizer.apply_chat_template`` of
that request's own messages and tools, as they went over the wire. Tools are
written by the template with ``tojson``, which keeps key order, so the same
function declared by hand (OpenAI SDK: ``type, properties, required``) and by
LangChain's ``@tool`` (``properties, required, type``) are two prompts, and
neither may be served or recorded with the other's text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from proxima.proxy.rendering.chat_messages import normalize_messages
from proxima.proxy.testing.live import LiveProxy
from transformers import AutoTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
]
HAND_WRITTEN = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"Sunny in {city}"


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("render-proxy")
    live = LiveProxy(
        tiny_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class Wire:
    """An httpx client that keeps the JSON body of every request it sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.client = httpx.Client(event_hooks={"request": [self._keep]}, timeout=120)

    def _keep(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))


def _template_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """What the template makes of this request (messages in the proxy's canonical form)."""
    return list(
        tokenizer.apply_chat_template(
            normalize_messages(body["messages"]),
            tools=body.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
        )
    )


def _recorded_prompt(proxy: LiveProxy, session_id: str, index: int = -1) -> list[int]:
    return proxy.trajectory(session_id)["completions"][index]["prompt_ids"]


def _sdk_turn(proxy: LiveProxy, wire: Wire, messages: list[dict[str, Any]]) -> dict[str, Any]:
    session = proxy.new_session()
    client = OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], http_client=wire.client
    )
    client.chat.completions.create(
        model=proxy.model_name,
        messages=messages,
        tools=HAND_WRITTEN,
        max_tokens=2,  # type: ignore[arg-type]
    )
    return session


def _langchain_turn(proxy: LiveProxy, wire: Wire) -> dict[str, Any]:
    session = proxy.new_session()
    llm = ChatOpenAI(
        base_url=session["base_url"],
        api_key=session["api_key"],
        model=proxy.model_name,
        max_tokens=2,
        http_client=wire.client,
    )
    llm.bind_tools([get_weather]).invoke(
        [("system", MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])]
    )
    return session


def test_tools_in_another_key_order_are_their_own_prompt(proxy: LiveProxy, tokenizer: Any) -> None:
    wire = Wire()
    first = _sdk_turn(proxy, wire, MESSAGES)
    second = _langchain_turn(proxy, wire)
    third = _sdk_turn(proxy, wire, MESSAGES)
    sdk_tools, langchain_tools = wire.bodies[0]["tools"], wire.bodies[1]["tools"]
    # The same function, declared in two key orders: two different prompts.
    assert list(langchain_tools[0]["function"]["parameters"]) != list(
        sdk_tools[0]["function"]["parameters"]
    )
    assert _template_ids(tokenizer, wire.bodies[0]) != _template_ids(tokenizer, wire.bodies[1])
    for session, body in zip((first, second, third), wire.bodies, strict=True):
        assert _recorded_prompt(proxy, session["session_id"]) == _template_ids(tokenizer, body)


def test_tools_reordered_between_turns_render_fresh(proxy: LiveProxy, tokenizer: Any) -> None:
    """A follow-up whose tools differ only in key order must not reuse the first turn's text."""
    wire = Wire()
    session = _sdk_turn(proxy, wire, MESSAGES)
    first = proxy.trajectory(session["session_id"])["completions"][0]
    reordered = [
        {
            "function": {
                "parameters": {
                    "required": ["city"],
                    "properties": {"city": {"type": "string"}},
                    "type": "object",
                },
                "description": "Current weather of a city.",
                "name": "get_weather",
            },
            "type": "function",
        }
    ]
    follow_up = {
        "model": proxy.model_name,
        "max_tokens": 2,
        "tools": reordered,
        "messages": [
            *MESSAGES,
            first["response_message"],
            {"role": "user", "content": "And in Rome?"},
        ],
    }
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=follow_up,
        headers={"Authorization": f"Bearer {session['api_key']}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    second = proxy.trajectory(session["session_id"])["completions"][1]
    assert second["parent_id"] is None  # not extended from a prompt rendered with other tools
    assert second["prompt_ids"] == _template_ids(tokenizer, follow_up)


def test_same_messages_through_chat_and_completions(proxy: LiveProxy, tokenizer: Any) -> None:
    wire = Wire()
    chat = _sdk_turn(proxy, wire, MESSAGES)
    expected = _template_ids(tokenizer, wire.bodies[0])
    text = tokenizer.apply_chat_template(
        MESSAGES, tools=HAND_WRITTEN, add_generation_prompt=True, tokenize=False
    )
    session = proxy.new_session()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    client.completions.create(model=proxy.model_name, prompt=text, max_tokens=2)
    client.completions.create(model=proxy.model_name, prompt=expected, max_tokens=2)
    assert _recorded_prompt(proxy, chat["session_id"]) == expected
    assert _recorded_prompt(proxy, session["session_id"], 0) == expected
    assert _recorded_prompt(proxy, session["session_id"], 1) == expected


@pytest.mark.parametrize(
    "prompt",
    [
        [],
        ["a", "b"],  # a batch: one prompt per request
        [[1], [2]],
        [1, "a"],
        [True, False],  # booleans are not token ids
        [10**9],  # out of the vocabulary
        [[]],
        [-1],
    ],
)
def test_completion_prompts_that_cannot_be_served(proxy: LiveProxy, prompt: Any) -> None:
    r = httpx.post(
        proxy.base_url + "/completions",
        json={"model": proxy.model_name, "prompt": prompt, "max_tokens": 2},
        headers=proxy.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
