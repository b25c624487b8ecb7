"""A fast SGLang server with a timing model instead of a model, as awkward as the real one.

It serves SGLang 0.5.23's native API (``/generate`` streaming and not,
``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/health``, ``/model_info``, ``/flush_cache``)
with the request models of :mod:`proxima.proxy.backends.protocol`, so the
proxy's code path is exercised unchanged. Tokens are drawn from a seeded RNG
(from ``sampling_seed`` and the prompt when the request gives one); each
request decodes at ``tokens_per_s`` (0 = as fast as possible). Used by tests,
benchmarks and load tests where a real model would measure the model, not the
proxy.

What it copies from SGLang (file names are SGLang's), because the proxy must
cope with each:

- strict bodies: an unknown key is a 400 ``{"error": "..."}``;
- ``/health`` and ``/health_generate`` run a one-token generation that waits
  while generation is paused, answering 503 after ``health_timeout_s``
  (``HEALTH_CHECK_TIMEOUT``, 20 s) and 200 only at a one-second poll
  (``entrypoints/http_server.py``);
- stream chunks are cumulative, or with ``incremental`` (SGLang's
  ``--incremental-streaming-output``) only the new tokens; an abort of a
  queued request that had produced tokens then sends ``output_ids=[last]``
  with the full ``completion_tokens`` and all logprobs
  (``TokenizerManager._handle_abort_req``);
- a prompt over ``max_input_tokens`` finishes at once with
  ``{"type": "abort", "status_code": 400, "err_type": "BadRequestError"}``
  (``validate_input_length``); a plain abort carries ``status_code: null``;
- ``/abort_request`` matches ``rid`` as a prefix (``Scheduler.abort_request``);
- logprobs of -inf are JSON ``null`` (orjson): top-k alternatives of a
  greedy request beyond the chosen token, and the chosen token's own logprob
  at the positions listed in ``null_logprob_at``;
- ``num_paused_requests`` is a list of ``dp_size`` counts when ``dp_size > 1``;
- LoRA (``enable_lora``, SGLang's ``--enable-lora``): SGLang's adapter registry,
  its refusals and its waits (``proxima.proxy.testing.fake_lora``). Each adapter
  draws other tokens than the base (the seed includes ``lora_path``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    GenerateRequest,
    SamplingParams,
    UpdateWeightsFromDiskBody,
)
from proxima.proxy.testing.fake_lora import FakeLoRA
from proxima.proxy.testing.sglang_routes import (
    Chunk,
    RequestRefused,
    generate_response,
    sglang_app,
)

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class FakeBackend:
    def __init__(
        self,
        *,
        vocab_size: int = 256,
        tokens_per_s: float = 0.0,
        eos_id: int | None = None,
        chunk_tokens: int = 1,
        seed: int = 0,
        incremental: bool = False,
        dp_size: int = 1,
        max_input_tokens: int | None = None,
        weight_load_s: float = 0.0,
        health_timeout_s: float = 20.0,
        health_poll_s: float = 1.0,
        null_logprob_at: frozenset[int] = frozenset(),
        record_bodies: bool = False,
        script: list[int] | None = None,
        abort_at: frozenset[int] = frozenset(),
        text_of: Callable[[list[int]], str] | None = None,
        enable_lora: bool = False,
        max_lora_rank: int | None = None,
    ):
        self.vocab_size = vocab_size
        self.tokens_per_s = tokens_per_s
        self.eos_id = eos_id
        self.chunk_tokens = max(1, chunk_tokens)
        self.incremental = incremental
        self.dp_size = dp_size
        self.max_input_tokens = max_input_tokens
        self.weight_load_s = weight_load_s
        self.health_timeout_s = health_timeout_s
        self.health_poll_s = health_poll_s
        self.null_logprob_at = null_logprob_at
        # Test knobs: token at sequence position p is script[p % len(script)]; a request
        # is aborted (plain abort) when its sequence first reaches a length in abort_at; with
        # text_of (ids -> text) chunks carry text and stop strings are matched.
        self.script = script
        self.abort_at = set(abort_at)
        self.text_of = text_of
        self.weight_version = "0"
        self.rng = random.Random(seed)
        self.gate = asyncio.Event()  # set = not paused
        self.gate.set()
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.retracted: set[str] = set()
        self.generated_tokens = 0
        self.requests = 0
        self.health_probes = 0
        self.record_bodies = record_bodies
        self.bodies: list[dict[str, Any]] = []  # every /generate body (with record_bodies)
        self.last_receive = 0.0  # monotonic time of the last token (last_receive_tstamp)
        self.lora = FakeLoRA(max_lora_rank=max_lora_rank) if enable_lora else None

    @property
    def paused(self) -> bool:
        return not self.gate.is_set()

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's rule: ``abort_all``, or every request whose rid starts with ``rid``."""
        if not abort_all and not rid:
            return  # SGLang ignores an empty rid (it would match everything)
        self.aborted |= {r for r in self.running if abort_all or r.startswith(rid)}

    def _rng(self, request: GenerateRequest) -> random.Random:
        seed = request.sampling_params.sampling_seed
        if request.lora_path is not None:
            return random.Random(f"{seed}:{request.lora_path}:{request.input_ids}")
        if seed is None:
            return self.rng
        return random.Random(f"{seed}:{request.input_ids}")

    def _finish(self, kind: str, n: int, request: GenerateRequest) -> dict[str, Any]:
        if kind == "length":
            return {"type": "length", "length": n}
        if kind == "abort":
            return {"type": "abort", "message": "Abort", "status_code": None, "err_type": None}
        if kind == "too_long":
            limit = self.max_input_tokens
            return {
                "type": "abort",
                "message": f"Input length ({len(request.input_ids or [])} tokens) exceeds the "
                f"maximum allowed length ({limit} tokens). Use a shorter input or enable "
                "--allow-auto-truncate.",
                "status_code": 400,
                "err_type": "BadRequestError",
            }
        return {"type": "stop", "matched": self.eos_id}

    def _logprob_entry(
        self, rng: random.Random, token: int, position: int, request: GenerateRequest
    ) -> tuple[list[Any], list[list[Any]]]:
        chosen = None if position in self.null_logprob_at else -rng.random() * 3.0
        top: list[list[Any]] = []
        if request.top_logprobs_num:
            top.append([chosen, token, None])
            for k in range(1, request.top_logprobs_num):
                other = (token + k) % self.vocab_size
                # At temperature 0 every other token has logprob -inf: orjson writes null.
                lp = None if request.sampling_params.is_greedy else -3.0 - rng.random() * k
                top.append([lp, other, None])
        return [chosen, token, None], top

    async def run(self, request: GenerateRequest, *, stream: bool = False) -> AsyncIterator[Chunk]:
        """The chunks SGLang would send for ``request`` (cumulative unless incremental)."""
        rid = request.rid or uuid.uuid4().hex
        out = _Output(self, rid, request, incremental=stream and self.incremental)
        params = request.sampling_params
        rng = self._rng(request)
        self.requests += 1
        lora_id = None
        try:
            if self.max_input_tokens is not None and out.prompt_len >= self.max_input_tokens:
                yield out.chunk(self._finish("too_long", 0, request))
                return
            await self.gate.wait()  # TokenizerManager holds new requests while paused
            if request.lora_path:
                lora_id = await self._acquire_lora(request.lora_path)
            self.running.add(rid)  # only now does the scheduler know it
            finish = None
            while finish is None:
                if rid in self.aborted:
                    # A retracted request sits in the waiting queue: SGLang answers its
                    # abort from the tokenizer side (the echo path).
                    echo = rid in self.retracted
                    yield out.chunk(self._finish("abort", len(out.ids), request), abort_echo=echo)
                    return
                if rid in self.retracted:
                    await asyncio.sleep(0.005)
                    continue
                step, finish = self._decode_step(out, rng)
                self.last_receive = time.monotonic()
                if finish is None and len(out.ids) >= params.max_new_tokens:
                    finish = self._finish("length", len(out.ids), request)
                yield out.chunk(finish)
                out.sent = len(out.ids)
                if finish is None:
                    await asyncio.sleep(step / self.tokens_per_s if self.tokens_per_s > 0 else 0)
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)
            self.retracted.discard(rid)
            if lora_id is not None and self.lora is not None:
                self.lora.release(lora_id)

    async def _acquire_lora(self, name: str) -> str:
        """The id of the adapter copy a request naming ``name`` runs with (SGLang's refusal
        when LoRA is not enabled)."""
        if self.lora is None:
            raise RequestRefused(
                f"LoRA adapter '{name}' was requested, but LoRA is not "
                "enabled. Please launch the server with --enable-lora flag and preload "
                "adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        return await self.lora.acquire(name)

    def _decode_step(self, out: _Output, rng: random.Random) -> tuple[int, dict[str, Any] | None]:
        """Draw up to ``chunk_tokens`` tokens into ``out``: how many it tried, and the finish
        reached (eos, a stop string), if any. A position in ``abort_at`` aborts the request."""
        request = out.request
        params = request.sampling_params
        finish = None
        step = min(self.chunk_tokens, params.max_new_tokens - len(out.ids))
        for _ in range(step):
            position = out.prompt_len + len(out.ids)
            token = (
                self.script[position % len(self.script)]
                if self.script
                else rng.randrange(self.vocab_size)
            )
            lp, top = self._logprob_entry(rng, token, len(out.ids), request)
            out.ids.append(token)
            out.lps.append(lp)
            out.tops.append(top)
            self.generated_tokens += 1
            if token == self.eos_id and not params.ignore_eos:
                finish = self._finish("stop", len(out.ids), request)
                break
            if (stop := self._matched_stop(out.ids, params)) is not None:
                finish = {"type": "stop", "matched": stop}
                break
            if out.prompt_len + len(out.ids) in self.abort_at:
                self.abort_at.discard(out.prompt_len + len(out.ids))  # once per position
                self.aborted.add(out.rid)
                break
        return step, finish

    def _matched_stop(self, ids: list[int], params: SamplingParams) -> str | None:
        """SGLang's check: stop strings are looked for in this request's output only."""
        if self.text_of is None or not params.stop_strings:
            return None
        tail = self.text_of(ids)
        return next((stop for stop in params.stop_strings if stop in tail), None)

    def retract(self, rid: str) -> None:
        """Move a running request back to the waiting queue (SGLang does so under memory
        pressure); it keeps its output and makes no progress until aborted."""
        self.retracted.add(rid)

    async def pause(self, mode: str) -> None:
        self.gate.clear()
        if mode == "abort":
            self.abort(abort_all=True)

    async def resume(self) -> None:
        self.gate.set()

    async def update(self, body: UpdateWeightsFromDiskBody) -> dict[str, Any]:
        paused = len(self.running)
        if body.abort_all_requests:
            self.abort(abort_all=True)
        if self.weight_load_s:
            await asyncio.sleep(self.weight_load_s)
        if body.weight_version is not None:
            self.weight_version = body.weight_version
        # One line per load in the server's log: tests count loads per version (a push
        # through one proxy replica must load each backend once, not once per replica).
        print(f"weights loaded: version={body.weight_version} path={body.model_path}", flush=True)
        counts: int | list[int] = paused
        if self.dp_size > 1:
            counts = [paused if rank == 0 else 0 for rank in range(self.dp_size)]
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": counts,
        }


