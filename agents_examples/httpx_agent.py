"""A plain-HTTP agent: one ``POST /chat/completions`` with ``httpx``, no SDK.

Reward: 1.0 if the last integer in the reply equals the item's ``answer``,
else 0.0.

Item fields: ``question``, ``answer``; optional ``temperature`` (1.0),
``max_tokens`` (64), ``model``/``base_url``/``api_key`` (else ``OPENAI_*``).

Standalone: ``python -m proxima.agents_examples.httpx_agent --base-url URL --api-key K --model M``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from proxima.agents_examples.common import (
    cli_data,
    cli_parser,
    endpoint,
    is_correct,
    resolve_model,
    sampling,
)

DEFAULT_MAX_TOKENS = 64


async def ask(data: dict[str, Any]) -> str:
    """The model's reply to ``data["question"]``."""
    ep = endpoint(data)
    body = {
        "model": await resolve_model(ep),
        "messages": [{"role": "user", "content": str(data["question"])}],
        **sampling(data, max_tokens=DEFAULT_MAX_TOKENS),
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        resp = await client.post(
            f"{ep.base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {ep.api_key}"},
        )
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"] or ""


async def run_agent_return_reward(data: dict[str, Any]) -> float:
    """1.0 if the reply ends on the right number, else 0.0."""
    return 1.0 if is_correct(await ask(data), data["answer"]) else 0.0


def main(argv: list[str] | None = None) -> None:
    """Ask one question over plain HTTP and print the reply and reward."""
    args = cli_parser(main.__doc__ or "").parse_args(argv)
    data = cli_data(args)
    reply = asyncio.run(ask(data))
    print(
        json.dumps(
            {"reward": 1.0 if is_correct(reply, data["answer"]) else 0.0, "reply": reply}, indent=2
        )
    )


if __name__ == "__main__":
    main()
