"""A simulated SGLang-protocol generator with a throughput model, for ``bench/async_vs_sync.py``.

Unlike :mod:`proxy.testing.fake_sglang` (each request decodes at its own
rate, no limit on how many run at once), this backend has ``--max-running``
decode slots: a request waits in a FIFO queue for a slot, then decodes at
``--tokens-per-s`` (per request, so the generator's peak rate is
``max_running * tokens_per_s``, a memory-bound decode model). It measures its
own utilization: the integral of busy slots over time (``GET /sim_stats``).

Weight updates, by ``--interrupt``:

- ``abort`` (default, SGLang with ``/pause_generation {mode: abort}``):
  pause aborts every running and queued request (``finish_reason: abort``
  with its partial tokens); the proxy resumes them after the update.
- ``drain`` (interruption disabled, SGLang's behaviour without abort):
  ``/pause_generation`` and ``/abort_request {abort_all}`` are ignored;
  ``/update_weights_from_disk`` holds new requests and waits until every
  in-flight request (running or queued) has finished with the old weights,
  then loads the new version (SGLang's model-update lock: generation holds
  the reader side, the update takes the writer side).
- ``swap``: pause/abort ignored too, but the update takes effect at once for
  new requests while in-flight ones go on with their old version (not
  physically possible on one engine; an optimistic bound for "no interruption").

Every request's tokens carry the version it started with. A per-request
``/abort_request {rid}`` (a client that went away) is always honoured.

Run: ``python bench/_sim.py --port N --tokens-per-s 100 --max-running 16 --interrupt abort``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from proxy.testing.fake_sglang import generate_response


class SimGenerator:
    def __init__(self, *, tokens_per_s: float, max_running: int, interrupt: str = "abort",
                 chunk_tokens: int = 8, vocab_size: int = 256, seed: int = 0):
        if interrupt not in ("abort", "drain", "swap"):
            raise ValueError(f"interrupt must be abort, drain or swap, not {interrupt!r}")
        self.tokens_per_s = tokens_per_s
        self.max_running = max_running
        self.interrupt = interrupt
        self.chunk_tokens = max(1, chunk_tokens)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.weight_version = "0"
        self.gate = asyncio.Event()  # set = accepting new requests
        self.gate.set()
        self.slots = asyncio.Semaphore(max_running) if max_running > 0 else None
        self.aborted: set[str] = set()
        self.inflight: set[str] = set()  # admitted: queued or running
        self.idle = asyncio.Event()
        self.idle.set()
        # Utilization accounting.
        self.running = 0
        self.t_last = time.monotonic()
        self.slot_seconds = 0.0  # integral of running requests over time
        self.any_busy_seconds = 0.0  # time with at least one request decoding
        self.generated_tokens = 0
        self.requests = 0
        self.aborts = 0
        self.update_wait_s = 0.0  # time updates spent draining (drain mode)

    # -- accounting -----------------------------------------------------------------
    def _tick(self, delta: int) -> None:
        now = time.monotonic()
        dt = now - self.t_last
        self.slot_seconds += self.running * dt
        if self.running:
            self.any_busy_seconds += dt
        self.t_last = now
        self.running += delta

    def stats(self) -> dict[str, Any]:
        self._tick(0)
        return {
            "t": time.monotonic(), "slot_seconds": self.slot_seconds,
            "any_busy_seconds": self.any_busy_seconds, "max_running": self.max_running,
            "tokens_per_s": self.tokens_per_s, "generated_tokens": self.generated_tokens,
            "requests": self.requests, "aborts": self.aborts, "update_wait_s": self.update_wait_s,
            "interrupt": self.interrupt, "weight_version": self.weight_version,
        }

    # -- generation -----------------------------------------------------------------
    def _abort_all(self) -> None:
        self.aborted |= self.inflight

    async def run(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await self.gate.wait()
        rid = body.get("rid") or f"sim-{self.rng.getrandbits(48):x}"
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        prompt_len = len(body.get("input_ids") or [])
        version = self.weight_version
        ids: list[int] = []
        lps: list[list[Any]] = []
        self.inflight.add(rid)
        self.idle.clear()
        self.requests += 1
        holding = False
        try:
            if self.slots is not None:
                await self.slots.acquire()
                holding = True
            self._tick(+1)
            finish = None
            while finish is None:
                if rid in self.aborted:
                    finish = {"type": "abort", "message": "aborted"}
                    self.aborts += 1
                else:
                    step = min(self.chunk_tokens, max_new - len(ids))
                    if self.tokens_per_s > 0:
                        await asyncio.sleep(step / self.tokens_per_s)
                    if rid in self.aborted:  # aborted mid-chunk: those tokens were not made
                        finish = {"type": "abort", "message": "aborted"}
                        self.aborts += 1
                    else:
                        for _ in range(step):
                            ids.append(self.rng.randrange(self.vocab_size))
                            lps.append([-self.rng.random() * 3.0, ids[-1], None])
                        self.generated_tokens += step
                        if len(ids) >= max_new:
                            finish = {"type": "length", "length": len(ids)}
                if finish is None and not ids:
                    continue
                yield {
                    "text": "", "output_ids": ids,
                    "meta_info": {
                        "id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                        "completion_tokens": len(ids), "cached_tokens": 0,
                        "weight_version": version, "output_token_logprobs": lps,
                    },
                }
        finally:
            if holding:
                self._tick(-1)
                assert self.slots is not None
                self.slots.release()
            self.inflight.discard(rid)
            self.aborted.discard(rid)
            if not self.inflight:
                self.idle.set()

    async def pause(self) -> None:
        if self.interrupt == "abort":
            self.gate.clear()
            self._abort_all()

    async def cont(self) -> None:
        self.gate.set()

    async def update(self, version: str) -> None:
        if self.interrupt == "drain":
            started = time.monotonic()
            self.gate.clear()
            try:
                await self.idle.wait()
            finally:
                self.weight_version = version
                self.gate.set()
            self.update_wait_s += time.monotonic() - started
        else:
            self.weight_version = version


def create_sim_app(sim: SimGenerator) -> FastAPI:
    app = FastAPI(title="simulated sglang")
    app.state.sim = sim

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await generate_response(sim.run, json.loads(await request.body()))

    @app.post("/abort_request")
    async def abort(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body() or b"{}")
        if body.get("abort_all"):
            if sim.interrupt == "abort":
                sim._abort_all()
        elif body.get("rid"):
            sim.aborted.add(body["rid"])
        return {}

    @app.post("/pause_generation")
    async def pause() -> dict[str, Any]:
        await sim.pause()
        return {}

    @app.post("/continue_generation")
    async def cont() -> dict[str, Any]:
        await sim.cont()
        return {}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        await sim.update(str(body.get("weight_version") or sim.weight_version))
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> dict[str, Any]:
        return {}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    @app.get("/get_model_info")
    async def info() -> dict[str, Any]:
        return {"model_path": "sim", "is_generation": True, "weight_version": sim.weight_version}

    @app.get("/sim_stats")
    async def sim_stats() -> dict[str, Any]:
        return sim.stats()

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="simulated SGLang-protocol generator (throughput model)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="decode rate per request")
    p.add_argument("--max-running", type=int, default=16, help="decode slots (0 = unlimited)")
    p.add_argument("--interrupt", choices=["abort", "drain", "swap"], default="abort")
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=256)
    args = p.parse_args()
    sim = SimGenerator(tokens_per_s=args.tokens_per_s, max_running=args.max_running,
                       interrupt=args.interrupt, chunk_tokens=args.chunk_tokens,
                       vocab_size=args.vocab_size)
    uvicorn.run(create_sim_app(sim), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
