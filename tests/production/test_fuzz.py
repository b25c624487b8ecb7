"""The HTTP surface under fuzzing, and the walls between callers.

``test_no_server_errors_under_fuzzing`` loads the live proxy's own
``/openapi.json``, adds the routes the app leaves out of it (``/``, ``/metrics``,
the inspector's ``/ui``: their schema is built from the app's own routes), and lets
schemathesis generate requests for every operation, valid (positive) and
schema-violating (negative), sent with the admin token or a session key: no
response may be a 5xx, and no stream may carry an internal error. Every test here
runs on SQLite and on PostgreSQL (which refuses what SQLite stores: NUL in text,
NaN in JSON, integers past int32). Examples are bounded per operation and the
fuzzing's time per store (``FUZZ_SECONDS``), a few hundred requests; the backend is
the fake SGLang server and ``max_tokens`` is capped, so generated requests are cheap.

The access tests check what each kind of key must never reach: admin
routes without the admin token, and another session's trajectory, reward,
finish, or generation.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from proxima.proxy.app import create_app
from proxima.proxy.config import Settings
from proxima.proxy.testing.live import LiveProxy
from schemathesis import GenerationMode

from tests.pg import POSTGRES_PARAM, create_test_database
from tests.production.procs import BackendProcess, create_production_key

EXAMPLES_PER_OPERATION = 16
FUZZ_SECONDS = 50.0
"""The fuzzing's time on one store, shared by its operations (each gets at least 2 s)."""


@pytest.fixture(scope="module", params=["sqlite", POSTGRES_PARAM])
def proxy(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    """A proxy on the store of the parameter, with a backend of its own (the fuzzing pushes
    weights: a backend shared by both would serve the first proxy's version to the second)."""
    work = tmp_path_factory.mktemp("fuzz-proxy")
    backend = BackendProcess.fake(chunk_tokens=8, log_path=work / "fake.log")
    backend.start()
    request.addfinalizer(backend.stop)
    if request.param == POSTGRES_PARAM:
        db_url = create_test_database(request)
    else:
        db_url = f"sqlite:///{work / 'store.db'}"
    live = LiveProxy(
        tiny_model_dir,
        db_url=db_url,
        log_path=work / "serve.log",
        extra_args=["--backend", backend.url],
        # Generated requests stay cheap: small generations, few choices.
        env={
            "PROXIMA_MAX_TOKENS_LIMIT": "64",
            "PROXIMA_DEFAULT_MAX_TOKENS": "16",
            "PROXIMA_MAX_N": "4",
        },
    )
    live.start()
    yield live
    live.stop()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _internal_errors_in_stream(text: str) -> list[str]:
    """SSE error events that report a server-side failure (status 200 hides it)."""
    found = []
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except json.JSONDecodeError:
            found.append(f"unparseable event: {line[:200]}")
            continue
        error = event.get("error") if isinstance(event, dict) else None
        if error and error.get("type") in ("api_error", "server_error"):
            found.append(json.dumps(error))
    return found


def _plausible(case: Any, model: str) -> Any:
    """A generated request made servable: the served model, a well-formed prompt, and none of
    the fields whose cross-field rules a schema cannot express. The generated sampling fields
    (n, stop, max_tokens, temperature, tools, logprobs...) then reach generation."""
    if isinstance(case.body, dict):
        body = {
            k: v
            for k, v in case.body.items()
            if k not in ("echo", "suffix", "tool_choice", "response_format")
        }
        body["model"] = model
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": "fuzz"}]
            if body.get("top_logprobs"):
                body["logprobs"] = True
        if "prompt" in body:
            body["prompt"] = "fuzz"
        case.body = body
    return case


UPSTREAM_CODES = {"weight_group_failed"}
"""5xx answers that are the backends' and not the proxy's: a weight-update group at the
address the request named could not form (the fuzzer's addresses reach no trainer); the
proxy relays each backend's refusal with this code, as documented in docs/reference.md."""


def _upstream_answer(response: Any) -> bool:
    if response.status_code != 503:
        return False
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return code in UPSTREAM_CODES


def _fuzz_operation(
    op: Any, proxy: LiveProxy, tokens: dict[str, str], session_id: str, seconds: float
) -> tuple[dict[int, int], list[str]]:
    """Send up to ``EXAMPLES_PER_OPERATION`` generated requests; (count per status, problems)."""
    label = f"{op.method.upper()} {op.path}"
    strategies = [
        op.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    if "{session_id}" in op.path:
        # Also aim at the real session, so the handlers behind the access check get fuzzed.
        strategies.append(
            op.as_strategy(GenerationMode.POSITIVE, path_parameters={"session_id": session_id})
        )
    if op.method.upper() == "POST" and op.path.startswith("/v1/"):
        # Twice the weight: the requests that get past validation into generation and recording.
        plausible = st.builds(
            _plausible, op.as_strategy(GenerationMode.POSITIVE), st.just(proxy.model_name)
        )
        strategies += [plausible, plausible]
    # The time starts at the first request: generating it (resolving the schema, the first
    # examples) may take seconds on a loaded machine, and every operation is sent some.
    deadline: float | None = None
    problems: list[str] = []
    statuses: dict[int, int] = {}

    # derandomize: the same examples on every run, so a failure reproduces.
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies), who=st.sampled_from(sorted(tokens)))
    def send(case: Any, who: str) -> None:
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + seconds
        elif time.monotonic() > deadline:
            return
        headers = {**(case.headers or {}), **_auth(tokens[who])}
        response = case.call(base_url=proxy.url, headers=headers, timeout=60)
        problem = None
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500 and not _upstream_answer(response):
            problem = f"{response.status_code} {response.text[:300]}"
        elif "text/event-stream" in response.headers.get("content-type", ""):
            errors = _internal_errors_in_stream(response.text)
            problem = f"stream error {errors[0]}" if errors else None
        if problem:
            problems.append(f"{label} as {who}: {problem}\n  {case.as_curl_command()}")

    send()
    return statuses, problems


