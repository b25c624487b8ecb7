"""The surface registry: every registered API is served, answers errors in its own
envelope, the core imports none of them, and none imports another."""

from __future__ import annotations

import ast
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.errors import OPENAI_ENVELOPE
from proxima.proxy.surfaces import SURFACES, envelope_for
from proxima.proxy.surfaces.messages.errors import ANTHROPIC

PROXY = Path(__file__).resolve().parents[3] / "proxy"


def test_each_surface_is_served_and_answers_a_bad_body_in_its_envelope() -> None:
    app = FastAPI()
    install_error_handlers(app)
    for surface in SURFACES:
        for router in surface.routers:
            app.include_router(router)
    client = TestClient(app, raise_server_exceptions=False)
    for surface in SURFACES:
        resp = client.post(surface.path, content=b"{", headers={"content-type": "application/json"})
        assert resp.status_code == 400, (surface.name, resp.text)
        body = resp.json()
        if surface.errors is ANTHROPIC:
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["type"] == "invalid_request_error", surface.name


def test_envelope_is_the_paths_surfaces() -> None:
    """Each registered surface's own paths answer in its envelope; others fall to OpenAI's."""
    for surface in SURFACES:
        for router in surface.routers:
            for route in router.routes:
                assert envelope_for(route.path) is surface.errors, (surface.name, route.path)
    assert envelope_for("/v1/messages/count_tokens") is ANTHROPIC
    assert envelope_for("/v1/chat/completions") is OPENAI_ENVELOPE
    assert envelope_for("/rl/sessions") is None


def test_the_core_imports_no_surface() -> None:
    core = [*(PROXY / "service").glob("*.py"), *(PROXY / "store").glob("*.py")]
    core += [
        *(PROXY / "backends").glob("*.py"),
        PROXY / "service" / "generation.py",
        PROXY / "rendering" / "sampling.py",
    ]
    for path in core:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("proxima.proxy.surfaces"), path


def test_no_surface_reads_another_surfaces_folder() -> None:
    """A surface is one folder: what surfaces share lives beside the folders
    (``conversation``, ``openai_common``, ``reasoning_options``, ``sse``)."""
    folders = [p for p in (PROXY / "surfaces").iterdir() if (p / "__init__.py").exists()]
    assert {p.name for p in folders} == {s.name for s in SURFACES}
    for folder in folders:
        others = {f"proxima.proxy.surfaces.{p.name}" for p in folders if p != folder}
        for path in folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                    hit = {n for n in names for o in others if n == o or n.startswith(o + ".")}
                    assert not hit, (path, hit)
