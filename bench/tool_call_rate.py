"""Benchmark: how often the demo model writes a well-formed tool call through ``--tool-fallback``.

SmolLM2-135M-Instruct's chat template renders no tools, so ``proxima serve --tool-fallback
hermes`` writes them into the system prompt (``proxy/tools/fallback.py``). This script measures,
through a real ``proxima serve`` on the demo model, how often the model answers an arithmetic
question the calculator agent asks (``agents_examples/tool_agent.py``: its system prompt, its
``calculator`` tool) with a well-formed call, for the system-prompt section the proxy ships and
for the variants it was chosen against.

The task: ``N`` products of a 3-digit and a 2-digit number (``What is 347 * 28?``, fixed seed).
A reply is **well-formed** when the hermes parser reads at least one call from it, every call
names ``calculator`` and its arguments are a JSON object with a string ``expression``;
**right** when, moreover, the first call's expression evaluates to the product. Each variant
is measured greedily (temperature 0) and sampled (temperature 1, one seed per prompt, what
training sees).

The shipped section goes through the real path: the request carries ``tools`` and the proxy's
fallback writes the section. A variant is the same prompt built here: the system message holds
the agent's prompt, a blank line and the variant's section, and the request carries no tools, so
its tokens are what the fallback would render with that section (checked for the shipped one:
both paths give the same prompt tokens).

It prints one line per variant and temperature::

    shipped   T=0: well-formed 0/32 (0%), right 0/32 (0%)

Measured 2026-11-28 (commit f1e6665, n=32): 0/32 for every variant at both temperatures
(``docs/reference.md``).

Run: ``nice -n 19 .venv/bin/python bench/tool_call_rate.py`` (``-n 32``; ``--variants
shipped,plain``; ``--json FILE`` keeps the replies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402
from proxima.agents_examples.tool_agent import SYSTEM_PROMPT, CalculatorError, evaluate  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.tools import HermesToolParser  # noqa: E402
from proxima.proxy.tools.fallback import hermes_tools_text  # noqa: E402

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
# The calculator tool as LangChain's ``bind_tools`` sends ``tool_agent.calculator``.
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            'Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12 * (3 + 4)".'
        ),
        "parameters": {
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "type": "object",
        },
    },
}
MAX_TOKENS = 48  # a call of the calculator is about 35 tokens
CONCURRENCY = 8


def _signatures(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


def plain_section(tools: Sequence[dict[str, Any]]) -> str:
    """The section before the worked example: signatures and the call's shape in words."""
    return (
        "# Tools\n\n"
        "You may call one or more functions. Their signatures are within <tools></tools>:\n"
        f"<tools>\n{_signatures(tools)}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        "within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def dialogue_section(tools: Sequence[dict[str, Any]]) -> str:
    """Signatures, then a whole exchange with a made-up tool: call, result, answer."""
    return (
        "# Tools\n\n"
        "You can call these functions; their signatures are within <tools></tools>:\n"
        f"<tools>\n{_signatures(tools)}\n</tools>\n\n"
        "Example with a function get_weather(city):\n"
        "user: What is the weather in Paris?\n"
        'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\n"
        'user: <tool_response>\n{"temperature": 21}\n</tool_response>\n'
        "assistant: It is 21 degrees in Paris."
    )


VARIANTS: dict[str, Callable[[Sequence[dict[str, Any]]], str]] = {
    "shipped": hermes_tools_text,
    "plain": plain_section,
    "dialogue": dialogue_section,
}


def problems(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(n)]


def judge(text: str, a: int, b: int) -> tuple[bool, bool]:
    """(well-formed, right) for one reply (see the module docstring)."""
    calls = HermesToolParser().parse(text).tool_calls
    if not calls:
        return False, False
    expressions: list[str] = []
    for call in calls:
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            return False, False
        if call.name != "calculator" or not isinstance(args, dict):
            return False, False
        if not isinstance(args.get("expression"), str):
            return False, False
        expressions.append(args["expression"])
    try:
        right = evaluate(expressions[0]) == a * b
    except CalculatorError:
        right = False
    return True, right


async def ask(
    client: AsyncOpenAI, model: str, variant: str, a: int, b: int, temperature: float, seed: int
) -> str:
    question = {"role": "user", "content": f"What is {a} * {b}?"}
    kw: dict[str, Any] = dict(
        model=model, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed
    )
    if variant == "shipped":
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, question]
        reply = await client.chat.completions.create(messages=messages, tools=[CALCULATOR], **kw)
    else:
        system = f"{SYSTEM_PROMPT}\n\n{VARIANTS[variant]([CALCULATOR])}"
        messages = [{"role": "system", "content": system}, question]
        reply = await client.chat.completions.create(messages=messages, **kw)
    return str(reply.id)  # the store keeps the generated text whole


