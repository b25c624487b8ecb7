"""The generation driver: ``n`` interruptible generations in, API-neutral events out.

One driver serves every API surface. For a ``Prepared`` request it runs
``n`` choices concurrently (``proxima.proxy.service.generation.generate``), and

- streaming: multiplexes their tokens as they arrive, detokenizes each
  choice incrementally, runs its tool-call stream parser, and yields
  ``Delta`` events (text pieces, tool-call pieces, logprobs);
- not streaming: waits for every choice and decodes each reply at once.

Either way, when every choice has finished it hands them to ``commit`` (the
service records them) and only then reports them (``Finish``, ``Done``): a
client never sees the end of a completion that is not durable.

Failures and disconnects:

- a failure once a stream has started (a backend error, the store refusing
  the commit because a trainer took the session, a bug) ends it with a
  ``Failed`` event, never a dropped connection;
- cancelling (the client went away) before every choice has finished
  cancels each choice, which aborts its backend request, and nothing is
  recorded; a commit that has started is finished (shielded), so a
  completion is recorded exactly when its generation ended before the client
  left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.sglang import TokenDelta
from proxima.proxy.errors import as_proxima_error
from proxima.proxy.logs import note_request
from proxima.proxy.rendering.detokenize import IncrementalDetokenizer
from proxima.proxy.rendering.reasoning import ReasoningDelta, ReasoningStream
from proxima.proxy.service.events import (
    Completion,
    Delta,
    Done,
    Event,
    Failed,
    Finish,
    Part,
    TokenLogprob,
    Usage,
)
from proxima.proxy.service.generation import GenerationResult, OnBrokenAdapter, generate
from proxima.proxy.service.prepare import Prepared
from proxima.proxy.tools import (
    ContentDelta,
    NoToolParser,
    ParsedOutput,
    ToolCallStream,
    apply_tool_choice,
    finish_reason_for,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceRun:
    """Everything one choice accumulates while it is generated."""

    index: int
    completion_id: str
    result: GenerationResult = field(default_factory=GenerationResult)
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    def saw_tokens(self) -> None:
        """Note the time of the first tokens (for time to first token)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()


# Called with every finished choice once all are done; returns when they are durable.
Commit = Callable[[Prepared, list[tuple[ChoiceRun, Finish]]], Awaitable[None]]
# Called once when a stream ends: its outcome and how many tokens it generated.
Observe = Callable[[str, int], None]


