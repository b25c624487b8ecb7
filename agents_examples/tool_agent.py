"""Tool-using agent: LangGraph loop over LangChain ``ChatOpenAI`` with a calculator.

The graph is the classic ReAct loop: the model (``bind_tools([calculator])``)
either calls the calculator, whose result goes back as a tool message, or
answers. The reward is 1.0 when the last integer of the final answer equals
the item's ``answer``, else 0.0. Running out of steps is a wrong answer, not
an error.

The calculator evaluates ``+ - * /`` and parentheses over numbers by walking
the expression's ``ast``: no names, calls, attributes or powers, so nothing
the model writes can run code or build huge numbers.

Item fields: ``question``, ``answer``; optional ``max_steps`` (4 model calls),
``temperature`` (1.0), ``max_tokens`` (128), ``model``/``base_url``/``api_key``.

Standalone: ``python -m proxima.agents_examples.tool_agent --base-url URL --api-key K --model M``.
The tool demo's agent (``tool_demo_agent``) shares its calculator, system prompt, ``ChatOpenAI``
set-up (``chat_openai``) and standalone run (``cli_main``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
from collections.abc import Callable, Coroutine
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from proxima.agents_examples.common import (
    cli_data,
    cli_parser,
    endpoint,
    is_correct,
    resolve_model,
    sampling,
)
from pydantic import SecretStr

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for any arithmetic, "
    "then state the final answer as a number."
)
DEFAULT_MAX_STEPS = 4
DEFAULT_MAX_TOKENS = 128
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be evaluated."""


def evaluate(expression: str) -> float:
    """Evaluate ``+ - * /`` arithmetic safely (see the module docstring)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc

    def walk(node: ast.AST) -> float:
        number = node.value if isinstance(node, ast.Constant) else None
        if isinstance(number, int | float) and not isinstance(number, bool):
            value: float = number
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise CalculatorError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](walk(node.operand))
        else:
            raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:60]}")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("number too large")
        return value

    return walk(tree.body)


def format_number(value: float) -> str:
    """Integers without a trailing ``.0``; other values rounded to 6 decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12 * (3 + 4)"."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


async def chat_openai(data: dict[str, Any], *, max_tokens: int) -> ChatOpenAI:
    """``ChatOpenAI`` on the run's endpoint and model (see ``proxima.agents_examples.common``),
    with the item's sampling (``max_tokens`` when the item sets none) and no retries."""
    ep = endpoint(data)
    return ChatOpenAI(
        model=await resolve_model(ep),
        base_url=ep.base_url,
        api_key=SecretStr(ep.api_key),
        max_retries=0,
        **sampling(data, max_tokens=max_tokens),
    )


def build_graph(llm: BaseChatModel) -> Any:
    """The ReAct graph: ``agent`` -> (``tools`` -> ``agent``)* -> end."""
    model = llm.bind_tools([calculator])

    async def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph.compile()


async def solve(
    data: dict[str, Any], llm: BaseChatModel | None = None
) -> tuple[float, list[BaseMessage]]:
    """Run the graph on one problem; returns the reward and the messages.

    ``llm`` defaults to ``ChatOpenAI`` on the run's endpoint (see ``proxima.agents_examples.common``).
    """
    if llm is None:
        llm = await chat_openai(data, max_tokens=DEFAULT_MAX_TOKENS)
    messages: list[BaseMessage] = [
        SystemMessage(SYSTEM_PROMPT),
        HumanMessage(str(data["question"])),
    ]
    # Each model call and each tool call is one graph step.
    limit = 2 * int(data.get("max_steps", DEFAULT_MAX_STEPS))
    try:
        state = await build_graph(llm).ainvoke({"messages": messages}, {"recursion_limit": limit})
    except GraphRecursionError:
        return 0.0, messages
    messages = state["messages"]
    final = messages[-1]
    answer = (
        final.content if isinstance(final, AIMessage) and isinstance(final.content, str) else ""
    )
    return (1.0 if is_correct(answer, data["answer"]) else 0.0), messages


async def run_agent_return_reward(data: dict[str, Any]) -> float:
    """1.0 if the final answer (after any calculator calls) is right, else 0.0."""
    reward, _ = await solve(data)
    return reward


def cli_main(
    description: str,
    argv: list[str] | None,
    run: Callable[[dict[str, Any]], Coroutine[Any, Any, tuple[Any, list[BaseMessage]]]],
    result_key: str,
) -> None:
    """A calculator agent's standalone run: one problem (384 * 27 unless ``argv`` names
    another) through ``run``; prints its result under ``result_key`` and the messages."""
    parser = cli_parser(description)
    parser.set_defaults(question="What is 384 * 27?", answer=384 * 27)
    args = parser.parse_args(argv)
    result, messages = asyncio.run(run(cli_data(args)))
    print(
        json.dumps(
            {result_key: result, "messages": [m.model_dump() for m in messages]},
            indent=2,
            default=str,
        )
    )


def main(argv: list[str] | None = None) -> None:
    """Solve one problem with the calculator agent and print the messages."""
    cli_main(main.__doc__ or "", argv, solve, "reward")


if __name__ == "__main__":
    main()
