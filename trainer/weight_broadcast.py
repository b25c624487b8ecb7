"""Broadcast pushes: the trainer sends a version's full weights to every backend itself.

:class:`BroadcastWeightSink` is the ``WeightSink`` of ``[trainer.weights] transport =
"broadcast"`` (``proxima.trainer.weights_config``). Its weights come from one of two places:

- the trainer's memory (:meth:`BroadcastWeightSink.push_from`, or a ``source`` given to
  the sink: the model's tensors by HF name, tied ones once, cast to ``[trainer.weights]
  dtype``), with nothing written or read on disk by the push: the trainer loop exports
  the version after the push is acknowledged (the recovery rule of
  ``proxima.trainer.weights``);
- else the version's export at ``path`` (backends without in-memory HF tensors export
  before the push), read back byte for byte, so what is broadcast is what was exported.

A push, with the proxy (``proxima.proxy.api.weight_groups``):

1. Unless a group is open: ``GET /admin/weights/group`` (members, world size), then join a
   new process group as rank 0 (hosting its rendezvous on ``master_address`` and a free
   port) while ``POST /admin/weights/group`` has every backend join it: one group spans
   the trainer and every backend's workers, so each bucket is one broadcast to all.
2. Plan buckets (``bucket_mb`` each, tensors in the source's order, ordered within a bucket
   so every flattened offset is aligned) and, while ``POST /admin/weights {version, path,
   broadcast}`` has the proxy pause generation and relay each bucket to every backend,
   broadcast them in the same order (``proxima.proxy.embedded.process_group``), each as
   one flat buffer. Two buffers are kept across pushes (:class:`BucketBuffers`; a fresh
   one costs a page fault per page, as much as the transfer on a loaded CPU): the next
   bucket is filled (copied from memory, or read from the export) while one is sent.

A 409 ``weight_group_stale`` (a backend came, went or restarted since the group opened:
nothing was paused) opens a new group and pushes again, once. Any other failure (the
group cannot form, a backend died mid-push, the proxy went away) forgets the group and,
with ``fallback_to_disk``, pushes the same version from disk (``ProxyWeightSink``, whose
409 handling also settles a broadcast push whose answer was lost; a push from memory has
the version exported first); otherwise it raises ``WeightPushError``. A LoRA adapter's
push always goes from disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
import torch.distributed as dist
from proxima.proxy.embedded.process_group import (
    FLATTENED_BUCKET,
    TensorSpec,
    destroy_process_group,
    flat_offsets,
    init_custom_process_group,
    torch_dtype,
)
from proxima.proxy.serving import free_port
from proxima.trainer.weight_buckets import (
    BroadcastFailed,
    BucketBuffers,
    ExportReader,
    Filler,
    MemoryPacker,
    TensorSource,
    bucket_body,
    memory_specs,
    plan_buckets,
    read_specs,
)
from proxima.trainer.weights import ProxyWeightSink, PushResult, WeightPushError
from proxima.trainer.weights_config import WeightsConfig

logger = logging.getLogger(__name__)


class GroupStale(BroadcastFailed):
    """The proxy's group is not the one the trainer holds (nothing was paused)."""


