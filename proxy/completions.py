"""Chat and text completions: render, generate, parse tool calls, record.

``CompletionService`` is what the OpenAI routes call. Per request it

1. validates the request and normalizes the messages;
2. finds the session (session key, or a recorded production session);
3. builds the prompt token-exactly from the session's earlier completions
   (``proxima.proxy.chat``), checks it against the context window;
4. runs ``n`` interruptible generations (``proxima.proxy.generation``), streaming
   deltas as tokens arrive or collecting them;
5. parses tool calls (``proxima.proxy.tools``) and commits each completion to the
   store *before* the response ends, so an acknowledged completion is never
   lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from proxima.proxy.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from proxima.proxy.auth import Principal, PrincipalKind
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.chat import ChatRenderer, InvalidMessages, normalize_messages
from proxima.proxy.config import Settings
from proxima.proxy.detokenize import IncrementalDetokenizer
from proxima.proxy.errors import BadRequest, Conflict, ContextTooLong, NotFound, ProximaError
from proxima.proxy.generation import GenerationParams, GenerationResult, TokenChunk, generate
from proxima.proxy.logs import session_id_var
from proxima.proxy.metrics import Metrics
from proxima.proxy.recorder import CompletionRecorder, SessionCache
from proxima.proxy.store.records import CompletionRecord, SessionRecord, SessionStatus
from proxima.proxy.store.store import Store
from proxima.proxy.tools import (
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolCallParser,
    apply_tool_choice,
    finish_reason_for,
    get_tool_parser,
    parser_for_choice,
    resolve_tool_choice,
)

logger = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


@dataclass(slots=True)
class _Choice:
    """Everything one choice accumulates while it is generated."""

    index: int
    completion_id: str
    result: GenerationResult = field(default_factory=GenerationResult)
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None


@dataclass(slots=True)
class _Prepared:
    """A validated request, ready to generate."""

    response_id: str
    created: int
    prompt_ids: list[int]
    parent_id: str | None
    params: GenerationParams
    session: SessionRecord | None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    parser: ToolCallParser | None = None
    tool_choice: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)


class CompletionService:
    def __init__(
        self,
        *,
        settings: Settings,
        store: Store,
        pool: BackendPool,
        tokenizer: Any,
        context_length: int,
        recorder: CompletionRecorder,
        cache: SessionCache,
        metrics: Metrics,
    ):
        self.metrics = metrics
        self.settings = settings
        self.store = store
        self.recorder = recorder
        self.cache = cache
        self.pool = pool
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.context_length = context_length
        parser_name = settings.tool_parser or _detect_parser(tokenizer)
        self.tool_parser = get_tool_parser(parser_name)
        self._token_text_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise NotFound(
                f"The model '{model}' does not exist; this server serves "
                f"'{self.settings.model_name}'.",
                param="model",
                code="model_not_found",
            )

    async def _session_for(
        self, principal: Principal, external_id: str | None
    ) -> SessionRecord | None:
        if principal.kind is PrincipalKind.SESSION:
            session = principal.session
            assert session is not None
            if session.status is not SessionStatus.OPEN:
                raise Conflict(
                    f"Session {session.id} is {session.status.value}; open a new session.",
                    code="session_closed",
                )
            return session
        if (
            principal.kind is PrincipalKind.PRODUCTION
            and principal.api_key is not None
            and principal.api_key.record
            and self.settings.record_production
        ):
            return await self.store.get_or_create_production_session(
                api_key_id=principal.api_key.id, external_id=external_id
            )
        return None

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        ctx = self.context_length
        if prompt_len >= ctx:
            raise ContextTooLong(
                f"This model's maximum context length is {ctx} tokens. However, your "
                f"messages resulted in {prompt_len} tokens. Please reduce the length "
                "of the messages.",
                param="messages",
            )
        if requested is None:
            return min(self.settings.default_max_tokens, ctx - prompt_len)
        if requested > self.settings.max_tokens_limit:
            raise BadRequest(
                f"max_tokens is too large: {requested}. This server accepts at most "
                f"{self.settings.max_tokens_limit}.",
                param="max_tokens",
            )
        if prompt_len + requested > ctx:
            raise ContextTooLong(
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages "
                "or completion.",
                param="max_tokens",
            )
        return requested

    def _params(self, req: SamplingFields, max_tokens: int, top_logprobs: int) -> GenerationParams:
        if req.n > self.settings.max_n:
            raise BadRequest(f"n must be at most {self.settings.max_n}.", param="n")
        temperature = 1.0 if req.temperature is None else req.temperature
        return GenerationParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else int(req.top_k),
            stop=req.stop_list,
            seed=req.seed,
            top_logprobs=top_logprobs,
            ignore_eos=req.ignore_eos,
        )

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def _logprob_entries(
        self, chunk_ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> list[dict[str, Any]]:
        entries = []
        for i, (tid, lp) in enumerate(zip(chunk_ids, lps, strict=False)):
            token = self._token_text(tid)
            top = tops[i] if i < len(tops) else []
            entries.append(
                {
                    "token": token,
                    "logprob": lp,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self._token_text(t),
                            "logprob": tl,
                            "bytes": list(self._token_text(t).encode("utf-8")),
                        }
                        for t, tl in top
                    ],
                }
            )
        return entries

    def _decode(self, ids: list[int], matched_stop: int | str | None) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        if isinstance(matched_stop, str) and matched_stop:
            cut = text.find(matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def _completion_ids(self, response_id: str, n: int) -> list[str]:
        return [response_id if i == 0 else f"{response_id}-{i}" for i in range(n)]

    # ------------------------------------------------------------------- chat
    async def prepare_chat(
        self, req: ChatCompletionRequest, principal: Principal, external_id: str | None
    ) -> _Prepared:
        self.check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise BadRequest(
                f"response_format '{req.response_format.type}' is not supported by this "
                "backend; ask for JSON in the prompt instead.",
                param="response_format",
            )
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
        try:
            messages = normalize_messages(req.messages)
        except InvalidMessages as exc:
            raise BadRequest(str(exc), param=getattr(exc, "param", "messages")) from exc
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tool_choice_raw = (
            req.tool_choice.model_dump()
            if hasattr(req.tool_choice, "model_dump")
            else req.tool_choice
        )
        choice = resolve_tool_choice(tool_choice_raw, tools)
        session = await self._session_for(principal, external_id or req.user)
        if session is not None:
            session_id_var.set(session.id)
        history = await self._history(session) if session else []
        # Inline, not in a thread: rendering is short and memoized, and a thread hop
        # costs more in GIL hand-offs than it saves under load.
        plan = self.renderer.build_prompt(messages, tools, history)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self._max_tokens(requested, len(plan.prompt_ids))
        params = self._params(req, max_tokens, req.top_logprobs or 0)
        return _Prepared(
            response_id="chatcmpl-" + uuid.uuid4().hex,
            created=int(time.time()),
            prompt_ids=plan.prompt_ids,
            parent_id=plan.parent_id,
            params=params,
            session=session,
            messages=messages,
            tools=tools,
            parser=parser_for_choice(self.tool_parser, choice),
            tool_choice=choice,
            sampling=_sampling_record(params),
        )

    def _record(
        self,
        prep: _Prepared,
        choice: _Choice,
        *,
        text: str,
        message: dict[str, Any] | None,
        finish: str,
    ) -> CompletionRecord | None:
        if prep.session is None:
            return None
        r = choice.result
        now = time.monotonic()
        return CompletionRecord(
            id=choice.completion_id,
            session_id=prep.session.id,
            parent_id=prep.parent_id,
            prompt_ids=prep.prompt_ids,
            output_ids=r.output_ids,
            output_logprobs=r.logprobs,
            output_versions=r.versions,
            finish_reason=finish,
            created_at=_now(),
            request_messages=prep.messages,
            request_tools=prep.tools,
            response_message=message,
            response_text=text,
            sampling=prep.sampling,
            model=self.settings.model_name,
            choice_index=choice.index,
            finished_at=_now(),
            time_to_first_token=(choice.first_token_at - choice.started)
            if choice.first_token_at
            else None,
            duration=now - choice.started,
            backend=r.backend,
        )

    async def _history(self, session: SessionRecord) -> list[CompletionRecord]:
        history = self.cache.history(session.id)
        if history is None:
            history = await self.store.list_completions(session_id=session.id)
            self.cache.remember_history(session.id, history)
        return history

    async def _commit(self, records: list[CompletionRecord | None]) -> None:
        """Make the completions durable (group commit), then visible to the next turn."""
        done = [r for r in records if r is not None]
        if done:
            await self.recorder.record(done)
            self.cache.add_completions(done)
            current = self.pool.version
            for r in done:
                self.metrics.completions.labels(self._kind_of(r)).inc()
                if r.output_versions:
                    self.metrics.staleness.observe(current - min(r.output_versions))

    def _kind_of(self, record: CompletionRecord) -> str:
        return "chat" if record.request_messages is not None else "text"

    def _account(self, prompt_len: int, choices: list[_Choice]) -> None:
        self.metrics.tokens.labels("prompt").inc(prompt_len)
        self.metrics.tokens.labels("completion").inc(sum(len(c.result.output_ids) for c in choices))
        interruptions = sum(c.result.interruptions for c in choices)
        if interruptions:
            self.metrics.interruptions.inc(interruptions)

    async def _tokens(self, prep: _Prepared, choice: _Choice) -> AsyncIterator[TokenChunk]:
        """One choice's tokens as they arrive (its result accumulates them)."""
        async for tokens in generate(
            self.pool,
            prompt_ids=prep.prompt_ids,
            params=prep.params,
            result=choice.result,
            sticky_key=prep.session.id if prep.session else None,
            request_id=choice.completion_id,
        ):
            if choice.first_token_at is None:
                choice.first_token_at = time.monotonic()
            yield tokens

    async def _run_choice(self, prep: _Prepared, choice: _Choice) -> None:
        async for _ in self._tokens(prep, choice):
            pass

    async def _multiplex(
        self, prep: _Prepared, choices: list[_Choice]
    ) -> AsyncIterator[tuple[_Choice, TokenChunk | None]]:
        """Run every choice; yield ``(choice, tokens)`` as they arrive, ``(choice, None)`` at its end."""
        queue: asyncio.Queue[tuple[_Choice, TokenChunk | BaseException | None]] = asyncio.Queue()

        async def produce(c: _Choice) -> None:
            try:
                async for tokens in self._tokens(prep, c):
                    await queue.put((c, tokens))
                await queue.put((c, None))
            except Exception as exc:  # re-raised in the consumer, which reports it
                await queue.put((c, exc))

        tasks = [asyncio.create_task(produce(c)) for c in choices]
        try:
            pending = len(choices)
            while pending:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    pending -= 1
                yield c, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def chat(self, prep: _Prepared, n: int, want_logprobs: bool) -> dict[str, Any]:
        choices = [
            _Choice(i, cid) for i, cid in enumerate(self._completion_ids(prep.response_id, n))
        ]
        await _gather_or_cancel([self._run_choice(prep, c) for c in choices])
        out_choices, records = [], []
        for c in choices:
            r = c.result
            text = self._decode(r.output_ids, r.matched_stop)
            assert prep.parser is not None
            parsed = apply_tool_choice(prep.parser.parse(text), prep.tool_choice)
            finish = finish_reason_for(r.finish_reason or "stop", parsed)
            message = _assistant_message(parsed)
            records.append(self._record(prep, c, text=text, message=message, finish=finish))
            out_choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {
                        "content": self._logprob_entries(r.output_ids, r.logprobs, r.top_logprobs)
                    }
                    if want_logprobs
                    else None,
                    "finish_reason": finish,
                }
            )
        self._account(len(prep.prompt_ids), choices)
        await self._commit(records)
        completion_tokens = sum(len(c.result.output_ids) for c in choices)
        return {
            "id": prep.response_id,
            "object": "chat.completion",
            "created": prep.created,
            "model": self.settings.model_name,
            "choices": out_choices,
            "usage": _usage(len(prep.prompt_ids), completion_tokens),
            "system_fingerprint": f"proxima-v{self.pool.version}",
        }

    async def chat_stream(
        self, prep: _Prepared, n: int, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """SSE chunks as tokens arrive; each completion is committed before [DONE]."""
        choices = [
            _Choice(i, cid) for i, cid in enumerate(self._completion_ids(prep.response_id, n))
        ]
        head = {
            "id": prep.response_id,
            "object": "chat.completion.chunk",
            "created": prep.created,
            "model": self.settings.model_name,
            "system_fingerprint": f"proxima-v{self.pool.version}",
        }

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
        ) -> bytes:
            return sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                        }
                    ],
                }
            )

        try:
            detoks = {
                c.index: IncrementalDetokenizer(self.tokenizer, stop=prep.params.stop)
                for c in choices
            }
            streams = {c.index: prep.parser.stream() for c in choices}  # type: ignore[union-attr]
            saw_calls = {c.index: False for c in choices}
            for c in choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            records: list[CompletionRecord | None] = []
            finals: list[bytes] = []
            async for c, item in self._multiplex(prep, choices):
                if item is not None:
                    events = streams[c.index].feed(detoks[c.index].add(item.token_ids))
                    lp = (
                        {
                            "content": self._logprob_entries(
                                item.token_ids, item.logprobs, item.top_logprobs
                            )
                        }
                        if want_logprobs
                        else None
                    )
                    deltas = _deltas(events, saw_calls, c.index)
                    if not deltas and lp is not None:
                        deltas = [{}]
                    for i, d in enumerate(deltas):
                        yield chunk(c.index, d, logprobs=lp if i == 0 else None)
                    continue
                r = c.result
                tail = detoks[c.index].finish(
                    r.matched_stop if isinstance(r.matched_stop, str) else None
                )
                events = streams[c.index].feed(tail) + streams[c.index].finish()
                for d in _deltas(events, saw_calls, c.index):
                    yield chunk(c.index, d)
                text = detoks[c.index].text
                parsed = apply_tool_choice(streams[c.index].result(), prep.tool_choice)
                finish = finish_reason_for(r.finish_reason or "stop", parsed)
                records.append(
                    self._record(
                        prep, c, text=text, message=_assistant_message(parsed), finish=finish
                    )
                )
                finals.append(chunk(c.index, {}, finish=finish))
            # Commit before the client sees the end of the response.
            self._account(len(prep.prompt_ids), choices)
            await self._commit(records)
            for final in finals:
                yield final
            if include_usage:
                completion_tokens = sum(len(c.result.output_ids) for c in choices)
                yield sse(
                    {
                        **head,
                        "choices": [],
                        "usage": _usage(len(prep.prompt_ids), completion_tokens),
                    }
                )
            yield sse("[DONE]")
        except ProximaError as exc:
            logger.warning("stream %s failed: %s", prep.response_id, exc.message)
            yield sse(exc.envelope())
            yield sse("[DONE]")

    # ------------------------------------------------------------ completions
    async def prepare_text(
        self, req: CompletionRequest, principal: Principal, external_id: str | None
    ) -> _Prepared:
        self.check_model(req.model)
        if req.echo:
            raise BadRequest("echo is not supported.", param="echo")
        if req.suffix:
            raise BadRequest("suffix is not supported.", param="suffix")
        prompt_ids = self._text_prompt_ids(req.prompt)
        session = await self._session_for(principal, external_id or req.user)
        if session is not None:
            session_id_var.set(session.id)
        parent_id = None
        if session is not None:
            for c in reversed(await self._history(session)):
                prefix = c.prompt_ids + c.output_ids
                if len(prompt_ids) > len(prefix) and prompt_ids[: len(prefix)] == prefix:
                    parent_id = c.id
                    break
        max_tokens = self._max_tokens(req.max_tokens, len(prompt_ids))
        params = self._params(req, max_tokens, req.logprobs or 0)
        return _Prepared(
            response_id="cmpl-" + uuid.uuid4().hex,
            created=int(time.time()),
            prompt_ids=prompt_ids,
            parent_id=parent_id,
            params=params,
            session=session,
            sampling=_sampling_record(params),
        )

    def _text_prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1:
            return self._text_prompt_ids(prompt[0])
        else:
            raise BadRequest("prompt must be one string or one list of token ids.", param="prompt")
        if not ids:
            raise BadRequest("prompt is empty.", param="prompt")
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab}).", param="prompt")
        return ids

    def _text_logprobs(self, r: GenerationResult) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in r.output_ids]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": r.logprobs,
            "top_logprobs": [{self._token_text(t): lp for t, lp in top} for top in r.top_logprobs],
            "text_offset": offsets,
        }

    async def complete(self, prep: _Prepared, n: int, want_logprobs: bool) -> dict[str, Any]:
        choices = [
            _Choice(i, cid) for i, cid in enumerate(self._completion_ids(prep.response_id, n))
        ]
        await _gather_or_cancel([self._run_choice(prep, c) for c in choices])
        out, records = [], []
        for c in choices:
            r = c.result
            text = self._decode(r.output_ids, r.matched_stop)
            finish = r.finish_reason or "stop"
            records.append(self._record(prep, c, text=text, message=None, finish=finish))
            out.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": self._text_logprobs(r) if want_logprobs else None,
                    "finish_reason": finish,
                }
            )
        self._account(len(prep.prompt_ids), choices)
        await self._commit(records)
        return {
            "id": prep.response_id,
            "object": "text_completion",
            "created": prep.created,
            "model": self.settings.model_name,
            "choices": out,
            "usage": _usage(len(prep.prompt_ids), sum(len(c.result.output_ids) for c in choices)),
        }

    async def complete_stream(
        self, prep: _Prepared, n: int, include_usage: bool
    ) -> AsyncIterator[bytes]:
        choices = [
            _Choice(i, cid) for i, cid in enumerate(self._completion_ids(prep.response_id, n))
        ]
        head = {
            "id": prep.response_id,
            "object": "text_completion",
            "created": prep.created,
            "model": self.settings.model_name,
        }
        try:
            detoks = {
                c.index: IncrementalDetokenizer(self.tokenizer, stop=prep.params.stop)
                for c in choices
            }
            records: list[CompletionRecord | None] = []
            finals: list[bytes] = []
            async for c, item in self._multiplex(prep, choices):
                if item is not None:
                    text = detoks[c.index].add(item.token_ids)
                    if text:
                        yield sse(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": c.index,
                                        "text": text,
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ],
                            }
                        )
                    continue
                r = c.result
                tail = detoks[c.index].finish(
                    r.matched_stop if isinstance(r.matched_stop, str) else None
                )
                records.append(
                    self._record(
                        prep,
                        c,
                        text=detoks[c.index].text,
                        message=None,
                        finish=r.finish_reason or "stop",
                    )
                )
                finals.append(
                    sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": c.index,
                                    "text": tail,
                                    "logprobs": None,
                                    "finish_reason": r.finish_reason or "stop",
                                }
                            ],
                        }
                    )
                )
            self._account(len(prep.prompt_ids), choices)
            await self._commit(records)
            for final in finals:
                yield final
            if include_usage:
                yield sse(
                    {
                        **head,
                        "choices": [],
                        "usage": _usage(
                            len(prep.prompt_ids), sum(len(c.result.output_ids) for c in choices)
                        ),
                    }
                )
            yield sse("[DONE]")
        except ProximaError as exc:
            logger.warning("stream %s failed: %s", prep.response_id, exc.message)
            yield sse(exc.envelope())
            yield sse("[DONE]")


# ---------------------------------------------------------------------- helpers
def _detect_parser(tokenizer: Any) -> str:
    from proxima.proxy.tools import detect_tool_parser

    template = getattr(tokenizer, "chat_template", None)
    return detect_tool_parser(template if isinstance(template, str) else None)


def _sampling_record(params: GenerationParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_new_tokens,
        "seed": params.seed,
        "stop": params.stop,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _assistant_message(parsed: ParsedOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return message


def _deltas(events: list[Any], saw_calls: dict[int, bool], index: int) -> list[dict[str, Any]]:
    """OpenAI chunk deltas for parser events (consecutive content merged)."""
    out: list[dict[str, Any]] = []
    text = ""
    for ev in events:
        if isinstance(ev, ContentDelta):
            text += ev.text
        elif isinstance(ev, ToolCallDelta):
            if text:
                out.append({"content": text})
                text = ""
            saw_calls[index] = True
            out.append({"tool_calls": [ev.to_openai()]})
    if text:
        out.append({"content": text})
    return out


async def _gather_or_cancel(coros: list[Any]) -> None:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
