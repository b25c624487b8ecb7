"""OpenAI Completions: ``POST /v1/completions`` (a raw prompt)."""

from proxima.proxy.surfaces.completions.routes import generation
from proxima.proxy.surfaces.surface import Surface

SURFACE = Surface("completions", [generation], "/v1/completions")
