"""Multi-turn math agent on the OpenAI SDK (``AsyncOpenAI``).

The agent asks the model the question; a checker reads the last integer of
the reply. A wrong answer gets the feedback "That is not correct, try
again." as a user turn and another try, up to ``max_turns`` turns. The reward
is 1.0 when the final answer is right, else 0.0, given to the session's last
turn: with a discount ``gamma`` a wrong first answer followed by a right one
returns ``gamma`` on its first turn, so a run that trains on several turns
should use ``gamma = 0`` (a wrong answer's turn then returns 0) or train on
the first try only (``max_turns = 1``, what ``make demo`` does).

With ``report`` set in the item (the evaluation sets it), the agent returns a
mapping instead of a float: ``{"final": reward, "first_try": 1.0 or 0.0,
"truncated": 1.0 or 0.0}``, whether the first answer alone was right and
whether it was cut at ``max_tokens`` (finish reason ``length``). Greedy, the
first turn of a run is the run of one turn, so one evaluation gives both
first-try accuracy and success within ``max_turns`` tries.

Item fields: ``question``, ``answer`` (int); optional ``max_turns`` (3),
``temperature`` (1.0), ``max_tokens`` (96), ``system`` (a system prompt),
``seed`` (seeds every request: see ``common.sampling``), ``report``,
``model``/``base_url``/``api_key`` (else ``OPENAI_*``).

Standalone: ``python -m proxima.agents_examples.math_agent --base-url URL --api-key K --model M``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class Dialogue:
    """One run: its reward, the transcript, and per turn whether the answer was right and
    whether it was cut at ``max_tokens``."""

    reward: float = 0.0
    messages: list[ChatCompletionMessageParam] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    def report(self) -> dict[str, float]:
        """``final``, ``first_try`` and ``truncated`` (of the first answer), as 1.0 or 0.0."""
        return {
            "final": self.reward,
            "first_try": float(bool(self.correct) and self.correct[0]),
            "truncated": float(bool(self.truncated) and self.truncated[0]),
        }


async def solve(data: dict[str, Any]) -> tuple[float, list[ChatCompletionMessageParam]]:
    """Run the dialogue; returns the reward and the transcript."""
    dialogue = await converse(data)
    return dialogue.reward, dialogue.messages


async def converse(data: dict[str, Any]) -> Dialogue:
    """Run the dialogue; returns it with every turn's outcome."""
    ep = endpoint(data)
    client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    try:
        model = await resolve_model(ep)
        dialogue = Dialogue()
        messages = dialogue.messages
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
            choice = response.choices[0]
            reply = choice.message.content or ""
            messages.append({"role": "assistant", "content": reply})
            dialogue.correct.append(is_correct(reply, data["answer"]))
            dialogue.truncated.append(choice.finish_reason == "length")
            if dialogue.correct[-1]:
                dialogue.reward = 1.0
                break
        return dialogue
    finally:
        await client.close()


async def run_agent_return_reward(data: dict[str, Any]) -> float | dict[str, float]:
    """1.0 if the agent ends on the right answer within ``max_turns`` turns, else 0.0 (with
    ``report`` in ``data``: :meth:`Dialogue.report`)."""
    dialogue = await converse(data)
    return dialogue.report() if data.get("report") else dialogue.reward


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
