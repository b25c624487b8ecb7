"""A tool loop on the demo model through ``--tool-fallback hermes`` is one token-exact chain.

SmolLM2-135M-Instruct's chat template renders no tools; ``proxima serve --tool-fallback
hermes`` writes them into the system prompt, the model's earlier calls as it generated them and
the results as ``<tool_response>`` blocks in a user turn (``proxy/tools/fallback.py``). Here
unmodified framework agents run a calculator loop against a real ``proxima serve`` on SmolLM2,
one per tool surface: the OpenAI Agents SDK (Responses), LangGraph's ``create_react_agent``
(Chat Completions) and the Anthropic SDK (Messages). Decoding is greedy. Zero-shot the demo
model rarely writes a call (``bench/tool_call_rate.py``), so each agent asks for one on its first
turn (``tool_choice`` required, Anthropic's ``any``: a grammar-constrained call in the fallback's
format); the later turns are free, whatever the model writes, and the loop is bounded. The stored session must be one chain: every turn's
prompt starts with its parent's prompt and output tokens, each completion's parent is the turn
before, and a turn with a tool call is among them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent
from openai import AsyncOpenAI
from proxima.proxy.testing.live import LiveProxy
from proxima.trainer.pipeline.demo_model import prepare_smollm2
from pydantic import SecretStr

CACHE = Path(__file__).resolve().parents[3] / ".cache"
QUESTION = "What is 347 * 28?"
INSTRUCTIONS = "Use the calculator for arithmetic, then state the result."
DESCRIPTION = "Evaluate an arithmetic expression with + - * / and parentheses."
PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
MAX_TOKENS = 64  # a call of the calculator is about 35 tokens
FALLBACK = "hermes (--tool-fallback)"


def calculate(expression: str) -> str:
    """What the calculator answers: the product, or an error the model reads."""
    try:
        left, right = (int(part) for part in expression.split("*"))
    except ValueError:
        return "error: not a product of two integers"
    return str(left * right)


@pytest.fixture(scope="module")
def smollm2_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    model = prepare_smollm2(CACHE / "models")  # converted once per checkout
    work = tmp_path_factory.mktemp("fallback")
    proxy = LiveProxy(
        model,
        db_url=f"sqlite:///{work / 'store.db'}",
        extra_args=["--tool-fallback", "hermes", "--tool-parser", "hermes"],
        log_path=work / "serve.log",
    )
    proxy.start()
    yield proxy
    proxy.stop()
    if proxy.log_path and proxy.log_path.exists() and "Traceback" in proxy.log_path.read_text():
        shutil.copy(proxy.log_path, work / "serve-with-traceback.log")


def assert_one_chain(proxy: LiveProxy, session_id: str, tool_runs: list[str]) -> None:
    """The session's completions are one token-exact chain holding a tool call."""
    completions = proxy.trajectory(session_id)["completions"]
    replies = [(c["finish_reason"], c["response_text"]) for c in completions]
    assert len(completions) >= 2, replies
    assert completions[0]["parent_id"] is None
    for prev, nxt in itertools.pairwise(completions):
        exact = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][: len(exact)] == exact
        assert len(nxt["prompt_ids"]) > len(exact)
        assert nxt["parent_id"] == prev["id"]
    called = [c for c in completions if (c["response_message"] or {}).get("tool_calls")]
    assert called and called[0] is completions[0]
    call = called[0]["response_message"]["tool_calls"][0]["function"]
    assert call["name"] == "calculator"
    assert tool_runs and tool_runs[0] == json.loads(call["arguments"])["expression"]
    assert all(c["sampling"].get("tool_format") == FALLBACK for c in completions)


async def test_agents_sdk_tool_loop_is_one_chain(smollm2_proxy: LiveProxy) -> None:
    set_tracing_disabled(True)
    s = smollm2_proxy.new_session(group_id="fallback-agents-sdk")
    client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    runs: list[str] = []

    async def invoke(_: Any, arguments: str) -> str:
        runs.append(json.loads(arguments)["expression"])
        return calculate(runs[-1])

    agent = Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        model=OpenAIResponsesModel(model=smollm2_proxy.model_name, openai_client=client),
        tools=[
            FunctionTool(
                name="calculator",
                description=DESCRIPTION,
                params_json_schema=PARAMETERS,
                on_invoke_tool=invoke,
                strict_json_schema=False,
            )
        ],
        # A call first; after a tool ran the SDK resets tool_choice to auto.
        model_settings=ModelSettings(
            temperature=0, max_tokens=MAX_TOKENS, tool_choice="required", parallel_tool_calls=False
        ),
        reset_tool_choice=True,
    )
    # The model kept calling, or a free turn ran past max_tokens (the SDK raises on an
    # incomplete response): the turns it took are recorded, and still one chain.
    with contextlib.suppress(MaxTurnsExceeded, ModelBehaviorError):
        await Runner.run(agent, QUESTION, max_turns=3)
    await client.close()
    assert_one_chain(smollm2_proxy, s["session_id"], runs)


async def test_langgraph_react_agent_tool_loop_is_one_chain(smollm2_proxy: LiveProxy) -> None:
    s = smollm2_proxy.new_session(group_id="fallback-langgraph")
    runs: list[str] = []

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        runs.append(expression)
        return calculate(expression)

    llm = ChatOpenAI(
        model=smollm2_proxy.model_name,
        base_url=s["base_url"],
        api_key=SecretStr(s["api_key"]),
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        max_retries=0,
    )
    forced = llm.bind_tools([calculator], tool_choice="required", parallel_tool_calls=False)
    free = llm.bind_tools([calculator])

    def model(state: dict[str, Any], _: Any) -> Any:
        """A call first; once a tool answered, the model's own choice."""
        return free if any(isinstance(m, ToolMessage) for m in state["messages"]) else forced

    graph = create_react_agent(model, [calculator], prompt=INSTRUCTIONS)
    # Three model calls at most: agent, tools, agent, tools, agent.
    with contextlib.suppress(GraphRecursionError):
        await graph.ainvoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 5})
    assert_one_chain(smollm2_proxy, s["session_id"], runs)


def test_anthropic_sdk_tool_loop_is_one_chain(smollm2_proxy: LiveProxy) -> None:
    s = smollm2_proxy.new_session(group_id="fallback-anthropic")
    client = anthropic.Anthropic(
        base_url=s["base_url"].removesuffix("/v1"), api_key=s["api_key"], max_retries=0
    )
    tools: list[Any] = [
        {"name": "calculator", "description": DESCRIPTION, "input_schema": PARAMETERS}
    ]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    runs: list[str] = []
    for turn in range(3):
        choice: Any = {"type": "any"} if turn == 0 else {"type": "auto"}
        reply = client.messages.create(
            model=smollm2_proxy.model_name,
            system=INSTRUCTIONS,
            messages=messages,
            tools=tools,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
        )
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        results = []
        for use in uses:
            runs.append(str(dict(use.input).get("expression", "")))
            results.append(
                {"type": "tool_result", "tool_use_id": use.id, "content": calculate(runs[-1])}
            )
        messages.append({"role": "user", "content": results})
    client.close()
    assert_one_chain(smollm2_proxy, s["session_id"], runs)
