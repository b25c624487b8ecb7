"""OpenAI Responses: ``POST /v1/responses``."""

from proxima.proxy.surfaces.responses.routes import router
from proxima.proxy.surfaces.surface import Surface

SURFACE = Surface("responses", [router], "/v1/responses")
