"""Anthropic Messages: ``POST /v1/messages`` and ``/v1/messages/count_tokens``."""

from proxima.proxy.surfaces.messages.errors import ANTHROPIC
from proxima.proxy.surfaces.messages.routes import generation, router
from proxima.proxy.surfaces.surface import Surface

SURFACE = Surface("messages", [generation, router], "/v1/messages", errors=ANTHROPIC)
