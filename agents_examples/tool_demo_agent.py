"""The tool demo's agent (``make demo-tools``): an unmodified LangGraph ``create_react_agent``.

The agent is LangGraph's prebuilt ReAct agent over LangChain's ``ChatOpenAI`` and the
calculator tool of :mod:`proxima.agents_examples.tool_agent`, through the OpenAI tools API:
nothing in it knows about training. On the demo model (its chat template renders no tools) the
proxy runs with ``--tool-fallback hermes``: the tools go into the system prompt, the model's
``<tool_call>`` text comes back as ``tool_calls`` and the loop is one token-exact chain.

The task is a product of a 3-digit and a 2-digit number (difficulty ``tool``), which the demo
model cannot do unaided. The reward is 1.0 when the final answer's last integer is the
product, else 0.0 (running out of steps or a failed request is a wrong answer).

With ``report`` (evaluation) it returns a mapping:

- ``final``: the reward;
- ``first_try``: 1.0 when the answer is right and the first model turn's reply was a
  well-formed call (the calculator named, a string ``expression``), no retry needed;
- ``well_formed``: 1.0 when that first turn's reply was a well-formed call;
- ``turns``: the model turns the run took.

With ``first_tool_choice = "required"`` the first model turn is sent with ``tool_choice:
required`` and ``parallel_tool_calls: false`` (LangGraph's dynamic model: the model bound to
the calculator with them until a tool result is in the state, then with ``auto``): the proxy
decodes that turn under the tool-call grammar (exactly one call), so it is well-formed by
construction and the trainer recomputes its logprobs under the same mask; ``well_formed`` then
measures the grammar, not the model, and later turns are free. ``proxima train``'s
``[warm_start]`` runs it this way (``tools_demo.toml``) and learns the right runs' tokens.

Item fields: ``question``, ``answer``; optional ``max_steps`` (model calls, default 3),
``first_tool_choice`` (``auto``, the default, or ``required``),
``temperature``, ``max_tokens`` (64), ``seed``, ``model``/``base_url``/``api_key``.

Standalone: ``python -m proxima.agents_examples.tool_demo_agent --base-url URL --api-key K --model M``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import Runnable
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent
from proxima.agents_examples.common import is_correct
from proxima.agents_examples.tool_agent import SYSTEM_PROMPT, calculator, chat_openai, cli_main

DEFAULT_MAX_STEPS = 3
DEFAULT_MAX_TOKENS = 64


def well_formed(message: BaseMessage | None) -> bool:
    """``message`` is a model reply holding calls only to the calculator, each with a string
    ``expression``, and no call the parser could not read."""
    if not isinstance(message, AIMessage) or not message.tool_calls or message.invalid_tool_calls:
        return False
    return all(
        call["name"] == "calculator" and isinstance(call["args"].get("expression"), str)
        for call in message.tool_calls
    )


def score(messages: list[BaseMessage], answer: Any) -> dict[str, float]:
    """The run's report (see the module docstring) from its messages."""
    replies = [m for m in messages if isinstance(m, AIMessage)]
    final = replies[-1] if replies else None
    text = final.content if final is not None and isinstance(final.content, str) else ""
    right = bool(final is not None and not final.tool_calls and is_correct(text, answer))
    formed = well_formed(replies[0] if replies else None)
    return {
        "final": float(right),
        "first_try": float(right and formed),
        "well_formed": float(formed),
        "turns": float(len(replies)),
    }


def _first_turn_forced(llm: BaseChatModel) -> Callable[[Any, Any], Runnable[Any, BaseMessage]]:
    """A dynamic model: ``tool_choice: required`` until a tool result is in the state."""
    # One call (parallel_tool_calls false): the grammar ends the turn after it, so the turn is
    # never a run of repeated calls cut at max_tokens.
    forced = llm.bind_tools([calculator], tool_choice="required", parallel_tool_calls=False)
    free = llm.bind_tools([calculator])

    def select(state: Any, runtime: Any) -> Runnable[Any, BaseMessage]:
        seen = any(isinstance(m, ToolMessage) for m in state["messages"])
        return free if seen else forced

    return select


async def solve(data: dict[str, Any]) -> tuple[dict[str, float], list[BaseMessage]]:
    """Run the ReAct agent on one problem; returns its report and messages."""
    return await run_react(await chat_openai(data, max_tokens=DEFAULT_MAX_TOKENS), data)


async def run_react(
    llm: BaseChatModel, data: dict[str, Any]
) -> tuple[dict[str, float], list[BaseMessage]]:
    """The ReAct agent over ``llm`` on one problem: its report and every message it reached.

    A run that reaches ``max_steps`` model calls without a final answer (its last reply a tool
    call, the tool's result unanswered) scores 0 and no first try; its report still counts the
    turns it took and whether its first reply was a well-formed call.
    """
    agent = create_react_agent(
        _first_turn_forced(llm) if data.get("first_tool_choice") == "required" else llm,
        [calculator],
        prompt=SYSTEM_PROMPT,
    )
    messages: list[BaseMessage] = [HumanMessage(str(data["question"]))]
    # Each model call and each tool call is one graph step: max_steps model calls, the last
    # one answering or its calls run (then the limit stops the next model call).
    limit = 2 * int(data.get("max_steps", DEFAULT_MAX_STEPS))
    try:
        async for state in agent.astream(
            {"messages": messages}, {"recursion_limit": limit}, stream_mode="values"
        ):
            messages = list(state["messages"])  # the last state reached, kept past the limit
    except GraphRecursionError:
        report = score(messages, data["answer"])
        report.update(final=0.0, first_try=0.0)
        return report, messages
    return score(messages, data["answer"]), messages


async def run_agent_return_reward(data: dict[str, Any]) -> float | dict[str, float]:
    """1.0 if the final answer is the product, else 0.0; with ``report`` the whole report."""
    report, _ = await solve(data)
    return report if data.get("report") else report["final"]


def main(argv: list[str] | None = None) -> None:
    """Solve one product with the ReAct agent and print its report and messages."""
    cli_main(main.__doc__ or "", argv, solve, "report")


if __name__ == "__main__":
    main()
