"""``Surface``: what one API contributes to the proxy.

A surface is one wire API (Chat Completions, Completions, Responses,
Messages): its routers, the path its routes live under, and the envelope its
errors are written in. The core (service, driver, generation, store) speaks
only the canonical request and events; a surface translates into the one and
renders the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter
from proxima.proxy.errors import OPENAI_ENVELOPE, ErrorEnvelope


@dataclass(frozen=True)
class Surface:
    """One API: its name, its routers, the path its errors are answered under, its envelope."""

    name: str
    routers: Sequence[APIRouter]
    path: str
    errors: ErrorEnvelope = field(default=OPENAI_ENVELOPE)
