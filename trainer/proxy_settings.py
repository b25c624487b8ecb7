"""The settings the trainer shares with the proxy, read from the proxy at start.

The staleness rule has two numbers, the batch size ``B`` (sessions per
training step) and ``eta`` (``max_staleness``): the proxy admits a training
session only while ``N < (version + eta + 1) * B`` and the trainer claims
``B`` sessions per step and leaves tokens older than ``version - eta`` out of
the loss. They are declared once, by the proxy (``proxima serve
--train-batch-size/--max-staleness``), which serves them on
``GET /admin/config``. At start the trainer (rank 0) reads them:

- a setting its config leaves unset is taken from the proxy;
- a setting its config sets to another value is refused, with both values
  and how to fix it (the proxy's value is the one sessions were admitted by);
- a proxy without a staleness gate (``max_staleness`` unset) leaves ``eta``
  to the trainer's config (default 4): it bounds only what the trainer trains.

Without a proxy URL (tests that push to another sink) the config is used as is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
from proxima.trainer.config import TrainerConfig
from proxima.trainer.retry import Backoff, retry_after, retryable_answer

logger = logging.getLogger(__name__)

CONFIG_ROUTE = "/admin/config"


class ProxySettingsError(ValueError):
    """The proxy's settings cannot be read, or the trainer's config contradicts them."""


@dataclass(frozen=True)
class ProxySettings:
    """What ``GET /admin/config`` answers."""

    train_batch_size: int
    max_staleness: int | None


async def fetch_proxy_settings(
    proxy_url: str,
    *,
    admin_token: str | None,
    timeout_s: float = 30.0,
    retry_window_s: float = 0.0,
) -> ProxySettings:
    """``GET /admin/config`` of the proxy; raises :class:`ProxySettingsError` when it cannot.

    ``proxy_url`` may name several replicas (comma-separated): they share one
    configuration, and the first that answers is asked. A proxy that answers "not now"
    (502/503/504, 429 with ``Retry-After``: its store restarting) or drops the connection
    is asked again for ``retry_window_s`` seconds; one that refuses the connection is an
    error at once (a wrong URL should not hang the start for minutes).
    """
    urls = [u.strip() for u in proxy_url.split(",") if u.strip()]
    backoff = Backoff(retry_window_s)
    while True:
        try:
            return await _fetch_any(urls, admin_token=admin_token, timeout_s=timeout_s)
        except _NotNow as exc:
            if not await backoff.wait("reading the proxy's settings", exc, exc.retry_after):
                raise


async def _fetch_any(
    urls: list[str], *, admin_token: str | None, timeout_s: float
) -> ProxySettings:
    for url in urls[:-1]:
        try:
            return await _fetch_one(url, admin_token=admin_token, timeout_s=timeout_s)
        except ProxySettingsError as exc:
            if not isinstance(exc.__cause__, httpx.TransportError):
                raise
    return await _fetch_one(urls[-1], admin_token=admin_token, timeout_s=timeout_s)


class _NotNow(ProxySettingsError):
    """The proxy could not answer now (it may shortly): worth asking again."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


async def _fetch_one(proxy_url: str, *, admin_token: str | None, timeout_s: float) -> ProxySettings:
    url = proxy_url.rstrip("/") + CONFIG_ROUTE
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        message = f"cannot read the proxy's settings at {url}: {exc!r}"
        if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.ConnectError):
            raise _NotNow(message) from exc
        raise ProxySettingsError(message) from exc
    if response.status_code in (401, 403):
        raise ProxySettingsError(
            f"the proxy refused GET {url} ({response.status_code}): give the trainer the proxy's "
            "admin token (--admin-token or PROXIMA_ADMIN_TOKEN)"
        )
    if response.status_code == 404:
        raise ProxySettingsError(
            f"the proxy at {proxy_url} has no {CONFIG_ROUTE}: it is older than this trainer; "
            "run the same Proxima version on both"
        )
    if response.status_code != 200:
        message = f"GET {url} answered {response.status_code}: {response.text[:300]}"
        if retryable_answer(response):
            raise _NotNow(message, retry_after(response))
        raise ProxySettingsError(message)
    body: Any = response.json()
    try:
        batch, eta = body["train_batch_size"], body["max_staleness"]
    except (TypeError, KeyError) as exc:
        raise ProxySettingsError(f"GET {url} answered an unexpected body: {body!r}") from exc
    return ProxySettings(
        train_batch_size=int(batch), max_staleness=None if eta is None else int(eta)
    )


def adopt_proxy_settings(
    cfg: TrainerConfig, settings: ProxySettings, *, proxy_url: str
) -> TrainerConfig:
    """``cfg`` with the proxy's ``batch_size`` and ``max_staleness`` (module docstring).

    Raises :class:`ProxySettingsError` when ``cfg`` sets either to a value the proxy does not use.
    """
    explicit = cfg.model_fields_set
    updates: dict[str, int] = {}
    conflicts: list[str] = []
    pairs = [("batch_size", "train_batch_size", "--train-batch-size", settings.train_batch_size)]
    if settings.max_staleness is not None:
        pairs.append(("max_staleness", "max_staleness", "--max-staleness", settings.max_staleness))
    for name, proxy_name, flag, value in pairs:
        mine = getattr(cfg, name)
        if name in explicit and mine != value:
            conflicts.append(
                f"{name} = {mine} in the trainer config, but the proxy at {proxy_url} runs with "
                f"{proxy_name} = {value} (proxima serve {flag} {value}); remove {name} from the "
                f"trainer config to use the proxy's, or restart the proxy with {flag} {mine}"
            )
        updates[name] = value
    if conflicts:
        raise ProxySettingsError(
            "the trainer and the proxy must share the staleness rule's settings, declared by "
            "the proxy: " + "; ".join(conflicts)
        )
    adopted = TrainerConfig.model_validate({**cfg.model_dump(), **updates})
    logger.info(
        "settings from the proxy",
        extra={
            "batch_size": adopted.batch_size,
            "max_staleness": adopted.max_staleness,
            "proxy_gate": settings.max_staleness is not None,
        },
    )
    return adopted
