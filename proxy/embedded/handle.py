"""The asyncio side of one submitted request: its cumulative progress and its result.

``Engine.submit`` returns a :class:`RequestHandle`; the worker thread's deltas reach it
through its ``DeltaSink`` queue, and it turns them into cumulative :class:`GenerationState`
snapshots (``updates`` while streaming, ``result`` at the end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from proxima.proxy.embedded.requests import DeltaSink, FinishReason, GenerationDelta


@dataclass(frozen=True, slots=True)
class GenerationState:
    """Everything generated for one request so far (cumulative)."""

    rid: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_top_logprobs: tuple[tuple[tuple[float, int], ...], ...] | None
    finish_reason: FinishReason | None
    weight_version: str


class _Engine(Protocol):
    """What a handle needs of the engine that runs its request."""

    @property
    def weight_version(self) -> str: ...

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int: ...


class RequestHandle:
    """The asyncio side of one submitted request: read its progress or its result."""

    def __init__(
        self, engine: _Engine, rid: str, prompt_tokens: int, sink: DeltaSink, top: bool
    ) -> None:
        self.rid = rid
        self._engine = engine
        self._sink = sink
        self._prompt_tokens = prompt_tokens
        self._output_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[tuple[tuple[float, int], ...]] | None = [] if top else None
        self._finish_reason: FinishReason | None = None
        self._weight_version = engine.weight_version

    @property
    def finished(self) -> bool:
        """Whether the final delta has arrived."""
        return self._finish_reason is not None

    def snapshot(self) -> GenerationState:
        """The cumulative state now."""
        return GenerationState(
            rid=self.rid,
            prompt_tokens=self._prompt_tokens,
            output_ids=tuple(self._output_ids),
            output_logprobs=tuple(self._logprobs),
            output_top_logprobs=tuple(self._top) if self._top is not None else None,
            finish_reason=self._finish_reason,
            weight_version=self._weight_version,
        )

    async def updates(self) -> AsyncIterator[GenerationState]:
        """Yield a cumulative snapshot whenever new tokens arrive, the last one finished.

        Deltas that queued up while the consumer was busy are merged into one
        snapshot, so a slow reader never falls behind the worker.
        """
        while not self.finished:
            self._apply(await self._sink.queue.get())
            while not self.finished and not self._sink.queue.empty():
                self._apply(self._sink.queue.get_nowait())
            yield self.snapshot()

    async def result(self) -> GenerationState:
        """Wait for the request to finish and return its final state."""
        while not self.finished:
            self._apply(await self._sink.queue.get())
        return self.snapshot()

    async def abort(self) -> None:
        """Abort this request if it is still running."""
        if not self.finished:
            await self._engine.abort(self.rid)

    def _apply(self, delta: GenerationDelta) -> None:
        for token in delta.tokens:
            self._output_ids.append(token.token_id)
            self._logprobs.append(token.logprob)
            if self._top is not None:
                self._top.append(tuple(token.top_logprobs or ()))
        self._weight_version = delta.weight_version
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
