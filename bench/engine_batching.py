"""Continuous batching in the embedded engine: N concurrent requests vs the same N in turn.

Starts the engine in-process behind uvicorn on loopback, sends ``--requests``
generations of exactly ``--max-new-tokens`` tokens each (``ignore_eos``), first
all at once, then one after another, and reports output tokens per second for
both and the speed-up.

    .venv/bin/python bench/engine_batching.py                          # tiny model (hidden 64, 2 layers)
    .venv/bin/python bench/engine_batching.py --hidden 256 --layers 4  # more compute per token
    .venv/bin/python bench/engine_batching.py --model DIR              # any local HF causal LM
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from proxima.proxy.embedded.live import EngineServer
from proxima.proxy.testing.tiny_model import build_tiny_model

logger = logging.getLogger("bench.engine_batching")


def generate_body(i: int, max_new_tokens: int) -> dict[str, Any]:
    """A /generate body of exactly ``max_new_tokens`` sampled tokens (seeded by ``i``)."""
    return {
        "text": f"Request {i}: tell me a long story about the number {i * 7}.",
        "sampling_params": {
            "temperature": 1.0,
            "sampling_seed": i,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
        },
    }


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    response = await client.post("/generate", json=body)
    response.raise_for_status()
    tokens: int = response.json()["meta_info"]["completion_tokens"]
    return tokens


async def _measure(url: str, requests: int, max_new_tokens: int) -> tuple[float, float]:
    """Tokens/s (concurrent, sequential)."""
    bodies = [generate_body(i, max_new_tokens) for i in range(requests)]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        await _one(client, generate_body(-1, 8))  # warm-up
        start = time.perf_counter()
        concurrent_tokens = sum(await asyncio.gather(*(_one(client, b) for b in bodies)))
        concurrent_s = time.perf_counter() - start
        start = time.perf_counter()
        sequential_tokens = 0
        for body in bodies:
            sequential_tokens += await _one(client, body)
        sequential_s = time.perf_counter() - start
        info = (await client.get("/get_server_info")).json()
    logger.info(
        "concurrent: %d tokens in %.2fs; sequential: %d tokens in %.2fs; peak batch %d",
        concurrent_tokens,
        concurrent_s,
        sequential_tokens,
        sequential_s,
        info["stats"]["peak_batch_size"],
    )
    return concurrent_tokens / concurrent_s, sequential_tokens / sequential_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="HF model directory (default: build a tiny one)")
    parser.add_argument(
        "--hidden", type=int, default=64, help="hidden size of the built tiny model"
    )
    parser.add_argument("--layers", type=int, default=2, help="layers of the built tiny model")
    parser.add_argument("--requests", type=int, default=16, help="number of requests")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens generated per request"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: available CPUs)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(
            Path(tmp) / "bench-model", hidden_size=args.hidden, num_layers=args.layers
        )
        with EngineServer(
            model_dir, num_threads=args.threads, max_running_requests=max(args.requests, 1)
        ) as server:
            concurrent, sequential = asyncio.run(
                _measure(server.url, args.requests, args.max_new_tokens)
            )
    logger.info("model: %s", args.model or f"tiny (hidden {args.hidden}, {args.layers} layers)")
    logger.info("concurrent: %8.1f tokens/s", concurrent)
    logger.info("sequential: %8.1f tokens/s", sequential)
    logger.info("speed-up:   %8.2fx", concurrent / sequential)


if __name__ == "__main__":
    main()
