"""The second line of defence against a bad adapter push: fall back to the last good version.

A push is screened (``check_adapter_config`` at the route, the engine's weight screen), but
an adapter may still yield non-finite logprobs once served (a backend that checks less, a
numerical edge the screen's bounds do not catch). Then every request of its tenant would be
a 503. Instead, when the generation loop sees a non-finite logprob from version ``v`` of an
adapter, it hands the attempt to :meth:`AdapterGuard.fall_back`, which:

1. checks the adapter is at fault: the same prompt on the same backend without the adapter
   (the base) yields a finite logprob; a backend or base that is broken too is not the
   adapter's doing, and the request is a 503 as before;
2. under the fleet's publish lock (as a push), if the pool still serves ``v``: marks ``v``
   failed in the store (``Store.fail_adapter_version``, with the backend's error; it is never
   a head again, so other replicas and restarted ones skip it) and loads the adapter's newest
   good version below ``v`` (version 0, the bare base, when there is none) on the pool;
3. counts it (``proxima_adapter_fallbacks_total{adapter}``) and logs it.

It answers True when the adapter serves another version than ``v`` by then (this fall-back,
another request's, or a newer push): the request resumes there. ``/admin/versions?adapter=``
shows the failed version (``failed``: when and why).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from proxima.proxy.backends.errors import BackendError
from proxima.proxy.backends.pool import Backend, BackendPool
from proxima.proxy.backends.protocol import GenerateRequest, SamplingParams
from proxima.proxy.backends.sglang import NonFiniteLogprob
from proxima.proxy.metrics import Metrics
from proxima.proxy.store.errors import NotFound
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BrokenAdapter:
    """An attempt whose adapter version yielded a non-finite logprob."""

    pool: BackendPool
    backend: Backend
    adapter: str
    version: int  # > 0: a pushed version
    lora: str  # the name it is loaded under on the backend
    error: NonFiniteLogprob
    input_ids: list[int]  # the attempt's prompt


class AdapterGuard:
    """Falls an adapter back to its last good version when a served version breaks."""

    def __init__(self, *, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics

    async def fall_back(self, broken: BrokenAdapter) -> bool:
        """Module docstring; True: retry the request, the adapter serves another version."""
        pool, adapter, version = broken.pool, broken.adapter, broken.version
        if pool.policy(adapter)[0] != version:
            return True  # moved on already
        if not await self._base_is_finite(broken):
            return False
        async with self.store.publish_lock(), pool.publish_lock:
            if pool.policy(adapter)[0] != version:
                return True
            try:
                good = await self.store.fail_adapter_version(
                    adapter=adapter, version=version, reason=str(broken.error)
                )
            except NotFound:  # a version the store never recorded: not a push to undo
                return False
            target = 0 if good is None else good.version
            path = None if good is None else good.path
            try:
                await pool.update_adapter(adapter=adapter, version=target, path=path)
            except (BackendError, ValueError) as exc:
                logger.error("adapter %s could not fall back to v%s: %s", adapter, target, exc)
                return False
        self.metrics.adapter_fallbacks.labels(adapter).inc()
        logger.error(
            "adapter %s version %s yields non-finite logprobs (%s): marked failed, serving "
            "version %s",
            adapter,
            version,
            broken.error,
            target,
        )
        return True

    async def _base_is_finite(self, broken: BrokenAdapter) -> bool:
        """Whether the attempt's prompt without the adapter gives a finite logprob there."""
        probe = GenerateRequest(
            input_ids=broken.input_ids,
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=True,
            rid=f"adapter-probe-{uuid.uuid4().hex}#",
        )
        try:
            async for _ in broken.backend.client.generate_stream(probe):
                pass
        except NonFiniteLogprob:
            logger.error("the base yields non-finite logprobs too on %s", broken.backend.url)
            return False
        except BackendError as exc:
            logger.warning("adapter %s's probe failed: %s", broken.adapter, exc)
            return False
        return True
