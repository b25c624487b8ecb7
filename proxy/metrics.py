"""Prometheus metrics of the proxy (``GET /metrics``).

One registry per app (no module-level state). Request counts and latencies
come from a pure ASGI middleware keyed by route template; the rest is
observed where it happens (tokens, recorded completions, staleness of
recorded tokens, weight updates) or read at scrape time (policy version,
backend health, sessions by status).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Registered in this order, which is the order ``/metrics`` lists them in.
        self._add_http(r)
        self._add_generation(r)
        self._add_serving(r)
        self._add_deployments(r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _add_http(self, r: CollectorRegistry) -> None:
        """HTTP requests by route template: counts and latencies."""
        self.requests = Counter(
            "proxima_requests", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "proxima_request_seconds",
            "HTTP request latency (until the response ends)",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _add_generation(self, r: CollectorRegistry) -> None:
        """Tokens, recorded completions, their tokens' staleness, interrupted generations."""
        self.tokens = Counter("proxima_tokens", "Tokens processed", ["direction"], registry=r)
        self.completions = Counter(
            "proxima_completions_recorded",
            "Completions committed to the store",
            ["kind"],
            registry=r,
        )
        self.staleness = Histogram(
            "proxima_recorded_token_staleness",
            "Policy versions between a recorded token and the current policy",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=r,
        )
        self.interruptions = Counter(
            "proxima_generation_interruptions",
            "Generations resumed after an abort or a lost backend",
            registry=r,
        )

    def _add_serving(self, r: CollectorRegistry) -> None:
        """What is served: weight updates, the policy version, the backends, the sessions."""
        self.weight_updates = Histogram(
            "proxima_weight_update_seconds",
            "Duration of weight updates",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.policy_version = Gauge("proxima_policy_version", "Policy version served", registry=r)
        self.backend_healthy = Gauge(
            "proxima_backend_healthy", "1 if the backend is in the pool", ["backend"], registry=r
        )
        self.backend_in_flight = Gauge(
            "proxima_backend_in_flight", "Generations in flight", ["backend"], registry=r
        )
        self.sessions = Gauge(
            "proxima_sessions", "Sessions by kind and status", ["kind", "status"], registry=r
        )

    def _add_deployments(self, r: CollectorRegistry) -> None:
        """Per deployment (training, production, canary) and the version it served: the
        canary's error rate and latency sit next to the stable version's."""
        self.deployment_requests = Counter(
            "proxima_deployment_requests",
            "Generation requests by deployment, version and outcome (ok, error, cancelled)",
            ["deployment", "version", "outcome"],
            registry=r,
        )
        self.deployment_tokens = Counter(
            "proxima_deployment_tokens",
            "Tokens by deployment, version and direction",
            ["deployment", "version", "direction"],
            registry=r,
        )
        self.deployment_latency = Histogram(
            "proxima_deployment_request_seconds",
            "Generation latency by deployment and version (until the last token)",
            ["deployment", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.deployment_version = Gauge(
            "proxima_deployment_version",
            "Policy version a deployment serves",
            ["deployment"],
            registry=r,
        )
        self.canary_fraction = Gauge(
            "proxima_canary_fraction", "Share of production sessions on the canary", registry=r
        )
        self.adapter_fallbacks = Counter(
            "proxima_adapter_fallbacks",
            "Adapter versions marked failed (non-finite logprobs once served), fallen back from",
            ["adapter"],
            registry=r,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once per label values: prometheus_client
        validates and locks on every ``labels`` call, several times per request."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def observe_generation(
        self,
        *,
        deployment: str,
        version: int,
        seconds: float,
        outcome: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """One request served by ``deployment`` at ``version`` (its last token's version)."""
        v = str(version)
        self.child(self.deployment_requests, deployment, v, outcome).inc()
        self.child(self.deployment_latency, deployment, v).observe(seconds)
        self.child(self.deployment_tokens, deployment, v, "prompt").inc(prompt_tokens)
        self.child(self.deployment_tokens, deployment, v, "completion").inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts requests and their latency by route template and status."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            m = self.metrics
            m.child(m.requests, path, method, str(status)).inc()
            m.child(m.latency, path, method).observe(time.perf_counter() - started)
