"""OpenAI Chat Completions: ``POST /v1/chat/completions``."""

from proxima.proxy.surfaces.chat.routes import generation
from proxima.proxy.surfaces.surface import Surface

SURFACE = Surface("chat", [generation], "/v1/chat/completions")