def _api_routes(routes: Iterable[Any]) -> Iterator[APIRoute]:
    """Every ``APIRoute`` of ``routes``, those of included routers too (FastAPI keeps an
    included router as one entry holding ``original_router``)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (included := getattr(route, "original_router", None)) is not None:
            yield from _api_routes(included.routes)


def _hidden_schema(model_dir: Path) -> dict[str, Any]:
    """The OpenAPI document of the app's routes that ``/openapi.json`` leaves out, built from
    the app's own routes (the app is created, not started)."""
    app = create_app(Settings(model=model_dir, admin_token="unused"))
    hidden = []
    for route in _api_routes(app.routes):
        if not route.include_in_schema:
            shown = copy.copy(route)
            shown.include_in_schema = True
            hidden.append(shown)
    with warnings.catch_warnings():  # "/" answers GET and HEAD with one operation id
        warnings.simplefilter("ignore", UserWarning)
        return get_openapi(title="hidden routes", version="0", routes=hidden)


def test_no_server_errors_under_fuzzing(proxy: LiveProxy, tiny_model_dir: Path) -> None:
    public = httpx.get(proxy.url + "/openapi.json", timeout=30).json()
    hidden = _hidden_schema(tiny_model_dir)
    assert {"/", "/metrics", "/ui/sessions/{session_id}"} <= set(hidden["paths"])
    assert not set(hidden["paths"]) & set(public["paths"])
    session = proxy.new_session(group_id="fuzz")
    tokens = {"admin": proxy.admin_token, "session": session["api_key"]}
    operations = [
        result.ok()
        for document in (public, hidden)
        for result in schemathesis.openapi.from_dict(document).get_all_operations()
    ]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/chat/completions", "POST /rl/sessions", "POST /admin/weights"} <= labels
    assert {"GET /metrics", "GET /ui/sessions/{session_id}"} <= labels

    failures: list[str] = []
    statuses: dict[str, dict[int, int]] = {}
    seconds = max(2.0, FUZZ_SECONDS / len(operations))
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        statuses[label], problems = _fuzz_operation(
            op, proxy, tokens, session["session_id"], seconds
        )
        failures += problems
    print(f"fuzzed {sum(n for s in statuses.values() for n in s.values())} requests:", statuses)
    assert all(statuses.values()), statuses
    # The fuzzer got past validation too, into generation and recording.
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert any(200 <= code < 300 for code in statuses[label]), statuses[label]
    assert failures == [], f"{len(failures)} server errors:\n" + "\n".join(failures[:10])