async def measure(
    proxy: LiveProxy, variant: str, temperature: float, pairs: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    session = proxy.new_session(group_id=f"{variant}-{temperature}")
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, a: int, b: int) -> str:
        async with gate:
            return await ask(client, proxy.model_name, variant, a, b, temperature, seed=i)

    ids = await asyncio.gather(*(one(i, a, b) for i, (a, b) in enumerate(pairs)))
    await client.close()
    stored = {c["id"]: c for c in proxy.trajectory(session["session_id"])["completions"]}
    rows = []
    for cid, (a, b) in zip(ids, pairs, strict=True):
        record = stored[cid]
        formed, right = judge(record["response_text"], a, b)
        rows.append(
            {
                "a": a,
                "b": b,
                "text": record["response_text"],
                "well_formed": formed,
                "right": right,
                "prompt_ids": record["prompt_ids"],
            }
        )
    return rows


def report(variant: str, temperature: float, rows: list[dict[str, Any]]) -> str:
    n = len(rows)
    formed = sum(r["well_formed"] for r in rows)
    right = sum(r["right"] for r in rows)
    return (
        f"{variant:<9} T={temperature:g}: well-formed {formed}/{n} ({100 * formed / n:.0f}%), "
        f"right {right}/{n} ({100 * right / n:.0f}%)"
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pairs = problems(args.n)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="tool-call-rate-"))
    proxy = LiveProxy(
        args.model,
        db_url=f"sqlite:///{work / 'store.db'}",
        extra_args=["--tool-fallback", "hermes", "--tool-parser", "hermes"],
        log_path=work / "serve.log",
    )
    proxy.start(timeout=900)  # a loaded machine takes minutes
    results: dict[str, Any] = {}
    try:
        for temperature in (0.0, 1.0):
            for variant in variants:
                rows = await measure(proxy, variant, temperature, pairs)
                results[f"{variant} T={temperature:g}"] = rows
                print(report(variant, temperature, rows), flush=True)
    finally:
        proxy.stop()
    _check_same_prompt(results)
    return results


def _check_same_prompt(results: dict[str, Any]) -> None:
    """The shipped section through ``tools`` and the same text sent by hand: same tokens."""
    through_tools = results.get("shipped T=0")
    if through_tools is None:
        return
    by_hand = _shipped_by_hand_prompt(through_tools)
    if by_hand is not None and by_hand != through_tools[0]["prompt_ids"]:
        raise SystemExit(
            "the shipped section sent by hand renders other tokens than --tool-fallback"
        )


def _shipped_by_hand_prompt(rows: list[dict[str, Any]]) -> list[int] | None:
    from proxima.proxy.rendering.chat_template import ChatRenderer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    system = f"{SYSTEM_PROMPT}\n\n{hermes_tools_text([CALCULATOR])}"
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"What is {rows[0]['a']} * {rows[0]['b']}?"},
    ]
    renderer = ChatRenderer(tokenizer)
    return renderer.encode(renderer.render_text(messages, None, add_generation_prompt=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=32, help="prompts per variant (32)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--json", type=Path, help="write every reply here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.json:
        slim = {k: [{**r, "prompt_ids": None} for r in rows] for k, rows in results.items()}
        args.json.write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
