"""The inspector's routes under ``/ui`` (see the package docs); HTML in, HTML out.

Every page but the login form needs the admin token (``auth.py``): without it a page answers
a redirect to ``/ui/login`` (with ``next``: where to come back). A value the page cannot use
is a 400 page that names it, an unknown session a 404 page: never a 500, never JSON.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from proxima.proxy.inspector import auth
from proxima.proxy.inspector.charts import PALETTE, Chart, Series, line_chart
from proxima.proxy.inspector.queries import (
    BASE,
    PAGE_SIZES,
    SORTS,
    FilterError,
    SessionFilter,
    list_sessions,
    parse_filter,
)
from proxima.proxy.inspector.run_view import RECENT, RunFigures, Scope, run_figures
from proxima.proxy.inspector.session_view import build_turns
from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.state import AppState, state_of
from proxima.proxy.store.models import SessionRow
from proxima.proxy.store.records import SessionKind, SessionStatus
from sqlalchemy import select

router = APIRouter(include_in_schema=False)
TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).with_name("templates")),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_MAX_ID = 64
_MAX_FORM = 4096


def _page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page, with headers that keep it out of caches and frames and let it load nothing but
    its own inline style and its one inline script (by nonce)."""
    started = request.scope.get("proxima_ui_started", time.perf_counter())
    context.setdefault("elapsed_ms", (time.perf_counter() - started) * 1000)
    nonce = secrets.token_urlsafe(16)
    html = TEMPLATES.get_template(name).render(path=request.url.path, nonce=nonce, **context)
    headers = {
        "Cache-Control": "no-store",
        "Content-Security-Policy": (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
            "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        ),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    return HTMLResponse(html, status_code=status, headers=headers)


def _error(request: Request, status: int, message: str) -> HTMLResponse:
    return _page(request, "error.html", status, title=f"{status}", message=message)


async def _gate(request: Request) -> Response | None:
    """None when the caller may see the page; else the answer that sends it to sign in.

    ``?token=`` signs in and redirects to the same page without it."""
    request.scope["proxima_ui_started"] = time.perf_counter()
    token = request.query_params.get("token")
    if token is not None:
        if not auth.token_is_admin(request, token):
            return _login_page(request, "That is not the admin token.", 401)
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        target = request.url.path + ("?" + urlencode(rest) if rest else "")
        response = RedirectResponse(auth.safe_next(target), status_code=303)
        auth.sign_in(request, response)
        return response
    if await auth.signed_in(request):
        return None
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"{auth.PATH}/login?{urlencode({'next': here})}", status_code=303)


def _login_page(request: Request, error: str | None, status: int = 200) -> HTMLResponse:
    if auth.admin_token(request) is None:
        error, status = (
            "This proxy has no admin token (--admin-token): the inspector is closed.",
            403,
        )
    target = auth.safe_next(request.query_params.get("next"))
    return _page(request, "login.html", status, error=error, next=target, signed_in=False)


@router.get("/ui")
async def home(request: Request) -> Response:
    return await _gate(request) or RedirectResponse(f"{auth.PATH}/sessions", status_code=303)


@router.get("/ui/login")
async def login_form(request: Request) -> Response:
    if "token" in request.query_params:
        gate = await _gate(request)
        assert gate is not None  # a token always answers: a redirect or the form
        return gate
    return _login_page(request, None)


@router.post("/ui/login")
async def login(request: Request) -> Response:
    body = await request.body()
    if len(body) > _MAX_FORM:
        return _login_page(request, "The form is too large.", 400)
    form = parse_qs(body.decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0]
    if auth.admin_token(request) is None:
        return _login_page(request, None)
    if not token or not auth.token_is_admin(request, token):
        return _login_page(request, "That is not the admin token.", 401)
    response = RedirectResponse(auth.safe_next((form.get("next") or [""])[0]), status_code=303)
    auth.sign_in(request, response)
    return response


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse(f"{auth.PATH}/login", status_code=303)
    auth.sign_out(response)
    return response


@router.get("/ui/sessions")
async def sessions_page(request: Request) -> Response:
    gate = await _gate(request)
    if gate is not None:
        return gate
    params = dict(request.query_params)
    options: dict[str, Any] = {
        "sorts": SORTS,
        "sizes": PAGE_SIZES,
        "statuses": [s.value for s in SessionStatus],
        "kinds": [k.value for k in SessionKind],
        "base": BASE,
    }
    try:
        flt = parse_filter(params)
    except FilterError as exc:
        return _page(
            request, "sessions.html", 400, error=exc, f=SessionFilter(), form=params, page=None,
            next_url=None, first_url=None, **options,
        )  # fmt: skip
    page = await list_sessions(state_of(request).store.engine, flt)
    next_url = None
    if page.next is not None:
        next_url = "/ui/sessions?" + urlencode(flt.query(after=page.next))
    first_url = "/ui/sessions?" + urlencode(flt.query(after=None)) if flt.after else None
    return _page(
        request, "sessions.html", error=None, f=flt, form=params, page=page,
        next_url=next_url, first_url=first_url, **options,
    )  # fmt: skip


@router.get("/ui/sessions/{session_id}")
async def session_page(request: Request, session_id: str) -> Response:
    gate = await _gate(request)
    if gate is not None:
        return gate
    state = state_of(request)
    store = state.store
    session = await store.get_session(session_id=session_id) if len(session_id) <= _MAX_ID else None
    if session is None:
        return _error(request, 404, f"No session {session_id[:_MAX_ID]!r} in the store.")
    completions = await store.list_completions(session_id=session.id)  # one query
    group: list[float] = []
    if session.group_id is not None:
        rewards = select(SessionRow.reward).where(
            SessionRow.group_id == session.group_id, SessionRow.reward.is_not(None)
        )
        async with store.engine.connect() as conn:
            group = [float(r) for (r,) in await conn.execute(rewards) if r is not None]
    tokenizer = state.service.preparer.tokenizer
    turns = await asyncio.to_thread(
        build_turns, completions, tokenizer, reward=session.reward, group_rewards=group
    )
    return _page(
        request, "session.html", s=session, turns=turns, group=group,
        run=session.metadata.get("rollout") if isinstance(session.metadata, dict) else None,
    )  # fmt: skip


def _charts(figures: RunFigures) -> dict[str, Any]:
    """The run page's charts; dashed lines mark the newest pushes."""
    marks = [(t.timestamp(), f"version {v} pushed") for v, t, _ in figures.versions]
    by_version = [
        Series(
            "reward of sessions trained into v", [(v, m) for v, m, _ in figures.reward_by_version]
        )
    ]
    for i, (name, scores) in enumerate(sorted(figures.evals.items()), 1):
        by_version.append(Series(f"held-out: {name}", scores, PALETTE[i % len(PALETTE)]))
    recent = f"newest {RECENT} sessions"
    return {
        "reward_time": line_chart(
            Chart("Mean reward over time", [Series("mean reward", [(t, m) for t, m, _ in figures.reward_by_time])],
                  x_label="session opened (UTC)", y_label="reward", x_time=True, marks=marks)
        ),
        "reward_version": line_chart(
            Chart("Reward and held-out score by version", by_version, x_label="policy version",
                  y_label="reward / score")
        ),
        "staleness": line_chart(
            Chart(f"Staleness of trained tokens ({recent})", [
                Series("mean", [(v, m) for v, m, _, _ in figures.staleness]),
                Series("max", [(v, float(x)) for v, _, x, _ in figures.staleness], PALETTE[1]),
            ], x_label="version the step made", y_label="versions behind")
        ),
        "opened": line_chart(
            Chart("Sessions opened", [Series("sessions / min", figures.opened_by_time, PALETTE[3])],
                  x_label="time (UTC)", y_label="per minute", x_time=True, marks=marks)
        ),
        "throughput": line_chart(
            Chart(f"Completions ({recent})", [Series("completions / min", [(t, c) for t, c, _ in figures.throughput])],
                  x_label="time (UTC)", y_label="per minute", x_time=True, marks=marks)
        ),
        "tokens": line_chart(
            Chart(f"Generated tokens ({recent})", [Series("tokens / min", [(t, k) for t, _, k in figures.throughput], PALETTE[2])],
                  x_label="time (UTC)", y_label="per minute", x_time=True, marks=marks)
        ),
    }  # fmt: skip


async def _production(state: AppState, policy: str | None) -> dict[str, Any]:
    """Every policy's production state (``ProductionController.status``) and admission."""
    store = state.store
    names: list[str | None] = [None, *sorted(await store.adapter_heads())]
    statuses = [await state.production.status(name) for name in names]
    admission = await store.admission_state(adapter=policy)
    settings = state.settings
    capacity = None
    if settings.max_staleness is not None:
        capacity = (admission.version + settings.max_staleness + 1) * settings.train_batch_size
    return {
        "production": statuses,
        "admission": admission,
        "capacity": capacity,
        "max_staleness": settings.max_staleness,
        "batch_size": settings.train_batch_size,
        "served": state.pool.policy(policy)[0],
    }


@router.get("/ui/run")
async def run_page(request: Request) -> Response:
    gate = await _gate(request)
    if gate is not None:
        return gate
    run = request.query_params.get("run") or None
    adapter = request.query_params.get("adapter") or BASE
    if run is not None and (len(run) > 200 or "\x00" in run):
        return _error(request, 400, "run: at most 200 characters, no NUL")
    if adapter != BASE:
        try:
            check_adapter(adapter)
        except ValueError as exc:
            return _error(request, 400, f"adapter: {exc}")
    scope = Scope(run, adapter)
    state = state_of(request)
    figures = await run_figures(state.store.engine, scope)
    context = await _production(state, scope.policy)
    return _page(
        request, "run.html", scope=scope, fig=figures, charts=_charts(figures), base=BASE, **context
    )
