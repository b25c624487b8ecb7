"""Embedded CPU inference engine serving SGLang's native HTTP API.

The proxy talks to it exactly as to a real SGLang server. A single worker
thread owns an HF causal LM (float32, CPU) and runs continuous batching: new
requests are prefilled one at a time and join a batched decode step over a
left-padded KV cache; finished or aborted rows leave between steps.

Public API: :func:`create_engine_app`, :func:`run_engine`, and :class:`Engine`
for in-process use.
"""

from proxy.engine.app import create_engine_app, run_engine
from proxy.engine.engine import Engine, EngineError, EngineUnavailableError, InvalidRequestError
from proxy.engine.live import EngineServer

__all__ = [
    "Engine",
    "EngineError",
    "EngineServer",
    "EngineUnavailableError",
    "InvalidRequestError",
    "create_engine_app",
    "run_engine",
]
