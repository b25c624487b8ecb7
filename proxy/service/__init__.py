"""The completion service: one pipeline behind every API surface.

    route (proxy/api/<api>.py)            validates the body (pydantic schema)
      -> translation (api/<api>_translate.py)   body -> CanonicalRequest
      -> CompletionService.prepare          session, prompt ids, token budget
      -> CompletionService.stream/complete  the driver runs n choices, the
                                            service commits them to the store
      -> builder (service/builders/<api>.py)   events -> the API's JSON or SSE

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
- ``service``: sessions, generation and recording (``CompletionService``);
- ``builders``: one module per API surface (``chat``, ``completions``).

Adding an API surface (the Responses API, Anthropic Messages) touches no
existing class:

1. ``proxy/api/<api>_schemas`` (or ``api/schemas``): its pydantic request model;
2. ``proxy/api/<api>_translate.py``: request -> ``CanonicalRequest`` (its
   messages through ``proxima.proxy.chat.normalize_messages``, its tools in
   OpenAI's function shape, its tool choice through ``resolve_tool_choice``,
   a new ``id_prefix``); API-specific refusals raise ``BadRequest`` here;
3. ``proxy/service/builders/<api>.py``: ``Completion`` -> its JSON, and the
   event stream -> its bytes (a ``Failed`` event becomes its error event);
4. ``proxy/api/<api>.py``: a router like ``proxy/api/openai.py`` (check the
   model, ``prepare``, then ``stream`` or ``complete`` into the builder),
   included in ``proxima.proxy.app.create_app``.

Records are API-neutral: a completion served through any API is recorded with
canonical request messages and the canonical assistant reply, so a session
may even switch APIs between turns.
"""

from proxima.proxy.service.service import CompletionService

__all__ = ["CompletionService"]
