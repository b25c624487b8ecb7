"""The engine's worker thread: the only code that runs the model.

Each iteration of the loop:

1. drain the inbox (new requests and control commands; block when idle),
2. unless paused: prefill waiting requests one at a time, while the running
   batch has room and the iteration's prefill token budget lasts,
3. unless paused: one batched decode step for every running row,
4. post the step's deltas to the event loops.

Commands (abort, pause, continue, weight update, shutdown) are applied between
steps, so a weight update never lands mid-forward. Control commands carry a
``concurrent.futures.Future`` the asyncio side awaits.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
from proxima.proxy.embedded.kv_cache import BatchKVCache
from proxima.proxy.embedded.logits import transform_logits
from proxima.proxy.embedded.lora import LoRAHooks
from proxima.proxy.embedded.requests import (
    DeltaSink,
    GenerationDelta,
    WorkerRequest,
    finish_abort,
    finish_length,
    post_deltas,
)
from proxima.proxy.embedded.sampling import SampledToken, sample_batch
from proxima.proxy.embedded.weights import apply_state_dict, swap_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache

logger = logging.getLogger(__name__)


@dataclass
class Submit:
    """Queue a new request."""

    request: WorkerRequest


@dataclass
class Abort:
    """Abort one request by rid, or all of them (waiting ones included)."""

    rid: str | None
    abort_all: bool
    done: Future[int] = field(default_factory=Future)


@dataclass
class Pause:
    """Stop admitting and stepping; ``abort`` mode also aborts the running rows."""

    mode: Literal["abort", "in_place"]
    done: Future[int] = field(default_factory=Future)


@dataclass
class Resume:
    """Undo :class:`Pause`."""

    done: Future[int] = field(default_factory=Future)


@dataclass
class UpdateWeights:
    """Copy a checked state dict into the model between two steps (``swap``: point the
    model at its tensors instead, ``weights.swap_state_dict``)."""

    state_dict: dict[str, torch.Tensor]
    weight_version: str | None
    abort_all: bool
    done: Future[int] = field(default_factory=Future)
    swap: bool = False


@dataclass
class Shutdown:
    """Abort everything and end the thread."""

    done: Future[int] = field(default_factory=Future)


Command = Submit | Abort | Pause | Resume | UpdateWeights | Shutdown


@dataclass
class WorkerStats:
    """Counters the worker updates (read from other threads for monitoring and tests)."""

    prefills: int = 0
    decode_steps: int = 0
    decoded_tokens: int = 0
    peak_batch_size: int = 0


class EngineWorker:
    """Owns the model, the running batch and its KV cache; runs on its own thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        weight_version: str,
        max_running_requests: int,
        max_prefill_tokens: int,
        lora: LoRAHooks | None = None,
        max_loras_per_batch: int = 8,
    ) -> None:
        self.model = model
        self.lora = lora
        self.max_loras_per_batch = max_loras_per_batch
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._waiting: deque[WorkerRequest] = deque()
        self._rows: list[WorkerRequest] = []
        self._cache = BatchKVCache(model.config.get_text_config().num_hidden_layers)
        self._outbox: list[tuple[DeltaSink, GenerationDelta]] = []
        self._paused = False
        self._stopping = False
        self.stats = WorkerStats()
        self._thread = threading.Thread(target=self._run, name="proxima-engine-worker", daemon=True)

    # ---- called from other threads -------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def send(self, command: Command) -> None:
        """Queue a command for the worker (thread-safe, never blocks)."""
        self._inbox.put(command)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after :class:`Shutdown`)."""
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()

    @property
    def num_running(self) -> int:
        """Rows in the running batch (a racy read, for monitoring only)."""
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (a racy read, for monitoring only)."""
        return len(self._waiting)

    # ---- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("engine worker started (max_running_requests=%d)", self.max_running_requests)
        with torch.inference_mode():
            while not self._stopping:
                has_work = not self._paused and bool(self._rows or self._waiting)
                self._drain_inbox(block=not has_work)
                if not self._paused and not self._stopping:
                    self._admit_waiting()
                    if self._rows:
                        self._guarded(self._decode_step)
                self._flush()
        logger.info("engine worker stopped")

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run a model step; if it raises, log it and abort the running rows.

        The worker must outlive one failed step: a dead thread would leave every
        client waiting forever. The error is logged with its traceback and each
        affected request ends with an ``abort`` that carries the message.
        """
        try:
            step()
        except Exception as exc:
            logger.exception("engine step failed; aborting %d running requests", len(self._rows))
            self._abort_rows(lambda _: True, f"engine error: {exc!r}")

    def _drain_inbox(self, *, block: bool) -> None:
        command: Command | None = self._inbox.get() if block else None
        while True:
            if command is None:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return
            self._handle(command)
            command = None

    def _handle(self, command: Command) -> None:
        match command:
            case Submit(request=request):
                self._waiting.append(request)
            case Abort(rid=rid, abort_all=abort_all, done=done):
                matches = (lambda _: True) if abort_all else (lambda r: r.rid == rid)
                done.set_result(self._abort(matches, "aborted by request"))
            case Pause(mode=mode, done=done):
                self._paused = True
                aborted = (
                    self._abort_rows(lambda _: True, "generation paused") if mode == "abort" else 0
                )
                done.set_result(aborted)
            case Resume(done=done):
                self._paused = False
                done.set_result(0)
            case UpdateWeights(done=done) as update:
                aborted = (
                    self._abort_rows(lambda _: True, "weights updated") if update.abort_all else 0
                )
                try:
                    if update.swap:
                        swap_state_dict(self.model, update.state_dict)
                    else:
                        apply_state_dict(self.model, update.state_dict)
                except (RuntimeError, ValueError) as exc:  # checked beforehand; report, don't die
                    logger.exception("applying new weights failed")
                    done.set_exception(exc)
                    return
                if update.weight_version is not None:
                    self.weight_version = update.weight_version
                logger.info("weights updated to version %s", self.weight_version)
                done.set_result(aborted)
            case Shutdown(done=done):
                self._stopping = True
                done.set_result(self._abort(lambda _: True, "engine shutting down"))

    # ---- scheduling -----------------------------------------------------------------

    def _admit_waiting(self) -> None:
        budget = self.max_prefill_tokens
        skipped: list[WorkerRequest] = []  # their adapter would exceed max_loras_per_batch
        while self._waiting and len(self._rows) < self.max_running_requests:
            request = self._waiting[0]
            if len(request.prompt_ids) > budget and budget < self.max_prefill_tokens:
                break  # at least one prefill per iteration, then keep decode latency bounded
            self._waiting.popleft()
            if not self._adapter_fits(request):
                skipped.append(request)
                continue
            budget -= len(request.prompt_ids)
            if request.max_new_tokens == 0:
                request.finish_reason = finish_length(0)
                self._emit(request)
                continue
            self._prefill(request)
        self._waiting.extendleft(reversed(skipped))  # they keep their place in the queue

    def _adapter_fits(self, request: WorkerRequest) -> bool:
        """Whether the batch can take the request's adapter: at most ``max_loras_per_batch``
        distinct adapters run at once (SGLang's rule); base rows always fit."""
        if request.adapter is None:
            return True
        running = {r.adapter.lora_id for r in self._rows if r.adapter is not None}
        return request.adapter.lora_id in running or len(running) < self.max_loras_per_batch

    def _prefill(self, request: WorkerRequest) -> None:
        """Run one request's prompt alone, sample its first token, and add it to the batch."""
        prefill_cache = DynamicCache()
        input_ids = torch.tensor([request.prompt_ids])  # (1, L)
        try:
            if self.lora is not None:
                self.lora.set_rows([request.adapter])
            out = self.model(
                input_ids=input_ids, past_key_values=prefill_cache, use_cache=True, logits_to_keep=1
            )
            token = self._sample([request], out.logits[:, -1])[0]  # logits (1, V)
            request.append(token, self._stop_decoder(request))
        except Exception as exc:
            # Only this request is affected: log the traceback and end it with the message.
            logger.exception("prefill failed for request %s", request.rid)
            request.finish_reason = finish_abort(f"engine error during prefill: {exc!r}")
            self._emit(request)
            return
        self.stats.prefills += 1
        if request.finish_reason is None:
            # Each (1, H_kv, L, D); a layer that ran prefill holds its keys and values.
            keys = [layer.keys for layer in prefill_cache.layers if layer.keys is not None]
            values = [layer.values for layer in prefill_cache.layers if layer.values is not None]
            self._cache.add_row(keys, values)
            self._rows.append(request)
        self._emit(request)

    def _decode_step(self) -> None:
        """One forward pass for all running rows: one new token each."""
        rows = self._rows
        input_ids = torch.tensor([[r.output_ids[-1]] for r in rows])  # (B, 1)
        position_ids = torch.tensor([[r.num_cached_tokens] for r in rows])  # (B, 1)
        attention_mask = self._cache.step_attention_mask()  # (B, 1, 1, T + 1)
        if self.lora is not None:
            self.lora.set_rows([r.adapter for r in rows])
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self._cache.as_hf_cache(),
            use_cache=True,
        )
        self._cache.commit()
        tokens = self._sample(rows, out.logits[:, -1])  # logits (B, V)
        self.stats.decode_steps += 1
        self.stats.decoded_tokens += len(rows)
        self.stats.peak_batch_size = max(self.stats.peak_batch_size, len(rows))
        for request, token in zip(rows, tokens, strict=True):
            try:
                request.append(token, self._stop_decoder(request))
            except Exception as exc:  # one row's failure ends that row only
                logger.exception("decode failed for request %s", request.rid)
                request.finish_reason = finish_abort(f"engine error: {exc!r}")
            self._emit(request)
        self._drop_finished_rows()

    def _sample(self, requests: list[WorkerRequest], logits: torch.Tensor) -> list[SampledToken]:
        """Next tokens of ``requests`` from their logits ``(B, V)``, after each row's transforms."""
        logits = transform_logits(
            logits,
            [r.params for r in requests],
            [r.output_ids for r in requests],
            [r.grammar for r in requests],
        )
        return sample_batch(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.top_logprobs_num for r in requests],
        )

    def _stop_decoder(self, request: WorkerRequest) -> Callable[[list[int]], str]:
        skip = request.params.skip_special_tokens
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)

    # ---- finishing ------------------------------------------------------------------

    def _abort(self, matches: Callable[[WorkerRequest], bool], message: str) -> int:
        """Abort matching requests, waiting and running; returns how many."""
        aborted = 0
        for request in [r for r in self._waiting if matches(r)]:
            self._waiting.remove(request)
            request.finish_reason = finish_abort(message)
            self._emit(request)
            aborted += 1
        return aborted + self._abort_rows(matches, message)

    def _abort_rows(self, matches: Callable[[WorkerRequest], bool], message: str) -> int:
        aborted = 0
        for request in self._rows:
            if request.finish_reason is None and matches(request):
                request.finish_reason = finish_abort(message)
                self._emit(request)
                aborted += 1
        self._drop_finished_rows()
        return aborted

    def _drop_finished_rows(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        if len(keep) != len(self._rows):
            self._cache.keep_rows(keep)
            self._rows = [self._rows[i] for i in keep]

    def _emit(self, request: WorkerRequest) -> None:
        """Queue the request's delta: every step when streaming, else only when it ended.

        Each delivery wakes the event loop thread, which then competes with this
        thread for the GIL; skipping per-step deltas of non-streaming requests
        keeps the decode loop fast under load.
        """
        if request.finish_reason is not None or (request.stream and request.pending):
            self._outbox.append((request.sink, request.take_delta(self.weight_version)))

    def _flush(self) -> None:
        if self._outbox:
            post_deltas(self._outbox)
            self._outbox = []