# ------------------------------------------------------------------ hostile strings
# schemathesis draws printable text; these are the strings it never produced. A lone
# surrogate is valid JSON ("\ud800") but has no UTF-8 form: a 400 naming the field.
HOSTILE_STRINGS = [
    "\ud800",
    "tail \udfff",
    "\udc00\ud800",  # two lone halves in the wrong order are not a pair
    "\x00",
    "nul\x00inside",
    "\U0010ffff" * 300,
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦀 \u202e\ufeff\ufffe",
    "\\ud800",  # the escape as text: valid Unicode
    "",
]


def _templates(model: str, session_id: str) -> dict[str, dict[str, Any]]:
    """A valid body per route, with strings at every place a client can put one."""
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return {
        "/v1/chat/completions": {
            "model": model,
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "part"}], "name": "ann"},
                {"role": "assistant", "content": "calling", "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "result"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "description": "desc",
                        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                    },
                }
            ],
            "stop": ["stop"],
            "user": "someone",
        },
        "/v1/completions": {"model": model, "max_tokens": 2, "prompt": "hi", "stop": "s"},
        "/rl/sessions": {"group_id": "g", "data_id": "d", "metadata": {"k": ["v", {"n": "m"}]}},
        f"/rl/sessions/{session_id}/reward": {"reward": 0.5, "completion_id": "c"},
        "/admin/versions/0/evals": {"score": 0.5, "items": 3, "name": "held-out"},
    }


def _string_places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every string value, and of every dict key (marked with a trailing "key")."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        places = []
        for key, item in value.items():
            places.append((*path, key, "key"))
            places += _string_places(item, (*path, key))
        return places
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _string_places(item, (*path, i))]
    return []


def _replace(body: Any, place: tuple[Any, ...], text: str) -> Any:
    body = json.loads(json.dumps(body))
    *parents, last = place
    if last == "key":
        *parents, key = parents
        target = body
        for step in parents:
            target = target[step]
        target[text] = target.pop(key)
        return body
    target = body
    for step in parents:
        target = target[step]
    target[last] = text
    return body


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def test_hostile_strings_anywhere_get_4xx_never_5xx(proxy: LiveProxy) -> None:
    """Every string place of every body gets surrogates, NUL and astral text, escaped in
    JSON or as raw (CESU-8) bytes, which Python's JSON parser also turns into surrogates."""
    session = proxy.new_session(group_id="hostile")
    templates = _templates(proxy.model_name, session["session_id"])
    cases = [
        (route, place)
        for route, body in templates.items()
        for place in _string_places(body)
        if place[-1] != "key" or route.startswith("/rl/sessions") or "properties" in place
    ]
    problems: list[str] = []

    @settings(max_examples=120, deadline=None, database=None, derandomize=True)
    @given(
        case=st.sampled_from(cases),
        text=st.one_of(
            st.sampled_from(HOSTILE_STRINGS), st.text(st.characters(codec=None), max_size=8)
        ),
        raw=st.booleans(),
    )
    def send(case: tuple[str, tuple[Any, ...]], text: str, raw: bool) -> None:
        route, place = case
        body = _replace(templates[route], place, text)
        if raw:  # UTF-8 on the wire; surrogates as their 3-byte (CESU-8) forms
            content = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
        else:
            content = json.dumps(body).encode()
        r = httpx.post(
            proxy.url + route,
            content=content,
            headers={**_auth(proxy.admin_token), "Content-Type": "application/json"},
            timeout=60,
        )
        what = f"{route} {place} {text[:40]!a} raw={raw}: {r.status_code} {r.text[:200]}"
        if r.status_code >= 500:
            problems.append(what)
        elif _has_surrogate(text) and r.status_code != 400:
            problems.append("accepted a lone surrogate: " + what)
        elif r.status_code >= 400 and set(r.json().get("error", {})) != {
            "message",
            "type",
            "param",
            "code",
        }:
            problems.append("not OpenAI's error envelope: " + what)

    send()
    assert problems == [], f"{len(problems)} problems:\n" + "\n".join(problems[:10])
    # Whatever was recorded stays readable.
    assert (
        httpx.get(
            f"{proxy.url}/rl/sessions/{session['session_id']}", headers=_auth(proxy.admin_token)
        ).status_code
        == 200
    )


