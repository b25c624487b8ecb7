"""The API surfaces: one folder per wire API over one core that knows none of them.

    proxy/surfaces/<name>/
      schema.py     its request body (pydantic; unknown fields judged here or in translate)
      translate.py  body -> CanonicalRequest (messages, tools, tool choice, sampling), and
                    its own refusals (``BadRequest`` naming its own parameter)
      events.py     Completion -> its JSON; the event stream -> its bytes (``Failed`` -> its
                    error event)
      routes.py     its router: check the model, translate, ``prepare``, then ``stream``
                    or ``complete`` into events.py
      __init__.py   ``SURFACE``: its name, routers, path and error envelope
      errors.py     only for a surface whose errors are not in OpenAI's envelope

The core never imports a surface: ``proxima.proxy.service`` takes a
``CanonicalRequest`` and yields ``proxima.proxy.service.events``; the one
error table (``proxima.proxy.errors.KINDS``) gives every error its status, and
a surface's envelope (``Surface.errors``) only writes it in its shape. No
surface reads another's body: each translates straight into the canonical
request, and its errors name its own fields. Shared pieces: ``conversation``
(no wire shape: messages, tools and tool choice into the canonical
``ChatInput``, a body's strings checked), ``openai_common`` (what the OpenAI
surfaces share: sampling fields, logprobs), ``reasoning_options`` (thinking
switches), ``sse`` (event framing).

Adding a surface (a new API, or a harness's dialect of one):

1. copy the folder of the surface closest to it (``responses`` for an
   OpenAI-shaped API, ``messages`` for one with its own error shape);
2. write its schema, its translation to ``CanonicalRequest`` (a conversation
   through ``conversation.chat_input``: messages in OpenAI's chat shape, tools
   as ``conversation.function_tool`` builds them, the tool choice as OpenAI's
   chat API spells it; ``Sampling.asked``; a new ``id_prefix``; 400s naming
   its own fields) and its events;
3. add its ``SURFACE`` to :data:`SURFACES` below: ``create_app`` includes its
   routers and the error edge answers under its ``path`` in its envelope.

A new field of an existing surface (a harness's extension) is a field of its
schema and a line of its translation; nothing outside its folder changes.
"""

from __future__ import annotations

from proxima.proxy.errors import ErrorEnvelope
from proxima.proxy.surfaces import chat, completions, messages, responses
from proxima.proxy.surfaces.surface import Surface

SURFACES: tuple[Surface, ...] = (
    chat.SURFACE,
    completions.SURFACE,
    responses.SURFACE,
    messages.SURFACE,
)
"""Every API the proxy speaks; one line per surface."""


def envelope_for(path: str) -> ErrorEnvelope | None:
    """The error envelope of the surface serving ``path`` (None: not a surface's path)."""
    return next((s.errors for s in SURFACES if path.startswith(s.path)), None)


__all__ = ["SURFACES", "Surface", "envelope_for"]
