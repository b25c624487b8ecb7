"""The completion service: one pipeline behind every API surface.

    route (proxy/surfaces/<api>/routes.py)   validates the body (its schema)
      -> surfaces/<api>/translate.py         body -> CanonicalRequest
      -> CompletionService.prepare           session, prompt ids, token budget
      -> CompletionService.stream/complete   the driver runs n choices, the
                                             service commits them to the store
      -> surfaces/<api>/events.py            events -> the API's JSON or SSE

Nothing here knows a wire shape: a surface (``proxima.proxy.surfaces``, where
the recipe for adding one lives) hands in a ``CanonicalRequest`` and renders
the events that come out.

Modules:

- ``canonical``: ``CanonicalRequest`` (canonical messages or a text prompt,
  sampling, logprobs) and the canonical assistant message that is recorded;
- ``prepare``: prompt preparation (one chat path, one text path, one context
  check) into a ``Prepared`` request;
- ``driver``: runs and multiplexes the choices, detokenizes and parses tool
  calls incrementally, and yields ``events``;
- ``events``: ``Delta`` / ``Finish`` / ``Done`` / ``Failed`` and the
  non-streaming ``Completion``;
- ``recording``: finished choices to durable completion records (the
  driver's commit step);
- ``service``: sessions, generation and recording (``CompletionService``).

Records are API-neutral: a completion served through any API is recorded with
canonical request messages and the canonical assistant reply, so a session
may even switch APIs between turns.
"""

from proxima.proxy.service.service import CompletionService

__all__ = ["CompletionService"]
