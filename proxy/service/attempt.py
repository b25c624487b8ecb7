"""One backend request of a completion: its rid, its tokens' versions, and how it ended.

The generation loop (``proxima.proxy.service.generation``) sends a completion to the
backends as one request per attempt: each has a prefix-free rid (``backend_rid``); its
stream's deltas become token chunks labelled with the policy version that produced them
(``Attempt.take``), a stop string that straddles the resume is found on the joined text
(``BoundaryStops``), and an abort that carries a status is the OpenAI error it stands for
(``abort_error``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxima.proxy.backends.errors import BackendUnavailable
from proxima.proxy.backends.pool import Backend, reported_version
from proxima.proxy.backends.protocol import FinishReason
from proxima.proxy.backends.sglang import NonFiniteLogprob, TokenDelta
from proxima.proxy.errors import BadRequest, ContextTooLong, ProximaError, RateLimited
from proxima.proxy.rendering.sampling import Sampling
from proxima.proxy.rendering.structured import Grammar

RID_END = "#"


def backend_rid(base: str, attempt: int) -> str:
    """The rid of one backend request: no such rid is a prefix of another.

    SGLang's ``/abort_request`` aborts every request whose rid starts with the
    given one. Each rid here ends with ``RID_END`` and holds it nowhere else,
    so a proper prefix of one rid (which would end with ``RID_END``) is never
    another rid: an abort never hits a neighbour (``chatcmpl-x-1`` of choice
    0's second attempt vs ``chatcmpl-x-1-0`` of choice 1).
    """
    return f"{base.replace(RID_END, '_')}-{attempt}{RID_END}"


def abort_error(finish: FinishReason, grammar: Grammar | None = None) -> ProximaError:
    """The OpenAI error for an abort that carries a status (a scheduler-side failure).

    A constrained request's other 4xx is its grammar's (all else was checked
    here): the error names the field the grammar enforces.
    """
    status = finish.status_code or 500
    message = f"The inference backend refused the request: {finish.message or finish.err_type}"
    if status == 429:
        return RateLimited(message)
    if 400 <= status < 500:
        if "length" in (finish.message or "").lower():
            return ContextTooLong(message)
        return BadRequest(message, param=None if grammar is None else grammar.param)
    return BackendUnavailable(message)


class BoundaryStops:
    """Stop strings that straddle an interruption, which SGLang cannot see.

    After a resume, SGLang's output holds only the new tokens, so a stop string
    that began before the interruption is missed. A match must end within
    ``max(len(stop)) - 1`` characters after the boundary, so only the first few
    new tokens are decoded (with a window of old tokens before them).
    """

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str], ids: list[int]):
        self.stops = stops
        self.decode = decode
        self.longest = max(len(s) for s in stops)
        self.window = ids[-(self.longest + 4) :]  # old tokens: enough for longest - 1 chars
        self.before = len(decode(self.window))
        self.done = False

    def find(self, new_ids: list[int]) -> tuple[int, str] | None:
        """``(tokens to keep, stop)`` when a straddling stop string completes in ``new_ids``."""
        for i, token in enumerate(new_ids):
            if self.done:
                return None
            self.window.append(token)
            text = self.decode(self.window)
            for stop in self.stops:
                at = text.find(stop, max(0, self.before - len(stop) + 1))
                if 0 <= at < self.before:  # begins before the boundary, ends after it
                    return i + 1, stop
            # Past this point a match would lie wholly in the new output: SGLang sees it.
            self.done = len(text) - self.before >= self.longest
        return None


class Attempt:
    """One backend request of a completion: turns stream deltas into token chunks."""

    def __init__(
        self,
        backend: Backend,
        rid: str,
        boundary: BoundaryStops | None,
        *,
        version: int,
        label: int | None = None,
    ):
        self.backend = backend
        self.rid = rid
        self.boundary = boundary
        self.version = version  # the pool's (base weights') version when the attempt started
        self.label = label  # an adapter request's adapter version: what its tokens carry
        self.finish: FinishReason | None = None
        self.straddled = False
        self.stale: int | None = None  # the older version the backend generated with
        self.held: list[TokenDelta] = []  # a constrained attempt's tokens, until it finishes
        self.resume = False  # it failed, and the completion resumes (counted already)
        self.broken: NonFiniteLogprob | None = None  # an adapter's non-finite logprob
        self._last_label: str | None = None  # the last chunk's weight_version, and its
        self._last_version = 0  # version (parsed once, not per token)

    def take(self, delta: TokenDelta, params: Sampling) -> TokenDelta | None:
        """The delta with each token's version, or None when it has no tokens (or comes
        from stale weights).

        Every healthy backend serves the pool's version when an attempt starts, so
        tokens of an older version come from a backend that restarted with its
        start-up weights since it was last checked: ``stale`` is set and the
        caller drops the attempt.
        """
        self.backend.last_ok = time.monotonic()  # it answers: no health probe needed
        label = delta.weight_version
        if label is None:  # a server that does not label its chunks
            version = self.backend.version if self.backend.version is not None else self.version
        elif label == self._last_label:  # the same label as the chunk before: its version
            version = self._last_version
        else:
            version = self._last_version = reported_version(label)
            self._last_label = label
        if version < self.version:
            self.stale = version
            return None
        found = self.boundary.find(delta.token_ids) if self.boundary else None
        if found is not None:
            keep, stop = found
            del delta.token_ids[keep:], delta.logprobs[keep:], delta.top_logprobs[keep:]
            delta.finish_reason = FinishReason(type="stop", matched=stop)
            self.straddled = True
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
        if not delta.token_ids:
            return None
        if self.label is not None:
            version = self.label
        delta.versions = [version] * len(delta.token_ids)
        if not params.top_logprobs and delta.top_logprobs:
            delta.top_logprobs = []  # not asked for: none kept (read by index where used)
        return delta