class GenerationDriver:
    def __init__(
        self,
        *,
        pool: BackendPool,
        tokenizer: Any,
        on_broken_adapter: OnBrokenAdapter | None = None,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.on_broken_adapter = on_broken_adapter  # AdapterGuard.fall_back
        self._token_text_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ entry points
    async def complete(self, prep: Prepared, commit: Commit) -> Completion:
        """Generate every choice, commit them, and return them."""
        runs = self._runs(prep)
        await _gather_or_cancel([self._drain(prep, run) for run in runs])
        finished = [(run, self._finish_whole(prep, run)) for run in runs]
        await asyncio.shield(commit(prep, finished))
        return Completion(
            choices=[f for _, f in finished],
            usage=self._usage(prep, runs),
            policy_version=self._pool(prep).policy(prep.adapter)[0],
        )

    async def stream(
        self, prep: Prepared, commit: Commit, observe: Observe | None = None
    ) -> AsyncIterator[Event]:
        """Events as tokens arrive; ``Finish`` and ``Done`` only after ``commit``.

        ``observe(outcome, completion_tokens)`` is called once when the stream ends
        (``ok``, ``error``, or ``cancelled``: the client left).
        """
        runs = self._runs(prep)
        outcome, tokens = "cancelled", 0
        try:
            states = {run.index: _StreamState(self.tokenizer, prep) for run in runs}
            finished: list[tuple[ChoiceRun, Finish]] = []
            if len(runs) == 1:
                # One choice (the common case): its tokens straight from ``generate``,
                # without the layers (and their cost per token) that merge several.
                (run,) = runs
                state = states[run.index]
                # A plain reply without logprobs (the common one): ``_delta``'s event, inline.
                add = state.detok.add if state.plain and not prep.logprobs else None
                streamed, index = state.streamed, run.index
                async with aclosing(self._generate(prep, run)) as chunks:
                    async for chunk in chunks:
                        if run.first_token_at is None:  # saw_tokens, inline: once per event
                            run.first_token_at = time.monotonic()
                        if add is not None:
                            text = add(chunk.token_ids)
                            if text:
                                streamed.append(text)
                                yield Delta(index, [ContentDelta(text)])
                            else:
                                yield Delta(index, [])
                        else:
                            yield self._delta(prep, run, state, chunk)
                finished.append((run, state.finish(prep, run)))
            else:
                async for run, piece in self._multiplex(prep, runs):
                    state = states[run.index]
                    if piece is not None:
                        yield self._delta(prep, run, state, piece)
                    else:
                        finished.append((run, state.finish(prep, run)))
            await asyncio.shield(commit(prep, finished))
            for _, finish in finished:
                yield finish
            usage = self._usage(prep, runs)
            outcome, tokens = "ok", usage.completion_tokens
            yield Done(usage, self._pool(prep).policy(prep.adapter)[0])
        except Exception as exc:  # the response has started: it ends with an error event
            outcome = "error"
            error = as_proxima_error(exc)
            note_request(error=error.message)  # the request log: the stream's status was 200
            if error is exc:
                logger.warning("stream %s failed: %s", prep.response_id, error.message)
            else:
                logger.exception("stream %s failed", prep.response_id)
            yield Failed(error)
        finally:
            if observe is not None:
                observe(outcome, tokens)

    def _delta(
        self, prep: Prepared, run: ChoiceRun, state: _StreamState, chunk: TokenDelta
    ) -> Delta:
        parts = state.feed(chunk.token_ids)
        return Delta(run.index, parts, self._logprobs(chunk) if prep.logprobs else None)

    # --------------------------------------------------------------------- choices
    def _pool(self, prep: Prepared) -> BackendPool:
        """The pool of the request's deployment (the default pool without one)."""
        return prep.deployment.pool if prep.deployment is not None else self.pool

    def _runs(self, prep: Prepared) -> list[ChoiceRun]:
        return [ChoiceRun(i, cid) for i, cid in enumerate(prep.completion_ids)]

    def _generate(self, prep: Prepared, run: ChoiceRun) -> AsyncGenerator[TokenDelta]:
        """One choice's generation (its result accumulates the tokens)."""
        return generate(
            self._pool(prep),
            prompt_ids=prep.prompt_ids,
            params=prep.params,
            result=run.result,
            sticky_key=prep.session.id if prep.session else None,
            request_id=run.completion_id,
            adapter=prep.adapter,
            on_broken_adapter=self.on_broken_adapter,
        )

    async def _tokens(self, prep: Prepared, run: ChoiceRun) -> AsyncIterator[TokenDelta]:
        """One choice's tokens as they arrive, the time of its first one noted."""
        async for tokens in self._generate(prep, run):
            run.saw_tokens()
            yield tokens

    async def _drain(self, prep: Prepared, run: ChoiceRun) -> None:
        async for _ in self._tokens(prep, run):
            pass

    async def _multiplex(
        self, prep: Prepared, runs: list[ChoiceRun]
    ) -> AsyncIterator[tuple[ChoiceRun, TokenDelta | None]]:
        """Run every choice; yield ``(run, tokens)`` as they arrive, ``(run, None)`` at its end."""
        queue: asyncio.Queue[tuple[ChoiceRun, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def produce(run: ChoiceRun) -> None:
            try:
                async for tokens in self._tokens(prep, run):
                    await queue.put((run, tokens))
                await queue.put((run, None))
            except Exception as exc:  # re-raised in the consumer, which reports it
                await queue.put((run, exc))

        tasks = [asyncio.create_task(produce(run)) for run in runs]
        try:
            pending = len(runs)
            while pending:
                run, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    pending -= 1
                yield run, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------------- output
    def _finish_whole(self, prep: Prepared, run: ChoiceRun) -> Finish:
        """A non-streamed choice: its reply decoded and parsed in one go."""
        r = run.result
        text = self.tokenizer.decode(
            r.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        if isinstance(r.matched_stop, str) and r.matched_stop:
            cut = text.find(r.matched_stop)
            if cut >= 0:
                text = text[:cut]
        parsed = None
        finish = r.finish_reason or "stop"
        if prep.parser is not None:
            assert prep.tool_choice is not None
            reasoning = None
            if prep.reasoning is not None:
                split = prep.reasoning.parse(text, in_reasoning=prep.in_reasoning)
                reasoning, answer = split.reasoning, split.content
            else:
                answer = text
            parsed = apply_tool_choice(prep.parser.parse(answer), prep.tool_choice)
            parsed = replace(parsed, reasoning=reasoning)
            finish = finish_reason_for(finish, parsed)
        logprobs = (
            self._logprob_list(r.output_ids, r.logprobs, r.top_logprobs) if prep.logprobs else None
        )
        return Finish(
            run.index,
            finish,
            text,
            parsed,
            len(r.output_ids),
            logprobs=logprobs,
            stop_sequence=_stop_string(r),
        )

    def _usage(self, prep: Prepared, runs: list[ChoiceRun]) -> Usage:
        return Usage(
            len(prep.prompt_ids),
            sum(len(run.result.output_ids) for run in runs),
            sum(self._reasoning_tokens(prep, run.result.output_ids) for run in runs),
        )

    def _reasoning_tokens(self, prep: Prepared, ids: list[int]) -> int:
        """How many of ``ids`` are reasoning: up to the end marker, or all if never closed.

        The shortest prefix whose text closes the reasoning, found by bisection
        (a few decodes, not one per token).
        """
        parser = prep.reasoning
        if parser is None or not ids:
            return 0

        def split(k: int) -> Any:
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            return parser.parse(text, in_reasoning=prep.in_reasoning)

        whole = split(len(ids))
        if whole.reasoning is None:
            return 0
        if not whole.closed:
            return len(ids)
        low, high = 1, len(ids)  # split(high) is closed
        while low < high:
            mid = (low + high) // 2
            if split(mid).closed:
                high = mid
            else:
                low = mid + 1
        return high

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def _logprobs(self, chunk: TokenDelta) -> list[TokenLogprob]:
        return self._logprob_list(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)

    def _logprob_list(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> list[TokenLogprob]:
        return [
            TokenLogprob(
                self.token_text(tid),
                lp,
                [(self.token_text(t), tl) for t, tl in (tops[i] if i < len(tops) else [])],
            )
            for i, (tid, lp) in enumerate(zip(ids, lps, strict=False))
        ]


class _StreamState:
    """One streamed choice: incremental text, its reasoning split off, then tool-call parsing."""

    def __init__(self, tokenizer: Any, prep: Prepared) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, stop=prep.params.stop)
        self.reasoning: ReasoningStream | None = (
            prep.reasoning.stream(in_reasoning=prep.in_reasoning)
            if prep.reasoning is not None and prep.parser is not None
            else None
        )
        # No tool calls to find (``none``) and no reasoning to split off: the text is the
        # content as it comes, and the parsed reply is the text streamed (what the ``none``
        # parser's stream would give), with no parser called per event.
        self.plain = isinstance(prep.parser, NoToolParser) and self.reasoning is None
        self.streamed: list[str] = []  # a plain reply's text, as handed out
        self.calls: ToolCallStream | None = (
            prep.parser.stream() if prep.parser and not self.plain else None
        )

    def feed(self, token_ids: list[int]) -> list[Part]:
        text = self.detok.add(token_ids)
        if self.plain:
            if not text:
                return []
            self.streamed.append(text)
            return [ContentDelta(text)]
        return self._parts(text)

    def _parts(self, text: str, *, last: bool = False) -> list[Part]:
        if self.reasoning is None:
            pieces: list[ReasoningDelta | str] = [text] if text else []
        else:
            pieces = self.reasoning.feed(text) + (self.reasoning.finish() if last else [])
        out: list[Part] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                out.append(piece)
            elif self.calls is not None:
                out += self.calls.feed(piece)
            else:
                out.append(ContentDelta(piece))
        return out

    def finish(self, prep: Prepared, run: ChoiceRun) -> Finish:
        r = run.result
        tail = self.detok.finish(r.matched_stop if isinstance(r.matched_stop, str) else None)
        finish = r.finish_reason or "stop"
        parsed = None
        parts: list[Part]
        if self.plain:
            assert prep.tool_choice is not None
            parts = [ContentDelta(tail)] if tail else []
            text = "".join([*self.streamed, tail])
            parsed = apply_tool_choice(ParsedOutput(content=text, tool_calls=[]), prep.tool_choice)
            finish = finish_reason_for(finish, parsed)
        elif self.calls is not None:
            assert prep.tool_choice is not None
            parts = [*self._parts(tail, last=True), *self.calls.finish()]
            parsed = apply_tool_choice(self.calls.result(), prep.tool_choice)
            if self.reasoning is not None and self.reasoning.saw_reasoning:
                parsed = replace(parsed, reasoning="".join(self.reasoning.reasoning))
            finish = finish_reason_for(finish, parsed)
        else:
            parts = [ContentDelta(tail)] if tail else []
        return Finish(
            run.index,
            finish,
            self.detok.text,
            parsed,
            len(r.output_ids),
            tail=parts,
            stop_sequence=_stop_string(r),
        )


def _stop_string(result: GenerationResult) -> str | None:
    matched = result.matched_stop
    return matched if isinstance(matched, str) and matched else None


async def _gather_or_cancel(coros: list[Any]) -> None:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