class _Output:
    """What one request has generated so far, and the chunks SGLang sends of it."""

    def __init__(
        self, fake: FakeBackend, rid: str, request: GenerateRequest, *, incremental: bool
    ) -> None:
        self.fake = fake
        self.rid = rid
        self.request = request
        self.incremental = incremental
        self.prompt_len = len(request.input_ids or [])
        self.ids: list[int] = []
        self.lps: list[list[Any]] = []
        self.tops: list[list[list[Any]]] = []
        self.sent = 0  # tokens already sent (an incremental chunk carries the ones after)

    def chunk(self, finish: dict[str, Any] | None, *, abort_echo: bool = False) -> Chunk:
        start = self.sent if self.incremental and not abort_echo else 0
        out_ids = self.ids[start:]
        if abort_echo and self.incremental:
            out_ids = self.ids[-1:]  # TokenizerManager._handle_abort_req
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            "weight_version": self.fake.weight_version,
        }
        if self.request.return_logprob:
            meta["output_token_logprobs"] = self.lps[start:]
            if self.request.top_logprobs_num:
                meta["output_top_logprobs"] = self.tops[start:]
        text_of = self.fake.text_of
        text = text_of(self.ids[start:]) if text_of else ""
        return {"text": text, "output_ids": out_ids, "meta_info": meta}