# ------------------------------------------------------------------ access walls
def _admin_operations(proxy: LiveProxy) -> list[tuple[str, str]]:
    """Every admin-only route: those under /admin/, and session creation."""
    paths = httpx.get(proxy.url + "/openapi.json", timeout=30).json()["paths"]
    found = [(m.upper(), p) for p, ops in paths.items() for m in ops if p.startswith("/admin/")]
    return [*found, ("POST", "/rl/sessions")]


def _valid_body(method: str, path: str, tmp_path: Path) -> dict[str, Any] | None:
    if path == "/admin/weights":
        return {"version": 2**62, "path": str(tmp_path)}
    return {} if method == "POST" else None


def test_admin_routes_need_the_admin_token(proxy: LiveProxy, tmp_path: Path) -> None:
    session = proxy.new_session()
    production = create_production_key(proxy.db_url, "fuzz-app")
    callers: dict[str, dict[str, str]] = {
        "nobody": {},
        "bogus token": _auth("sk-not-a-key"),
        "session key": _auth(session["api_key"]),
        "production key": _auth(production),
        "admin token, wrong case": _auth(proxy.admin_token.upper()),
    }
    operations = _admin_operations(proxy)
    assert ("POST", "/admin/weights") in operations
    version = httpx.get(proxy.url + "/health").json()["version"]
    for method, path in operations:
        body = _valid_body(method, path, tmp_path)
        for who, headers in callers.items():
            r = httpx.request(method, proxy.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code in (401, 403), (method, path, who, r.status_code, r.text)
            assert r.json()["error"]["type"] in ("authentication_error", "permission_error")
    # Nothing above changed the policy version.
    assert httpx.get(proxy.url + "/health").json()["version"] == version


def test_session_key_stays_in_its_session(proxy: LiveProxy) -> None:
    a, b = proxy.new_session(group_id="a"), proxy.new_session(group_id="b")
    key_a = _auth(a["api_key"])
    other = f"{proxy.url}/rl/sessions/{b['session_id']}"
    assert httpx.get(other, headers=key_a).status_code == 403
    assert httpx.post(other + "/reward", json={"reward": 1.0}, headers=key_a).status_code == 403
    assert httpx.post(other + "/finish", headers=key_a).status_code == 403
    # An unknown session looks the same as another's: nothing to learn by probing.
    assert httpx.get(f"{proxy.url}/rl/sessions/no-such-session", headers=key_a).status_code == 403

    # Generation cannot be steered into B by naming it: it is recorded in A.
    for extra_headers, extra_body in (
        ({"X-Session-Id": b["session_id"]}, {}),
        ({}, {"user": b["session_id"]}),
    ):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            headers=key_a | extra_headers,
            timeout=60,
            json={
                "model": proxy.model_name,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                **extra_body,
            },
        )
        assert r.status_code == 200, r.text
        assert r.headers["X-Proxima-Session-Id"] == a["session_id"]
    assert len(proxy.trajectory(a["session_id"])["completions"]) == 2
    assert proxy.trajectory(b["session_id"])["completions"] == []

    # B's own key still works, and B is untouched by A's attempts.
    mine = httpx.get(other, headers=_auth(b["api_key"]))
    assert (
        mine.status_code == 200
        and mine.json()["status"] == "open"
        and mine.json()["reward"] is None
    )


def test_weight_version_must_fit_the_store(proxy: LiveProxy, tmp_path: Path) -> None:
    """Versions are stored per token as int32: a bigger one must be refused up front.

    Accepted, it would switch every backend and then fail every recorded
    completion with a 500 (the codec cannot encode it).
    """
    before = httpx.get(proxy.url + "/health").json()["version"]
    r = httpx.post(
        proxy.url + "/admin/weights",
        json={"version": 2**31, "path": str(tmp_path)},
        headers=proxy.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "version"
    assert httpx.get(proxy.url + "/health").json()["version"] == before
