"""Dependencies: the app state's objects, and who is calling.

The lifespan (``proxima.proxy.app``) builds one ``AppState`` (``proxima.proxy.state``);
every route reaches it through the functions below, which all read ``state_of``:
as FastAPI dependencies (the ``...Dep`` aliases), and the generation routes, which skip
FastAPI's dependency solving (``api/routing.py``), by calling ``get_principal`` and
``service_of`` themselves. A test builds the state with ``build_state`` (as the lifespan
does) and swaps a part there.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Request
from proxima.proxy.api.schemas import MAX_ID_LENGTH
from proxima.proxy.auth import Principal, PrincipalKind, bearer_token, hash_key, is_admin_token
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.caches import HistoryCache, PrincipalCache
from proxima.proxy.config import Settings
from proxima.proxy.errors import AuthenticationFailed, BadRequest
from proxima.proxy.logs import note_request
from proxima.proxy.service import CompletionService
from proxima.proxy.state import AppState, state_of
from proxima.proxy.store.store import Store


async def get_state(request: Request) -> AppState:
    return state_of(request)


async def get_settings(request: Request) -> Settings:
    return state_of(request).settings


async def get_store(request: Request) -> Store:
    return state_of(request).store


async def get_pool(request: Request) -> BackendPool:
    return state_of(request).pool


async def get_service(request: Request) -> CompletionService:
    return state_of(request).service


def service_of(request: Request) -> CompletionService:
    """The completion service, for the generation routes: read here, not through
    ``ServiceDep``, because every dependency and parameter FastAPI solves per request
    costs it tens of microseconds, and these routes serve every agent turn."""
    return state_of(request).service


def session_id_of(request: Request) -> str | None:
    """The ``X-Session-Id`` header of a generation request (see ``service_of``)."""
    value = request.headers.get("x-session-id")
    if value is not None and len(value) > MAX_ID_LENGTH:
        raise BadRequest(
            f"Invalid value for 'x-session-id': String should have at most {MAX_ID_LENGTH} "
            "characters.",
            param="x-session-id",
        )
    return value


# The header read by ``session_id_of``, as the OpenAPI schema shows it.
SESSION_HEADER_DOC: dict[str, Any] = {
    "parameters": [
        {
            "name": "x-session-id",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
            "description": "The production session this request belongs to (recorded keys).",
        }
    ]
}

StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
PoolDep = Annotated[BackendPool, Depends(get_pool)]
ServiceDep = Annotated[CompletionService, Depends(get_service)]


async def get_principals(request: Request) -> PrincipalCache:
    return state_of(request).principals


async def get_histories(request: Request) -> HistoryCache:
    return state_of(request).histories


PrincipalsDep = Annotated[PrincipalCache, Depends(get_principals)]
HistoriesDep = Annotated[HistoryCache, Depends(get_histories)]


async def get_principal(request: Request) -> Principal:
    # The headers and the app state are read here, not through header parameters and the
    # dependencies above: every inference request resolves this one, and each parameter
    # costs FastAPI tens of microseconds.
    headers = request.headers
    principal = await _principal(
        state_of(request), headers.get("authorization"), headers.get("x-api-key")
    )
    if principal.session is not None:  # the request log names a session key's session
        note_request(session_id=principal.session.id, policy=principal.session.adapter or "base")
    return principal


async def _principal(
    state: AppState, authorization: str | None, x_api_key: str | None
) -> Principal:
    settings, principals, store = state.settings, state.principals, state.store
    # Anthropic's SDK sends the key as ``x-api-key``; ``Authorization`` wins when both come.
    token = x_api_key.strip() if x_api_key and not authorization else bearer_token(authorization)
    if not token:
        raise AuthenticationFailed("The x-api-key header is empty.")
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    if is_admin_token(token, admin):
        return Principal(PrincipalKind.ADMIN)
    digest = hash_key(token)
    principal = principals.get(digest)
    if principal is not None:
        return principal
    session = await store.get_session_by_key_hash(api_key_hash=digest)
    if session is not None:
        principal = Principal(PrincipalKind.SESSION, session=session)
    else:
        api_key = await store.get_api_key_by_hash(key_hash=digest)
        if api_key is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        principal = Principal(PrincipalKind.PRODUCTION, api_key=api_key)
    principals.remember(digest, principal)
    return principal


async def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    principal.require_admin()
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
AdminDep = Annotated[Principal, Depends(get_admin)]


async def get_observer(
    state: StateDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> None:
    """Who may read ``/metrics``: anyone, or with ``private_observability`` the admin only."""
    if state.settings.private_observability:
        principal = await _principal(state, authorization, x_api_key)
        principal.require_admin()


ObserverDep = Annotated[None, Depends(get_observer)]
