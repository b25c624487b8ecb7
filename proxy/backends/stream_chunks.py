"""SGLang's ``/generate`` stream chunks into token deltas: the hot path of every streamed token.

``ChunkReader.read`` takes the ``data:`` fields one read of the stream completed and returns
the ``TokenDelta`` s they hold: one per run of chunks of one weight version, so that every
token keeps the version that generated it. Its rules are SGLang's (see
``SGLangClient.generate_stream``): default chunks are cumulative; with incremental streaming
they carry deltas, except the abort of a queued request, which repeats the last token; every
chunk's ``completion_tokens`` is the running total, so the new tokens are the last
``completion_tokens - seen`` of its lists in every mode; a chunk without ``meta_info`` is an
error (``BackendRejected``, after the deltas of the chunks before it).

Chunks of the common shape (incremental, one weight version, no top logprobs) are checked and
joined by C-level operations over the whole read (``_incremental``): each chunk's
``completion_tokens`` must be the running total of its ``output_ids``, and its logprobs one per
token; any other read takes the chunk-by-chunk path, which gives the same deltas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import itemgetter, methodcaller
from typing import Any

import orjson
from proxima.proxy.backends.errors import BackendOperationFailed, BackendRejected
from proxima.proxy.backends.protocol import FinishReason


@dataclass(slots=True)
class TokenDelta:
    """Tokens that just arrived, with their logprobs and the policy version of each.

    The one token-delta type from the backend to the driver: the client yields
    one per ``/generate`` stream chunk (or per consecutive chunks that arrived
    together), whatever the server's stream mode, with the chunk's
    ``weight_version`` label, its finish and the prompt's length; the
    generation loop (``proxima.proxy.service.generation``) fills in ``versions``, the
    policy version each token carries, and hands the same object on.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # one per token, set by generation
    weight_version: str | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0


# OpenAI's own floor for a logprob too small to show: SGLang sends top-k
# alternatives of probability zero as JSON null (orjson writes -inf as null).
LOGPROB_FLOOR = -9999.0

DONE = b"[DONE]"
_SHORT = 32  # bytes: a field this short may be [DONE] (with spaces); no chunk is
_first = itemgetter(0)
_isfinite = math.isfinite
_META, _IDS = itemgetter("meta_info"), itemgetter("output_ids")
_TOTAL, _LOGPROBS = itemgetter("completion_tokens"), itemgetter("output_token_logprobs")
_VERSION, _TOPS = methodcaller("get", "weight_version"), methodcaller("get", "output_top_logprobs")


class NonFiniteLogprob(BackendOperationFailed):
    """A sampled token's logprob was null, NaN or inf: the weights served are broken (an
    adapter's: the generation loop may fall the adapter back to its last good version)."""


