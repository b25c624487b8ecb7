"""What the example agents share: endpoint settings and answer checking.

Agents read their endpoint the way OpenAI-SDK programs usually do: from the
item (``data["base_url"]``, ``data["api_key"]``, ``data["model"]``, which the
rollout controller fills in) or else from ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# Under the rollout controller the session key is bound to requests to the proxy,
# so an agent may pass any placeholder key.
PLACEHOLDER_API_KEY = "proxima"

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an agent sends its chat completions."""

    base_url: str
    api_key: str
    model: str | None


def endpoint(data: Mapping[str, Any]) -> Endpoint:
    """The endpoint for one run: ``data`` first, then the ``OPENAI_*`` environment."""
    base_url = data.get("base_url") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    api_key = data.get("api_key") or os.environ.get("OPENAI_API_KEY") or PLACEHOLDER_API_KEY
    model = data.get("model") or os.environ.get("OPENAI_MODEL")
    return Endpoint(base_url=str(base_url).rstrip("/"), api_key=str(api_key), model=model)


async def resolve_model(ep: Endpoint) -> str:
    """The configured model, else the first one the server lists at ``GET /models``."""
    if ep.model:
        return ep.model
    async with httpx.AsyncClient(timeout=30.0) as client:
        resp = await client.get(
            f"{ep.base_url}/models", headers={"Authorization": f"Bearer {ep.api_key}"}
        )
        resp.raise_for_status()
        models = resp.json()["data"]
    if not models:
        raise RuntimeError(
            f"{ep.base_url}/models lists no model; pass one with data['model'] or OPENAI_MODEL"
        )
    return str(models[0]["id"])


def last_integer(text: str | None) -> int | None:
    """The last integer written in ``text`` (thousands separators allowed), if any."""
    if not text:
        return None
    found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return int(found[-1]) if found else None


def is_correct(text: str | None, answer: Any) -> bool:
    """Whether the last integer in ``text`` equals ``answer``."""
    got = last_integer(text)
    return got is not None and got == int(answer)


def sampling(data: Mapping[str, Any], *, max_tokens: int, turn: int = 0) -> dict[str, Any]:
    """Sampling settings from the item (``temperature``, ``max_tokens``), with defaults.

    With a ``seed`` in the item, the request carries a seed derived from it, the
    item's ``id``, the run's ``group_index`` (so a group's runs sample differently)
    and ``turn``: the same run samples the same way every time.
    """
    settings: dict[str, Any] = {
        "temperature": float(data.get("temperature", 1.0)),
        "max_tokens": int(data.get("max_tokens", max_tokens)),
    }
    if data.get("seed") is not None:
        settings["seed"] = request_seed(
            data["seed"], data.get("id", data.get("question")), data.get("group_index", 0), turn
        )
    return settings


def request_seed(*parts: Any) -> int:
    """A stable 63-bit seed from ``parts`` (the same in every process, unlike ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def cli_parser(description: str) -> argparse.ArgumentParser:
    """The standalone CLI every example agent shares: endpoint, one problem, sampling."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", PLACEHOLDER_API_KEY))
    parser.add_argument(
        "--model",
        default=os.environ.get("OPENAI_MODEL"),
        help="model name (default: the first one the server lists)",
    )
    parser.add_argument("--question", default="What is 7 + 5?")
    parser.add_argument("--answer", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=None)
    return parser


def cli_data(args: argparse.Namespace) -> dict[str, Any]:
    """The ``data`` item a standalone run passes to ``run_agent_return_reward``."""
    data: dict[str, Any] = {
        "base_url": args.base_url,
        "api_key": args.api_key,
        "model": args.model,
        "question": args.question,
        "answer": args.answer,
        "temperature": args.temperature,
    }
    if args.max_tokens is not None:
        data["max_tokens"] = args.max_tokens
    return data
