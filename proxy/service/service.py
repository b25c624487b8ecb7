"""``CompletionService``: sessions, generation and recording for every API surface.

Per request it finds the session (a session key, or a recorded production
session), prepares the prompt (``prepare``), runs the generation driver
(``driver``) and commits every completion to the store before the response
ends (``recording``; the durability rule: an acknowledged completion is never
lost). It
speaks no API: routes translate their request into a ``CanonicalRequest``
and hand the driver's events to their response builder.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from proxima.proxy.auth import Principal, PrincipalKind
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.caches import HistoryCache, PrincipalCache
from proxima.proxy.config import Settings
from proxima.proxy.errors import BadRequest, Conflict, NotFound
from proxima.proxy.logs import note_request, session_id_var
from proxima.proxy.metrics import Metrics
from proxima.proxy.policies.adapter_guard import AdapterGuard
from proxima.proxy.policies.adapters import check_adapter, policy_label, split_policy
from proxima.proxy.policies.deployments import (
    TRAINING,
    Deployment,
    Deployments,
    split_model_version,
)
from proxima.proxy.rendering.reasoning import detect_reasoning_parser, get_reasoning_parser
from proxima.proxy.rendering.reasoning_seal import ReasoningSeal
from proxima.proxy.service.canonical import CanonicalRequest, ChatInput
from proxima.proxy.service.driver import GenerationDriver
from proxima.proxy.service.events import Completion, Event
from proxima.proxy.service.prepare import Prepared, PromptPreparer
from proxima.proxy.service.recording import ChoiceRecorder
from proxima.proxy.store.group_commit import GroupCommit
from proxima.proxy.store.records import CompletionRecord, SessionRecord, SessionStatus
from proxima.proxy.store.store import Store
from proxima.proxy.tools import detect_tool_parser, get_tool_parser


class CompletionService:
    def __init__(
        self,
        *,
        settings: Settings,
        store: Store,
        pool: BackendPool,
        tokenizer: Any,
        context_length: int,
        group_commit: GroupCommit,
        principals: PrincipalCache,
        histories: HistoryCache,
        metrics: Metrics,
        deployments: Deployments | None = None,
    ):
        self.settings = settings
        self.store = store
        self.pool = pool  # the training pool: staleness of recorded tokens is measured to it
        self.deployments = deployments or Deployments(Deployment(TRAINING, pool))
        self.principals = principals
        self.histories = histories
        self.metrics = metrics
        template = getattr(tokenizer, "chat_template", None)
        parser_name = settings.tool_parser or detect_tool_parser(
            template if isinstance(template, str) else None
        )
        reasoning_name = settings.reasoning_parser or detect_reasoning_parser(
            template if isinstance(template, str) else None
        )
        self.preparer = PromptPreparer(
            settings=settings,
            tokenizer=tokenizer,
            context_length=context_length,
            tool_parser=get_tool_parser(parser_name),
            reasoning_parser=get_reasoning_parser(reasoning_name),
        )
        self.guard = AdapterGuard(store=store, metrics=metrics)
        self.driver = GenerationDriver(
            pool=pool, tokenizer=tokenizer, on_broken_adapter=self.guard.fall_back
        )
        self.thinks = reasoning_name != "none"
        self.seal = ReasoningSeal.from_secrets(
            settings.signing_key.get_secret_value() if settings.signing_key else None,
            settings.admin_token.get_secret_value() if settings.admin_token else None,
        )
        self.commit = ChoiceRecorder(
            model_name=settings.model_name,
            pool=pool,
            group_commit=group_commit,
            histories=histories,
            metrics=metrics,
            rendered=self.preparer.rendered,
            # --backend URLs are SGLang servers; without them the embedded engines serve.
            grammar_rules="sglang" if settings.backends else "proxima-engine",
        )

    def close(self) -> None:
        self.preparer.close()

    # ----------------------------------------------------------------- requests
    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served name (``<name>@v<N>`` asks for version N,
        ``<name>:<adapter>`` names a policy: checked against the caller in ``prepare``)."""
        model = split_policy(model, self.settings.model_name)[0]
        if split_model_version(model)[0] != self.settings.model_name:
            raise NotFound(
                f"The model '{model}' does not exist; this server serves "
                f"'{self.settings.model_name}'.",
                param="model",
                code="model_not_found",
            )

    async def prepare(
        self,
        request: CanonicalRequest,
        principal: Principal,
        external_id: str | None,
        *,
        session: SessionRecord | None = None,
    ) -> Prepared:
        """Validate ``request``, find its session, and build its prompt.

        ``session``: the session the request continues (found by
        :meth:`conversation_of`) instead of the one its key and ``external_id`` name.
        """
        text_ids = None
        if not isinstance(request.input, ChatInput):
            text_ids = await self.preparer.text_prompt(request.input.prompt)
        if session is not None:
            _check_open(session, "open a new conversation")
        else:
            session = await self._session_for(principal, external_id or request.user)
        if session is not None:
            session_id_var.set(session.id)
            note_request(session_id=session.id)
        history = await self._history(session) if session else []
        adapter = self._policy(request, principal)
        note_request(policy=adapter or "base")
        deployment = self._route(request, principal, session, external_id, adapter)
        if isinstance(request.input, ChatInput):
            prep = await self.preparer.chat(request, request.input, session, history)
        else:
            assert text_ids is not None
            prep = self.preparer.text(request, text_ids, session, history)
        prep.deployment = deployment
        prep.adapter = adapter
        if prep.parent_id is not None:
            prep.parent = next((r for r in reversed(history) if r.id == prep.parent_id), None)
        return prep

    def _route(
        self,
        request: CanonicalRequest,
        principal: Principal,
        session: SessionRecord | None,
        external_id: str | None,
        adapter: str | None = None,
    ) -> Deployment:
        """Production keys -> production (canary split sticky per session); others -> training."""
        version = split_model_version(request.model)[1] if request.model else None
        if version is not None and not principal.is_admin:
            raise NotFound(
                f"The model '{request.model}' does not exist; only the admin token may ask "
                "for a version by name.",
                param="model",
                code="model_not_found",
            )
        sticky = session.id if session is not None else (external_id or request.user)
        return self.deployments.route(
            production=principal.kind is PrincipalKind.PRODUCTION,
            sticky_key=sticky,
            version=version,
            adapter=adapter,
        )

    def _policy(self, request: CanonicalRequest, principal: Principal) -> str | None:
        """The policy (adapter, or None for the base) that serves the request.

        The credential decides: a session key its session's adapter, a production
        key the adapter it is bound to. ``model`` may name it (``<served>:<adapter>``)
        and must then agree (400, ``param: "model"``); the admin token has no policy
        of its own, so its ``model`` picks one.
        """
        named = None
        if request.model:  # "<served>:<adapter>", or "<served>:<adapter>@v<N>" (admin token)
            unversioned = split_model_version(request.model)[0]
            named = split_policy(unversioned, self.settings.model_name)[1]
        if named is not None:
            try:
                check_adapter(named)
            except ValueError as exc:
                raise BadRequest(f"The model '{request.model}': {exc}.", param="model") from None
        if principal.is_admin:
            return named
        if principal.session is not None:
            own = principal.session.adapter
        else:
            own = principal.api_key.adapter if principal.api_key is not None else None
        if named is not None and named != own:
            served = self.settings.model_name
            mine = served if own is None else f"{served}:{own}"
            raise BadRequest(
                f"The model '{request.model}' names {policy_label(named)}, but this key "
                f"serves {policy_label(own)}: use model '{mine}' (or '{served}').",
                param="model",
                code="model_policy_mismatch",
            )
        return own

    def version_of(self, prep: Prepared) -> int:
        """The version of the request's policy its deployment serves now."""
        return (prep.deployment or self.deployments.training).pool.policy(prep.adapter)[0]

    async def complete(self, prep: Prepared) -> Completion:
        """Every choice, generated and committed."""
        started, outcome, tokens = time.monotonic(), "error", 0
        try:
            completion = await self.driver.complete(prep, self.commit)
            outcome, tokens = "ok", completion.usage.completion_tokens
            return completion
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._observe(prep, started, outcome, tokens)

    def stream(self, prep: Prepared) -> AsyncIterator[Event]:
        """The generation's events; every choice is committed before its ``Finish``."""
        started = time.monotonic()
        return self.driver.stream(
            prep,
            self.commit,
            lambda outcome, tokens: self._observe(prep, started, outcome, tokens),
        )

    def _observe(self, prep: Prepared, started: float, outcome: str, tokens: int) -> None:
        deployment = prep.deployment or self.deployments.training
        note_request(
            deployment=deployment.name,
            version=deployment.version,
            prompt_tokens=len(prep.prompt_ids),
            output_tokens=tokens,
            outcome=None if outcome == "ok" else outcome,  # error, or cancelled: the client left
        )
        self.metrics.observe_generation(
            deployment=deployment.name,
            version=deployment.version,
            seconds=time.monotonic() - started,
            outcome=outcome,
            prompt_tokens=len(prep.prompt_ids),
            completion_tokens=tokens,
        )

    async def count_prompt_tokens(self, request: CanonicalRequest) -> int:
        """The tokens a conversation renders to on its own (no session, no generation)."""
        if not isinstance(request.input, ChatInput):
            raise TypeError("count_prompt_tokens takes a chat request")
        return len((await self.preparer.render(request.input, [])).prompt_ids)

    async def conversation_of(
        self, principal: Principal, completion_id: str
    ) -> tuple[list[dict[str, Any]], SessionRecord] | None:
        """An earlier chat completion of the caller's as messages (its request, then its
        reply), and the session it belongs to; None when the caller has no such completion
        (the Responses API's ``previous_response_id``).

        A session key finds the completions of its session; a recording production key
        those of every session it owns, whatever ``X-Session-Id`` each was sent with. The
        lookup creates nothing. A key whose requests are not recorded has nothing to find:
        :class:`NotFound` says so.
        """
        if principal.kind is PrincipalKind.SESSION:
            session = principal.session
            assert session is not None
            found = next((r for r in await self._history(session) if r.id == completion_id), None)
        elif self._records(principal):
            assert principal.api_key is not None
            found = await self.store.get_completion(completion_id=completion_id)
            owner = (
                None if found is None else await self.store.get_session(session_id=found.session_id)
            )
            if owner is None or owner.api_key_id != principal.api_key.id:
                return None
            session = owner
        else:
            raise NotFound(
                "previous_response_id needs a recorded conversation, and this key's requests "
                "are not recorded: send the whole conversation in 'input' instead.",
                param="previous_response_id",
            )
        if found is None or found.request_messages is None or found.response_message is None:
            return None
        return [*found.request_messages, found.response_message], session

    # ----------------------------------------------------------------- sessions
    async def _session_for(
        self, principal: Principal, external_id: str | None
    ) -> SessionRecord | None:
        """The session this request is recorded in; a closed one is 409 ``session_closed``."""
        if principal.kind is PrincipalKind.SESSION:
            session = principal.session
            assert session is not None
            advice = "open a new session"
        elif self._records(principal):
            assert principal.api_key is not None
            session = await self.store.get_or_create_production_session(
                api_key_id=principal.api_key.id, external_id=external_id
            )
            advice = "send another X-Session-Id (or user) to start a new one"
        else:
            return None
        _check_open(session, advice)
        return session

    def _records(self, principal: Principal) -> bool:
        """Whether ``principal`` is a production key whose requests are recorded."""
        return (
            principal.kind is PrincipalKind.PRODUCTION
            and principal.api_key is not None
            and principal.api_key.record
            and self.settings.record_production
        )

    async def _history(self, session: SessionRecord) -> list[CompletionRecord]:
        """The session's completions, from this process's cache when it is still whole.

        Replicas on one database (``store.shared``: on PostgreSQL, or the workers of
        ``proxima serve --workers`` on one SQLite file) serve turns of one
        conversation in any order, so before a turn is rendered the cached history
        is checked against the store in one indexed read (status and completion
        count; completions are only ever appended): a turn recorded by another
        replica reads the session's ids and only the completions it does not hold,
        and a session finished through another replica is a 409 here at once. For
        one process alone the cache is the truth.
        """
        history = self.histories.get(session.id)
        if self.store.shared:
            state = await self.store.session_state(session_id=session.id)
            if state.status is not SessionStatus.OPEN:
                self.principals.forget_session(session.id)
                self.histories.forget_session(session.id)
                raise Conflict(
                    f"Session {session.id} is {state.status.value}; open a new session.",
                    code="session_closed",
                )
            if history is not None and len(history) != state.completions:
                history = await self.store.list_completions_since(
                    session_id=session.id, known=history
                )
                if history is not None:
                    self.histories.remember(session.id, history)
        if history is None:
            history = await self.store.list_completions(session_id=session.id)
            self.histories.remember(session.id, history)
        return history


def _check_open(session: SessionRecord, advice: str) -> None:
    """A closed session takes no more turns: 409 ``session_closed``."""
    if session.status is not SessionStatus.OPEN:
        raise Conflict(
            f"Session {session.id} is {session.status.value}; {advice}.", code="session_closed"
        )
