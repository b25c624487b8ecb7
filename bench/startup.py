"""Time to ready of ``proxima serve`` beside the embedded engine it starts, alone.

Each round starts, from a cold process, one embedded engine alone (``python -m
proxima.proxy.embedded``, until ``/health`` answers) and ``proxima serve`` on the
same model with its embedded engine (until the proxy's ``/health`` answers, which
waits for the engine); rounds interleave the two. Prints the median of each and
what the proxy adds on top of its engine: ``proxima serve`` starts the engine
before it imports its own app, and loads the tokenizer while the engine loads, so
the proxy's own start-up hides behind the engine's.

    .venv/bin/python bench/startup.py                   # a tiny random model, built here
    .venv/bin/python bench/startup.py --model DIR --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.server_process import ProxyProcess
from proxima.proxy.testing.tiny_model import build_tiny_model

logger = logging.getLogger("bench.startup")


def _engine_ready_s(model: Path) -> float:
    engine = EngineProcess(model)
    start = time.perf_counter()
    engine.start()
    try:
        asyncio.run(engine.wait_healthy())
        return time.perf_counter() - start
    finally:
        engine.stop()


def _proxy_ready_s(model: Path, work: Path, i: int) -> float:
    proxy = ProxyProcess(model, db_url=f"sqlite:///{work / f'store{i}.db'}")
    start = time.perf_counter()
    proxy.start()
    try:
        return time.perf_counter() - start
    finally:
        proxy.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: a tiny one)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="proxima-startup-") as tmp:
        work = Path(tmp)
        model = args.model or build_tiny_model(work / "tiny-qwen2")
        engine_s, proxy_s = [], []
        for i in range(args.rounds):
            engine_s.append(_engine_ready_s(model))
            proxy_s.append(_proxy_ready_s(model, work, i))
            print(f"round {i + 1}: engine {engine_s[-1]:.2f} s, proxima serve {proxy_s[-1]:.2f} s")
    engine, proxy = statistics.median(engine_s), statistics.median(proxy_s)
    print(
        f"startup: engine alone {engine:.2f} s, proxima serve with it {proxy:.2f} s "
        f"(ratio {proxy / engine:.2f}; the proxy adds {proxy - engine:.2f} s)"
    )


if __name__ == "__main__":
    main()
