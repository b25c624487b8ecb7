"""The context window ``proxima serve`` enforces, and its refusal at start-up.

Plain functions of the settings and the model's config: the CLI checks them before
it starts anything, the lifespan again once external backends report their own.
"""

from __future__ import annotations

import json

from proxima.proxy.config import Settings


class ContextLengthMismatch(RuntimeError):
    """``--context-length`` exceeds what a backend serves: refused at start-up."""


def model_context_length(settings: Settings) -> int:
    """The model config's ``max_position_embeddings`` (what the embedded engine serves)."""
    config = json.loads((settings.model / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


def check_context_length(settings: Settings) -> None:
    """Refuse, before anything starts, a ``--context-length`` the embedded engine cannot serve.

    External backends are checked in the lifespan, once they answer.
    """
    if not settings.backends and settings.context_length:
        resolve_context_length(settings, model_context_length(settings))


def resolve_context_length(settings: Settings, backend_length: int | None) -> int:
    """The context window the proxy enforces.

    ``--context-length`` if given, else the backends' own, else the model
    config's ``max_position_embeddings``. A ``--context-length`` above what the
    backends serve would let requests through that the backend then refuses,
    so it stops the server with a message saying what to change.
    """
    if settings.context_length:
        if backend_length is not None and settings.context_length > backend_length:
            raise ContextLengthMismatch(
                f"--context-length {settings.context_length} exceeds the backend's context "
                f"length {backend_length}: lower --context-length to at most {backend_length} "
                "(or start the backend with a longer context)."
            )
        return settings.context_length
    if backend_length is not None:
        return backend_length
    return model_context_length(settings)
