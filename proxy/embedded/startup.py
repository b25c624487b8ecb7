"""The embedded engines ``proxima serve`` runs, started from its settings.

Separate processes that take seconds to import torch and load the model, so
``proxima serve`` starts them first, before it imports the app, and they load
while the proxy does. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxima.proxy.config import Settings
from proxima.proxy.embedded.launcher import EngineProcess, default_num_threads


def start_engine(settings: Settings, count: int = 1) -> EngineProcess:
    """An embedded engine, started; one of ``count`` that share the CPUs an engine gets
    (half of them), each with its share of the threads."""
    engine = EngineProcess(
        settings.model,
        num_threads=max(1, default_num_threads() // count),
        max_running_requests=settings.engine_max_running_requests,
        enable_lora=settings.enable_lora,
        max_loras_per_batch=settings.max_loras_per_batch,
        max_lora_rank=settings.max_lora_rank,
    )
    engine.start()
    return engine


@dataclass(slots=True)
class StartedEngines:
    """The embedded engines of the training and production deployments (either may be empty:
    external backends serve it)."""

    training: list[EngineProcess] = field(default_factory=list)
    production: list[EngineProcess] = field(default_factory=list)

    def stop(self) -> None:
        for engine in [*self.training, *self.production]:
            engine.stop()


def start_engines(settings: Settings) -> StartedEngines:
    """Start every embedded engine ``settings`` asks for; they load their models in parallel."""
    engines = StartedEngines()
    try:
        if not settings.backends:
            engines.training = [
                start_engine(settings, settings.engines) for _ in range(settings.engines)
            ]
        if settings.production_engine:
            engines.production = [start_engine(settings)]
    except BaseException:
        engines.stop()
        raise
    return engines
