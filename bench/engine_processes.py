"""One embedded engine process vs two (``proxima serve --engines 2``) on the same requests.

Starts two engine processes (``proxima engine``, each with its share of half the CPUs as
torch threads, as ``--engines 2`` does), then sends ``--requests`` concurrent generations
of exactly ``--max-new-tokens`` tokens (``ignore_eos``): all to the first engine, then split
over both; rounds interleave the two arms. Prints output tokens per second for each arm and
the ratio. On a 2-core machine one engine runs one thread, and the other core waits while a
synchronous trainer waits for its rollouts; ``make demo`` runs two.

    .venv/bin/python bench/engine_processes.py                    # the demo model (make demo prepares it)
    .venv/bin/python bench/engine_processes.py --model DIR --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from pathlib import Path

import httpx
from engine_batching import generate_body  # bench/ is the script's directory
from proxima.proxy.embedded.launcher import EngineProcess, default_num_threads

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench.engine_processes")


async def _tokens_per_s(
    client: httpx.AsyncClient, urls: list[str], requests: int, max_new_tokens: int
) -> float:
    start = time.perf_counter()
    replies = await asyncio.gather(
        *(
            client.post(urls[i % len(urls)] + "/generate", json=generate_body(i, max_new_tokens))
            for i in range(requests)
        )
    )
    elapsed = time.perf_counter() - start
    for reply in replies:
        reply.raise_for_status()
    return sum(r.json()["meta_info"]["completion_tokens"] for r in replies) / elapsed


async def _measure(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    threads = max(1, default_num_threads() // 2)
    engines = [
        EngineProcess(args.model, max_running_requests=args.requests, num_threads=threads)
        for _ in range(2)
    ]
    for engine in engines:
        engine.start()
    one: list[float] = []
    two: list[float] = []
    try:
        for engine in engines:
            await engine.wait_healthy()
        urls = [e.url for e in engines]
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            for url in urls:  # warm-up
                (await client.post(url + "/generate", json=generate_body(-1, 8))).raise_for_status()
            for round_ in range(args.rounds):
                one.append(
                    await _tokens_per_s(client, urls[:1], args.requests, args.max_new_tokens)
                )
                two.append(await _tokens_per_s(client, urls, args.requests, args.max_new_tokens))
                logger.info(
                    "round %d: one engine %.1f tokens/s, two engines %.1f tokens/s",
                    round_ + 1,
                    one[-1],
                    two[-1],
                )
    finally:
        for engine in engines:
            engine.stop()
    return one, two


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
    )
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per arm")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both arms")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not (args.model / "config.json").exists():
        parser.error(f"{args.model} is not a model directory (run make demo once, or pass --model)")
    one, two = asyncio.run(_measure(args))
    m1, m2 = statistics.median(one), statistics.median(two)
    print(f"model: {args.model.name}; {args.requests} requests x {args.max_new_tokens} tokens")
    print(f"one engine:  {m1:7.1f} tokens/s (median of {len(one)})")
    print(f"two engines: {m2:7.1f} tokens/s")
    print(f"engine processes: two engines {m2 / m1:.2f}x one")


if __name__ == "__main__":
    main()
