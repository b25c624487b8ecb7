"""A simulated SGLang-protocol generator with a throughput model, for ``bench/async_vs_sync.py``.

Unlike :mod:`proxima.proxy.testing.fake_sglang` (each request decodes at its own
rate, no limit on how many run at once), this backend has ``--max-running``
decode slots: a request waits in a FIFO queue for a slot, then decodes in
chunks of ``--chunk-tokens``. Decode is memory-bound: one engine step makes
one token for every running request and costs a fixed part (reading the
weights) plus a part proportional to the running requests (reading their KV
cache), so with ``n`` of ``S`` slots busy each request decodes at::

    rate(n) = tokens_per_s / (a + (1 - a) * n / S),  a = (S / G - 1) / (S - 1)

``tokens_per_s`` is the per-request rate of a full engine and
``G = --decode-speedup`` how much faster a request decodes alone
(``rate(1) = G * rate(S)``; ``G = 1``: a fixed rate per request). The peak
throughput is ``S * tokens_per_s``. A chunk's rate is set when it starts.
The simulator measures its own utilization (``GET /sim_stats``): tokens
generated, busy slot-seconds, time with any request decoding.

Weight updates, by ``--interrupt``:

- ``abort`` (default, SGLang with ``/pause_generation {mode: abort}``):
  pause aborts every running and queued request at once (``finish_reason:
  abort`` with the tokens decoded so far); the proxy resumes them after the
  update.
- ``drain`` (interruption disabled, SGLang's behaviour without abort):
  ``/pause_generation`` and ``/abort_request {abort_all}`` are ignored;
  ``/update_weights_from_disk`` holds new requests and waits until every
  in-flight request (running or queued) has finished with the old weights,
  then loads the new version (SGLang's model-update lock: generation holds
  the reader side, the update takes the writer side).
- ``swap``: pause/abort ignored too, but the update takes effect at once for
  new requests while in-flight ones go on with their old version (not
  physically possible on one engine; an optimistic bound for "no interruption").

Loading the weights takes ``--weight-load-s`` (no decoding meanwhile in
``abort`` and ``drain``). Every request's tokens carry the version it started
with. A per-request ``/abort_request {rid}`` (a client that went away) is
always honoured. ``--incremental`` streams only the new tokens in each chunk
(SGLang's ``--incremental-streaming-output``); by default chunks are
cumulative, as SGLang's are.

Run: ``python bench/_sim.py --port N --tokens-per-s 100 --max-running 16 --interrupt abort``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    GenerateRequest,
    UpdateWeightsFromDiskBody,
)
from proxima.proxy.testing.sglang_routes import generate_response, sglang_app


class SimGenerator:
    def __init__(
        self,
        *,
        tokens_per_s: float,
        max_running: int,
        interrupt: str = "abort",
        decode_speedup: float = 1.0,
        chunk_tokens: int = 8,
        incremental: bool = False,
        weight_load_s: float = 0.0,
        vocab_size: int = 256,
        seed: int = 0,
    ):
        if interrupt not in ("abort", "drain", "swap"):
            raise ValueError(f"interrupt must be abort, drain or swap, not {interrupt!r}")
        if decode_speedup < 1.0 or (max_running > 0 and decode_speedup > max_running):
            raise ValueError(f"decode_speedup must be in [1, max_running], not {decode_speedup}")
        if max_running <= 0 and decode_speedup != 1.0:
            raise ValueError("decode_speedup needs a slot limit (max_running > 0)")
        self.tokens_per_s = tokens_per_s
        self.max_running = max_running
        self.interrupt = interrupt
        self.decode_speedup = decode_speedup
        # Share of a full engine's step time that does not depend on the batch (weights).
        self.fixed_share = (
            (max_running / decode_speedup - 1) / (max_running - 1) if max_running > 1 else 1.0
        )
        self.chunk_tokens = max(1, chunk_tokens)
        self.incremental = incremental
        self.weight_load_s = weight_load_s
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.weight_version = "0"
        self.gate = asyncio.Event()  # set = accepting new requests
        self.gate.set()
        self.slots = asyncio.Semaphore(max_running) if max_running > 0 else None
        self.aborted: set[str] = set()
        self.inflight: dict[str, asyncio.Event] = {}  # admitted (queued or running) -> abort signal
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
        self.update_load_s = 0.0  # time spent loading weights

    def rate(self, running: int) -> float:
        """Tokens/s of each request while ``running`` requests decode."""
        if self.max_running <= 0:
            return self.tokens_per_s
        a = self.fixed_share
        return self.tokens_per_s / (a + (1 - a) * min(running, self.max_running) / self.max_running)

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
            "t": time.monotonic(),
            "slot_seconds": self.slot_seconds,
            "any_busy_seconds": self.any_busy_seconds,
            "max_running": self.max_running,
            "tokens_per_s": self.tokens_per_s,
            "decode_speedup": self.decode_speedup,
            "peak_tokens_per_s": self.tokens_per_s * self.max_running
            if self.max_running > 0
            else None,
            "generated_tokens": self.generated_tokens,
            "requests": self.requests,
            "aborts": self.aborts,
            "update_wait_s": self.update_wait_s,
            "update_load_s": self.update_load_s,
            "interrupt": self.interrupt,
            "weight_version": self.weight_version,
        }

    # -- generation -----------------------------------------------------------------
    def abort(self, rids: set[str] | list[str]) -> None:
        for rid in rids:
            if rid in self.inflight:
                self.aborted.add(rid)
                self.inflight[rid].set()

    def _abort_all(self) -> None:
        self.abort(list(self.inflight))

    async def _decode(self, wake: asyncio.Event, n: int) -> int:
        """Decode up to ``n`` tokens; fewer if aborted meanwhile. Returns how many were made."""
        if self.tokens_per_s <= 0:
            return n
        rate = self.rate(self.running)
        started = time.monotonic()
        try:
            await asyncio.wait_for(wake.wait(), n / rate)
        except TimeoutError:
            return n
        return min(n, int((time.monotonic() - started) * rate))

    async def run(
        self, request: GenerateRequest, *, incremental: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        await self.gate.wait()
        rid = request.rid or f"sim-{self.rng.getrandbits(48):x}"
        max_new = request.sampling_params.max_new_tokens
        prompt_len = len(request.input_ids or [])
        version = self.weight_version
        ids: list[int] = []
        lps: list[list[Any]] = []
        sent = 0  # tokens already streamed (incremental mode)
        wake = asyncio.Event()
        self.inflight[rid] = wake
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
                if rid not in self.aborted:
                    made = await self._decode(wake, min(self.chunk_tokens, max_new - len(ids)))
                    for _ in range(made):
                        ids.append(self.rng.randrange(self.vocab_size))
                        lps.append([-self.rng.random() * 3.0, ids[-1], None])
                    self.generated_tokens += made
                if rid in self.aborted:
                    finish = {"type": "abort", "message": "Abort", "status_code": None}
                    self.aborts += 1
                elif len(ids) >= max_new:
                    finish = {"type": "length", "length": len(ids)}
                if finish is None and len(ids) == sent:
                    continue
                start = sent if incremental else 0
                sent = len(ids)
                yield {
                    "text": "",
                    "output_ids": ids[start:],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": finish,
                        "prompt_tokens": prompt_len,
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "weight_version": version,
                        "output_token_logprobs": lps[start:],
                    },
                }
        finally:
            if holding:
                self._tick(-1)
                assert self.slots is not None
                self.slots.release()
            self.inflight.pop(rid, None)
            self.aborted.discard(rid)
            if not self.inflight:
                self.idle.set()

    async def pause(self, mode: str = "abort") -> None:
        if self.interrupt == "abort":
            self.gate.clear()
            self._abort_all()

    async def cont(self) -> None:
        self.gate.set()

    async def _load(self, version: str) -> None:
        started = time.monotonic()
        if self.weight_load_s > 0:
            await asyncio.sleep(self.weight_load_s)
        self.weight_version = version
        self.update_load_s += time.monotonic() - started

    async def update(self, body: UpdateWeightsFromDiskBody) -> dict[str, Any]:
        version = body.weight_version or self.weight_version
        if self.interrupt == "drain":
            started = time.monotonic()
            self.gate.clear()
            try:
                await self.idle.wait()
                self.update_wait_s += time.monotonic() - started
                await self._load(version)
            finally:
                self.gate.set()
        else:  # abort: nothing decodes now (paused); swap: in-flight requests go on
            await self._load(version)
        return {"success": True, "message": "ok", "num_paused_requests": 0}


def create_sim_app(sim: SimGenerator) -> FastAPI:
    async def generate(request: GenerateRequest) -> Any:
        incremental = sim.incremental and request.stream
        return await generate_response(lambda r: sim.run(r, incremental=incremental), request)

    async def abort(body: AbortRequestBody) -> None:
        if body.abort_all:
            if sim.interrupt == "abort":
                sim._abort_all()
        elif body.rid:
            # SGLang matches the rid as a prefix.
            sim.abort([rid for rid in sim.inflight if rid.startswith(body.rid)])

    app = sglang_app(
        "simulated sglang",
        "sim",
        generate=generate,
        abort=abort,
        pause=sim.pause,
        resume=sim.cont,
        update=sim.update,
        weight_version=lambda: sim.weight_version,
    )
    app.state.sim = sim

    @app.get("/sim_stats")
    async def sim_stats() -> dict[str, Any]:
        return sim.stats()

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(
        description="simulated SGLang-protocol generator (throughput model)"
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=100.0,
        help="decode rate per request with every slot busy",
    )
    p.add_argument("--max-running", type=int, default=16, help="decode slots (0 = unlimited)")
    p.add_argument(
        "--decode-speedup",
        type=float,
        default=1.0,
        help="rate of a request decoding alone / rate with every slot busy",
    )
    p.add_argument("--interrupt", choices=["abort", "drain", "swap"], default="abort")
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--incremental", action="store_true", help="stream only new tokens per chunk")
    p.add_argument("--weight-load-s", type=float, default=0.0, help="time to load new weights")
    p.add_argument("--vocab-size", type=int, default=256)
    args = p.parse_args()
    sim = SimGenerator(
        tokens_per_s=args.tokens_per_s,
        max_running=args.max_running,
        interrupt=args.interrupt,
        decode_speedup=args.decode_speedup,
        chunk_tokens=args.chunk_tokens,
        incremental=args.incremental,
        weight_load_s=args.weight_load_s,
        vocab_size=args.vocab_size,
    )
    uvicorn.run(
        create_sim_app(sim), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
