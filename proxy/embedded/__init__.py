"""Embedded CPU inference engine serving SGLang's native HTTP API.

The proxy talks to it exactly as to a real SGLang server. A single worker
thread owns an HF causal LM (float32, CPU) and runs continuous batching: new
requests are prefilled one at a time and join a batched decode step over a
left-padded KV cache; finished or aborted rows leave between steps.

Modules: ``app`` (the HTTP server: :func:`create_engine_app`, :func:`run_engine`),
``engine`` (:class:`Engine`, for in-process use), ``live`` (:class:`EngineServer`
on a background thread), ``launcher`` (the engine as a child process of
``proxima serve``). Nothing is imported here, so the launcher does not pull in torch.
"""
