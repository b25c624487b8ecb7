"""Multi-turn math agent on the OpenAI SDK (``AsyncOpenAI``).

The agent asks the model the question; a checker reads the last integer of
the reply. A wrong answer gets the feedback "That is not correct, try
again." as a user turn and another try, up to ``max_turns`` turns. The reward
is 1.0 when the final answer is right, else 0.0; the trainer's per-turn
discount makes a right answer in fewer turns worth more.

Item fields: ``question``, ``answer`` (int); optional ``max_turns`` (3),
``temperature`` (1.0), ``max_tokens`` (96), ``system`` (a system prompt),
``seed`` (seeds every request: see ``common.sampling``),
``model``/``base_url``/``api_key`` (else ``OPENAI_*``).

Standalone: ``python -m proxima.agents_examples.math_agent --base-url URL --api-key K --model M``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from proxima.agents_examples.common import (
    cli_data,
    cli_parser,
    endpoint,
    is_correct,
    resolve_model,
    sampling,
)

FEEDBACK = "That is not correct, try again."
DEFAULT_MAX_TURNS = 3
DEFAULT_MAX_TOKENS = 96


async def solve(data: dict[str, Any]) -> tuple[float, list[ChatCompletionMessageParam]]:
    """Run the dialogue; returns the reward and the transcript."""
    ep = endpoint(data)
    client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    try:
        model = await resolve_model(ep)
        messages: list[ChatCompletionMessageParam] = []
        if data.get("system"):
            messages.append({"role": "system", "content": str(data["system"])})
        messages.append({"role": "user", "content": str(data["question"])})
        for turn in range(int(data.get("max_turns", DEFAULT_MAX_TURNS))):
            if turn:
                messages.append({"role": "user", "content": FEEDBACK})
            response = await client.chat.completions.create(
                model=model,
                messages=messages,
                **sampling(data, max_tokens=DEFAULT_MAX_TOKENS, turn=turn),
            )
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            if is_correct(reply, data["answer"]):
                return 1.0, messages
        return 0.0, messages
    finally:
        await client.close()


async def run_agent_return_reward(data: dict[str, Any]) -> float:
    """1.0 if the agent ends on the right answer within ``max_turns`` turns, else 0.0."""
    reward, _ = await solve(data)
    return reward


def main(argv: list[str] | None = None) -> None:
    """Solve one problem against an OpenAI-compatible endpoint and print the dialogue."""
    parser = cli_parser(main.__doc__ or "")
    parser.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS)
    args = parser.parse_args(argv)
    data = {**cli_data(args), "max_turns": args.max_turns}
    reward, messages = asyncio.run(solve(data))
    print(json.dumps({"reward": reward, "messages": messages}, indent=2))


if __name__ == "__main__":
    main()
