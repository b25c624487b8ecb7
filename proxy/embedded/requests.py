"""Per-request state: what the worker tracks, and the deltas it reports back.

The worker thread owns :class:`WorkerRequest` (nobody else touches it). After
every step it sends each affected request an immutable :class:`GenerationDelta`
through the request's :class:`DeltaSink`; the asyncio side accumulates deltas
into cumulative :class:`GenerationState` snapshots.

Finish reasons use SGLang's shapes::

    {"type": "stop", "matched": <token id | stop string>}
    {"type": "length", "length": <tokens generated>}
    {"type": "abort", "message": <why>}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from proxima.proxy.backends.protocol import SamplingParams
from proxima.proxy.embedded.grammar import RowGrammar
from proxima.proxy.embedded.lora import LoRAAdapter
from proxima.proxy.embedded.sampling import SampledToken

logger = logging.getLogger(__name__)

FinishReason = dict[str, Any]


def finish_stop(matched: int | str) -> FinishReason:
    """Stopped at a stop token (included in the output) or a stop string."""
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> FinishReason:
    """Stopped at ``max_new_tokens`` or at the end of the model's context."""
    return {"type": "length", "length": length}


def finish_abort(message: str) -> FinishReason:
    """Stopped by ``/abort_request``, ``/pause_generation`` or an engine error."""
    return {"type": "abort", "message": message}


GRAMMAR_DEAD_END = (
    "the request's grammar allows no next token: no output satisfies its JSON schema "
    "(e.g. a $ref that only refers to itself)"
)


def finish_grammar_dead_end() -> FinishReason:
    """The request's grammar allows nothing more: its error (HTTP 400), as SGLang reports
    a request's own failure in its stream (an abort with a status), never resumed."""
    return {
        "type": "abort",
        "message": GRAMMAR_DEAD_END,
        "status_code": 400,
        "err_type": "BadRequestError",
    }


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """New tokens of one request from one worker step, and its finish reason if it ended."""

    tokens: tuple[SampledToken, ...]
    finish_reason: FinishReason | None
    weight_version: str


class DeltaSink:
    """Thread-safe delivery of deltas into an asyncio queue owned by one event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_finish: Callable[[], None] | None = None
    ) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self._on_finish = on_finish

    def deliver(self, delta: GenerationDelta) -> None:
        """Called on the event loop thread: enqueue one delta; run ``on_finish`` on the last.

        ``on_finish`` runs even if nobody reads the queue (a client that went away).
        """
        self.queue.put_nowait(delta)
        if delta.finish_reason is not None and self._on_finish is not None:
            self._on_finish()


def post_deltas(batch: list[tuple[DeltaSink, GenerationDelta]]) -> None:
    """From the worker thread: hand a step's deltas to their event loops (one wake-up per loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaSink, GenerationDelta]]] = {}
    for sink, delta in batch:
        by_loop.setdefault(sink.loop, []).append((sink, delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, items)
        except RuntimeError:
            logger.warning("dropping %d engine deltas: event loop closed", len(items))


def _deliver_all(items: list[tuple[DeltaSink, GenerationDelta]]) -> None:
    for sink, delta in items:
        sink.deliver(delta)


@dataclass(eq=False)
class WorkerRequest:
    """A request as the worker sees it, from submission to finish."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs_num: int
    sink: DeltaSink
    generator: torch.Generator
    stop_token_ids: frozenset[int]
    max_new_tokens: int
    """``params.max_new_tokens`` capped so prompt + output fits the context."""
    grammar: RowGrammar | None = None
    """The request's grammar matcher when its output is constrained."""
    stream: bool = False
    """Report tokens every step; otherwise only the final delta is sent (fewer event-loop wake-ups)."""
    adapter: LoRAAdapter | None = None
    """The LoRA adapter this row runs with; None: the base model."""
    output_ids: list[int] = field(default_factory=list)
    pending: list[SampledToken] = field(default_factory=list)
    """Tokens sampled since the last delta was sent."""
    finish_reason: FinishReason | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens in this row's KV cache while it decodes: all but the newest output token."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def append(self, token: SampledToken, decode: Callable[[list[int]], str]) -> None:
        """Record a sampled token and set ``finish_reason`` if it ends the request.

        Order of checks as in SGLang: length, then stop token, then stop string.
        ``decode`` turns output ids into text (for stop strings). A constrained
        request also stops once its grammar admits nothing more (matched: the
        last token). A grammar that allows no token at all ends the request
        with its error (:func:`finish_grammar_dead_end`).
        """
        if self.grammar is not None and not self.grammar.try_accept(token.token_id):
            # Every token was masked: the token was drawn from nothing and is not kept.
            self.finish_reason = finish_grammar_dead_end()
            return
        self.output_ids.append(token.token_id)
        self.pending.append(token)
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = finish_length(len(self.output_ids))
        elif token.token_id in self.stop_token_ids or (
            self.grammar is not None and self.grammar.is_terminated
        ):
            self.finish_reason = finish_stop(token.token_id)
        elif self.params.stop_strings:
            text = decode(self.output_ids)
            for stop in self.params.stop_strings:
                if stop in text:
                    self.finish_reason = finish_stop(stop)
                    break

    def take_delta(self, weight_version: str) -> GenerationDelta:
        """The delta of the tokens sampled since the last call."""
        delta = GenerationDelta(tuple(self.pending), self.finish_reason, weight_version)
        self.pending = []
        return delta