def local_address(proxy_url: str) -> str:
    """This host's address on the route to the proxy (where backends near it reach us)."""
    host = urlsplit(proxy_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent; the kernel picks the interface
        return str(s.getsockname()[0])


def _wire_dtype(name: str) -> torch.dtype | None:
    """``[trainer.weights] dtype``: a torch dtype, None for ``auto`` (the tensors' own)."""
    return None if name == "auto" else torch_dtype(name)


def _refusal(resp: httpx.Response) -> tuple[str | None, str]:
    """An error answer's code and ``"<status> <code>: <message>"`` (the proxy's envelope)."""
    try:
        error = resp.json()["error"]
        code, message = error.get("code"), str(error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = None, resp.text[:500]
    return code, f"{resp.status_code} {code or ''}: {message}"


# --------------------------------------------------------------------------- the trainer's group


@dataclass
class TrainerGroup:
    """The trainer's end of one weight-update group (it is rank 0)."""

    name: str
    world_size: int
    group: dist.ProcessGroup
    device: str

    def send(
        self,
        buckets: list[list[TensorSpec]],
        filler: Filler,
        buffers: BucketBuffers,
        after_bucket: Callable[[int], None] | None = None,
    ) -> dict[str, float]:
        """Broadcast every bucket in order as one flat buffer each (blocking; in a thread);
        the seconds spent filling buffers and on the wire.

        Each bucket's bytes are filled into one of ``buffers`` (from memory or the export),
        the next one while the current one is on the wire. A failed broadcast (a receiver
        died) releases the group: the proxy stops the push at the same bucket, so no
        receiver waits for the next one.
        """
        times = {"fill_s": 0.0, "wire_s": 0.0, "wait_fill_s": 0.0}

        def fill(index: int) -> torch.Tensor:
            started = time.monotonic()
            bucket = buckets[index]
            flat = filler.in_place(bucket, self.device)
            if flat is None:
                flat = buffers.get(index, flat_offsets(bucket)[-1][1])
                filler.fill(bucket, flat)
            times["fill_s"] += time.monotonic() - started
            return flat

        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-fill") as pool:
                upcoming = pool.submit(fill, 0)
                for index in range(len(buckets)):
                    waiting = time.monotonic()
                    flat = upcoming.result()
                    sending = time.monotonic()
                    times["wait_fill_s"] += sending - waiting
                    if index + 1 < len(buckets):  # into the other buffer, whose bucket is sent
                        upcoming = pool.submit(fill, index + 1)
                    dist.broadcast(flat.to(self.device), src=0, group=self.group)
                    times["wire_s"] += time.monotonic() - sending
                    if after_bucket is not None:
                        after_bucket(index)
        except Exception:
            self.destroy()
            raise
        finally:
            filler.close()
        return times

    def destroy(self) -> None:
        with contextlib.suppress(Exception):  # a broken group may not close cleanly
            destroy_process_group(self.group)


async def _forget(group: TrainerGroup, sending: asyncio.Future[Any] | None) -> None:
    """Destroy ``group`` once its sender thread (if any) has given up."""
    if sending is not None:
        with contextlib.suppress(Exception):
            await sending
    await asyncio.to_thread(group.destroy)


# --------------------------------------------------------------------------- the sink


class BroadcastWeightSink:
    """Full weights by broadcast over a process group, adapters (and fallbacks) from disk.

    ``proxy_url`` is one proxy (the first of a comma-separated list: the group lives in the
    replica that opened it). ``after_bucket(i)`` is called after bucket ``i`` was sent.

    ``source``: the trainer's weights in memory (:data:`TensorSource`); a push then sends
    them (as :meth:`push_from` does), cast to ``dtype`` (the dtype the backends serve;
    None: ``settings.dtype``), and reads nothing from ``path``, which is only recorded as
    the version's (where a restarted backend, a restore or a fallback push loads it from).
    Without one, a push sends the export at ``path`` byte for byte.
    """

    def __init__(
        self,
        proxy_url: str,
        *,
        admin_token: str | None,
        settings: WeightsConfig,
        timeout_s: float = 600.0,
        after_bucket: Callable[[int], None] | None = None,
        source: TensorSource | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.disk = ProxyWeightSink(proxy_url, admin_token=admin_token, timeout_s=timeout_s)
        self.url = self.disk.proxy_url
        self.settings = settings
        self.after_bucket = after_bucket
        self.source = source
        self.dtype = dtype if dtype is not None else _wire_dtype(settings.dtype)
        self.device = "cuda" if settings.backend == "nccl" else "cpu"
        # Bucket buffers of pushes from memory (on the group's device) and from an export.
        self._buffers = {True: BucketBuffers(self.device), False: BucketBuffers("cpu")}
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0)
        )
        self._group: TrainerGroup | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        """Push ``version``: by broadcast (full weights), else from disk (see the module)."""
        if adapter is not None:
            return await self.disk.push(version=version, path=path, adapter=adapter)
        return await self._push(version, path, self.source, None)

    async def push_from(
        self,
        *,
        version: int,
        path: Path,
        source: TensorSource,
        export: Callable[[], Awaitable[Path]],
    ) -> PushResult:
        """Push ``version`` from ``source`` (the trainer's memory), nothing read or written;
        ``path`` (where the trainer exports it later) is recorded as the version's. A
        fallback to disk calls ``export()`` first."""
        return await self._push(version, path, source, export)

    async def _push(
        self,
        version: int,
        path: Path,
        source: TensorSource | None,
        export: Callable[[], Awaitable[Path]] | None,
    ) -> PushResult:
        try:
            try:
                return await self._push_once(version, path, source)
            except GroupStale as exc:
                logger.info("weight-update group stale (%s): opening a new one", exc)
                return await self._push_once(version, path, source)
        except BroadcastFailed as exc:
            if not self.settings.fallback_to_disk:
                raise WeightPushError(f"broadcast push of version {version} failed: {exc}") from exc
            logger.warning(
                "broadcast push of version %s failed (%s); pushing from disk", version, exc
            )
            if export is not None:
                path = await export()
            return await self.disk.push(version=version, path=path)

    async def _push_once(self, version: int, path: Path, source: TensorSource | None) -> PushResult:
        started = time.monotonic()
        group = self._group or await self._open_group()
        opened = time.monotonic()
        filler: Filler
        if source is not None:
            specs, tensors = memory_specs(source, self.dtype)
            filler = MemoryPacker(tensors)
        else:
            specs, files = read_specs(path)
            filler = ExportReader(files)
        buckets = plan_buckets(specs, int(self.settings.bucket_mb * 2**20))
        body = {
            "version": version,
            "path": str(path),
            "broadcast": {
                "group_name": group.name,
                "buckets": [bucket_body(b) for b in buckets],
                "load_format": FLATTENED_BUCKET,
                "timeout_s": self.settings.timeout_s,
            },
        }
        sending = asyncio.ensure_future(
            asyncio.to_thread(
                group.send, buckets, filler, self._buffers[source is not None], self.after_bucket
            )
        )
        try:
            resp = await self._post("/admin/weights", body)
        except BroadcastFailed:
            self._drop(group, sending)
            raise
        if resp.status_code != 200:
            self._drop(group, sending)
            code, message = _refusal(resp)
            message = f"POST /admin/weights answered {message}"
            if code == "version_not_newer":
                return await self._already_served(version, path, started, message)
            raise GroupStale(message) if code == "weight_group_stale" else BroadcastFailed(message)
        times: dict[str, float] = {}
        try:
            times = await asyncio.wait_for(asyncio.shield(sending), self.settings.timeout_s)
        except Exception as exc:  # it landed on the backends that answered; the group broke
            logger.warning("version %s landed, but the weight-update group broke: %r", version, exc)
            self._drop(group, sending)
        await self.disk.confirm(version, pushed_to=self.url)
        answer = resp.json()
        return PushResult(
            version=version,
            path=str(path),
            proxy_seconds=float(answer.get("seconds", 0.0)),
            http_seconds=time.monotonic() - started,
            transport="broadcast",
            breakdown={"open_s": opened - started, "buckets": len(buckets), **times},
        )

    async def _already_served(
        self, version: int, path: Path, started: float, refusal: str
    ) -> PushResult:
        """A 409 ``version_not_newer``: success if the proxy serves ``version`` (an earlier
        attempt landed and its answer was lost), else another trainer pushes here."""
        served = await self.disk.served_version(self.url)
        if served != version:
            raise WeightPushError(
                f"the proxy refused version {version}: it serves version {served}; is another "
                f"trainer pushing to this proxy? ({refusal})"
            )
        return PushResult(version, str(path), 0.0, time.monotonic() - started, "broadcast")

    async def _open_group(self) -> TrainerGroup:
        """Join a new group as rank 0 while the proxy has every backend join it."""
        resp = await self._get("/admin/weights/group")
        world_size = int(resp.json()["world_size"])
        address = self.settings.master_address or local_address(self.url)
        port = self.settings.master_port or free_port("0.0.0.0")  # the store listens on all
        name = f"proxima-{uuid.uuid4().hex[:12]}"
        joining = asyncio.ensure_future(
            asyncio.to_thread(
                init_custom_process_group,
                backend=self.settings.backend,
                master_address=address,
                master_port=port,
                world_size=world_size,
                rank=0,
                group_name=name,
                timeout_s=self.settings.timeout_s,
            )
        )
        body = {
            "group_name": name,
            "master_address": address,
            "master_port": port,
            "backend": self.settings.backend,
            "world_size": world_size,
            "timeout_s": self.settings.timeout_s,
        }
        try:
            opened = await self._post("/admin/weights/group", body)
        except BroadcastFailed:
            self._abandon(joining)
            raise
        if opened.status_code != 200:
            self._abandon(joining)
            raise BroadcastFailed(
                f"the weight-update group could not form: POST /admin/weights/group answered "
                f"{_refusal(opened)[1]}"
            )
        try:
            pg = await asyncio.wait_for(joining, self.settings.timeout_s + 5)
        except Exception as exc:
            raise BroadcastFailed(f"joining the weight-update group failed: {exc!r}") from exc
        self._group = TrainerGroup(name, world_size, pg, self.device)
        logger.info("weight-update group %s open: world size %d", name, world_size)
        return self._group

    def _drop(self, group: TrainerGroup, sending: asyncio.Future[Any] | None) -> None:
        """Forget ``group``; destroy it once its sender thread has given up."""
        if self._group is group:
            self._group = None
        self._track(_forget(group, sending))

    def _abandon(self, joining: asyncio.Future[dist.ProcessGroup]) -> None:
        """A join the proxy gave up on: it times out; destroy it if it ever completes."""

        async def settle() -> None:
            with contextlib.suppress(Exception):
                pg = await joining
                await asyncio.to_thread(destroy_process_group, pg)

        self._track(settle())

    def _track(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _get(self, route: str) -> httpx.Response:
        try:
            resp = await self._client.get(self.url + route)
        except httpx.HTTPError as exc:
            raise BroadcastFailed(f"GET {route} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise BroadcastFailed(f"GET {route} answered {_refusal(resp)[1]}")
        return resp

    async def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._client.post(self.url + route, json=body)
        except httpx.HTTPError as exc:
            raise BroadcastFailed(f"POST {route} failed: {exc!r}") from exc

    async def aclose(self) -> None:
        """Close the group (here and on the backends) and the HTTP clients."""
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self._client.delete(self.url + "/admin/weights/group", timeout=30.0)
            await asyncio.to_thread(group.destroy)
        for task in list(self._background):
            task.cancel()
        await self._client.aclose()
        await self.disk.aclose()