def chosen_logprobs(entries: list[list[Any]], url: str) -> list[float]:
    """The sampled tokens' logprobs; a null or non-finite one is the backend's fault.

    A sampled token cannot have probability zero, so null (orjson's -inf or
    NaN) or NaN means broken weights or numerics: refused, never recorded.
    """
    values = list(map(_first, entries))
    try:
        if all(map(math.isfinite, values)):  # one C pass: the hot path
            return values
    except TypeError:  # a null
        pass
    for value, entry in zip(values, entries, strict=True):
        if value is None or not math.isfinite(value):
            raise NonFiniteLogprob(
                f"the backend returned a non-finite logprob ({value!r}) for token {entry[1]}; "
                "its weights or numerics are broken (NaN weights?)",
                url=url,
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _top_pairs(entry: list[list[Any]] | None, url: str) -> list[tuple[int, float]]:
    pairs = []
    for lp, token, *_ in entry or []:
        if lp is None or lp == -math.inf:
            lp = LOGPROB_FLOOR  # probability zero
        elif not math.isfinite(lp):
            raise BackendOperationFailed(
                f"the backend returned a non-finite top logprob ({lp!r}) for token {token}",
                url=url,
            )
        pairs.append((int(token), max(float(lp), LOGPROB_FLOOR)))
    return pairs


def _tail(values: list[Any], n: int) -> list[Any]:
    return values[len(values) - n :] if n else []


def _parse(fields: list[bytes], url: str) -> list[Any]:
    """Each field's JSON, parsed as one array (about half the cost per chunk of one call
    each); a field that is not one JSON value is a ``BackendOperationFailed``."""
    try:
        if len(fields) > 1:
            chunks: list[Any] = orjson.loads(b"[" + b",".join(fields) + b"]")
            if len(chunks) == len(fields):
                return chunks
        return list(map(orjson.loads, fields))  # one, or to find the one at fault
    except orjson.JSONDecodeError as exc:
        raise BackendOperationFailed(f"malformed /generate chunk: {exc}", url=url) from exc


def error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class ChunkReader:
    """One ``/generate`` stream's chunks, read by read: the tokens seen so far, whether
    ``[DONE]`` came (fields after it are ignored), and an error chunk's error."""

    def __init__(self, url: str):
        self.url = url
        self.seen = 0
        self.done = False
        self.failure: BackendRejected | None = None  # an error chunk's, once read

    def read(self, fields: list[bytes]) -> list[TokenDelta]:
        """The deltas of one read's ``data:`` fields (module docstring). An error chunk
        ends them: the deltas of the chunks before it are returned and the error is left in
        ``failure``, for the caller to raise once it has handed them on."""
        if self.done or not fields:
            return []
        if len(fields) == 1:  # the proxy keeps up with the backend: one chunk per read
            field = fields[0]
            if len(field) <= _SHORT and field.strip() == DONE:
                self.done = True
                return []
            try:
                chunk = orjson.loads(field)  # ``_parse`` of one field, inline
            except orjson.JSONDecodeError as exc:
                raise BackendOperationFailed(
                    f"malformed /generate chunk: {exc}", url=self.url
                ) from exc
            try:
                fast = self._one(chunk)
            except (KeyError, TypeError):  # an error chunk, a missing list
                fast = None
            return [fast] if fast is not None else self._general([chunk])
        if min(map(len, fields)) <= _SHORT:  # every chunk is longer: this may be [DONE]
            at = next((i for i, f in enumerate(fields) if f.strip() == DONE), None)
            if at is not None:
                fields = fields[:at]
                self.done = True
                if not fields:
                    return []
        chunks = _parse(fields, self.url)
        try:
            fast = self._one(chunks[0]) if len(chunks) == 1 else self._incremental(chunks)
        except (KeyError, TypeError):  # an error chunk, a missing list: the general path
            fast = None
        return [fast] if fast is not None else self._general(chunks)

    def _one(self, chunk: Any) -> TokenDelta | None:
        """``_incremental`` of a read that completed one chunk: the common case when the
        proxy keeps up with the backend, so the cheapest (``KeyError`` or ``TypeError``
        for a chunk without the lists)."""
        meta = chunk["meta_info"]
        ids = chunk["output_ids"]
        entries = meta["output_token_logprobs"]
        total = meta["completion_tokens"]
        n = len(ids)
        if total - self.seen != n or len(entries) != n or meta.get("output_top_logprobs"):
            return None
        self.seen = total
        if n == 1:  # one token per chunk, as a GPU's decode steps come: no map
            value = entries[0][0]
            values = [value]
            finite = type(value) is float and _isfinite(value)
        else:
            values = list(map(_first, entries))
            try:
                finite = all(map(_isfinite, values))
            except TypeError:  # a null
                finite = False
        finish = meta.get("finish_reason")
        return TokenDelta(
            ids,
            values if finite else chosen_logprobs(entries, self.url),
            [],
            [],
            meta.get("weight_version"),
            FinishReason.model_validate(finish) if finish else None,
            meta.get("prompt_tokens", 0),
        )

    def _incremental(self, chunks: list[Any]) -> TokenDelta | None:
        """The one delta of incremental chunks of one weight version without top logprobs,
        or None when the read is not of that shape (checked here, whole-read operations:
        ``KeyError`` or ``TypeError`` for a chunk without the lists)."""
        metas = list(map(_META, chunks))
        ids = list(map(_IDS, chunks))
        totals = list(map(_TOTAL, metas))
        entries = list(map(_LOGPROBS, metas))
        if len(set(map(_VERSION, metas))) != 1 or any(map(_TOPS, metas)):
            return None
        lengths = list(map(len, ids))
        if list(accumulate(lengths, initial=self.seen))[1:] != totals:
            return None  # cumulative chunks, an abort's repeated token, or inconsistent
        if list(map(len, entries)) != lengths:
            return None
        self.seen = totals[-1]
        return self._made(
            list(chain.from_iterable(ids)), list(chain.from_iterable(entries)), metas[-1]
        )

    def _made(self, ids: list[int], entries: list[list[Any]], last: dict[str, Any]) -> TokenDelta:
        """The delta of ``ids`` and their logprob entries, finished as ``last`` says."""
        finish = last.get("finish_reason")
        return TokenDelta(
            token_ids=ids,
            logprobs=chosen_logprobs(entries, self.url),
            weight_version=last.get("weight_version"),
            finish_reason=FinishReason.model_validate(finish) if finish else None,
            prompt_tokens=last.get("prompt_tokens", 0),
        )

    def _general(self, chunks: list[Any]) -> list[TokenDelta]:
        """Chunk by chunk: any stream mode, several weight versions, an error chunk (its
        error left in ``failure``, after the deltas of the chunks before it)."""
        deltas: list[TokenDelta] = []
        group: list[tuple[list[int], dict[str, Any], int]] = []  # one weight version
        for chunk in chunks:
            meta = chunk.get("meta_info")
            if meta is None:
                self.failure = BackendRejected(error_text(chunk.get("error", chunk)), url=self.url)
                break
            if group and meta.get("weight_version") != group[0][1].get("weight_version"):
                deltas.append(self._delta(group))
                group = []
            ids = chunk.get("output_ids") or []
            total = meta.get("completion_tokens")
            new = len(ids) if total is None else total - self.seen
            if not 0 <= new <= len(ids):
                raise BackendOperationFailed(
                    f"inconsistent /generate chunk: {len(ids)} output ids, "
                    f"completion_tokens {total}, {self.seen} tokens seen before",
                    url=self.url,
                )
            group.append((ids, meta, new))
            self.seen += new
        if group:
            deltas.append(self._delta(group))  # what came before an error was generated
        return deltas

    def _delta(self, group: list[tuple[list[int], dict[str, Any], int]]) -> TokenDelta:
        """One delta for consecutive chunks of one weight version: ``(output_ids, meta_info,
        new token count)`` each. Plain dict access, not pydantic: default SGLang chunks are
        cumulative, so validating each one would cost O(n^2) over a generation."""
        token_ids: list[int] = []
        entries: list[list[Any]] = []
        tops: list[list[tuple[int, float]]] = []
        for ids, meta, new in group:
            token_ids += ids if new == len(ids) else _tail(ids, new)  # incremental: all
            lps = meta.get("output_token_logprobs")
            if lps:
                if len(lps) != new:
                    lps = _tail(lps, new)
                    if lps and len(lps) != new:
                        raise BackendOperationFailed(
                            f"/generate chunk has {len(lps)} logprobs for {new} new tokens",
                            url=self.url,
                        )
                entries += lps
            top = meta.get("output_top_logprobs")
            if top:
                tops += [_top_pairs(e, self.url) for e in _tail(top, new)]
        last = group[-1][1]
        finish = last.get("finish_reason")
        return TokenDelta(
            token_ids=token_ids,
            logprobs=chosen_logprobs(entries, self.url) if entries else [],
            top_logprobs=tops,
            weight_version=last.get("weight_version"),
            finish_reason=FinishReason.model_validate(finish) if finish else None,
            prompt_tokens=last.get("prompt_tokens", 0),
        )