async def health_probe(fake: FakeBackend) -> int:
    """SGLang's health check: one greedy token, 200 once the scheduler answers anything."""
    fake.health_probes += 1
    probe = GenerateRequest(
        input_ids=[0],
        sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
        rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
    )
    started = time.monotonic()  # not loop.time(): uvloop caches it per iteration (ms)

    async def gen() -> None:
        async for _ in fake.run(probe):
            break

    task = asyncio.create_task(gen())
    try:
        while time.monotonic() < started + fake.health_timeout_s:
            await asyncio.sleep(fake.health_poll_s)
            if fake.last_receive > started:
                return 200
        return 503
    finally:
        task.cancel()


def create_fake_app(backend: FakeBackend | None = None) -> FastAPI:
    fake = backend or FakeBackend()

    async def abort(body: AbortRequestBody) -> None:
        fake.abort(body.rid, body.abort_all)

    app = sglang_app(
        "fake sglang",
        "fake",
        generate=lambda req: generate_response(lambda r: fake.run(r, stream=r.stream), req),
        abort=abort,
        pause=fake.pause,
        resume=fake.resume,
        update=fake.update,
        weight_version=lambda: fake.weight_version,
        health=lambda: health_probe(fake),
        on_body=fake.bodies.append if fake.record_bodies else None,
        load_lora=fake.lora.load if fake.lora else None,
        unload_lora=fake.lora.unload if fake.lora else None,
        loaded_loras=fake.lora.loaded if fake.lora else None,
    )
    app.state.fake = fake
    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="fake SGLang server (timing model)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tokens-per-s", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=1)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    args = p.parse_args()
    backend = FakeBackend(
        vocab_size=args.vocab_size,
        tokens_per_s=args.tokens_per_s,
        chunk_tokens=args.chunk_tokens,
        incremental=args.incremental_streaming_output,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
    )
    uvicorn.run(
        create_fake_app(backend),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
