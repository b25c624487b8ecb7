"""The engine's LoRA adapter registry (SGLang's ``LoRARegistry``): names, loads, users.

The registry keeps the adapters loaded now by name, every name ever loaded (an unloaded one
is loaded again when a request names it, as SGLang does), and how many running requests use
each loaded copy. Loading reads and checks peft's directory in a thread
(``proxima.proxy.embedded.lora.read_adapter``), so generation goes on meanwhile; unloading
answers once the requests running with the adapter have finished. Its answers and refusals
are SGLang's (``LoRAUpdateResponse``, the messages of ``InvalidRequestError``).
"""

from __future__ import annotations

import asyncio
import logging

from proxima.proxy.backends.protocol import LoRAUpdateResponse
from proxima.proxy.embedded.errors import InvalidRequestError
from proxima.proxy.embedded.lora import AdapterLoadError, LoRAAdapter, LoRAHooks, read_adapter

logger = logging.getLogger(__name__)

LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class AdapterRegistry:
    """The LoRA adapters an engine serves; ``lora`` None: LoRA is not enabled."""

    def __init__(self, lora: LoRAHooks | None, max_lora_rank: int | None) -> None:
        self.lora = lora
        self.max_lora_rank = max_lora_rank
        # Loaded adapters by name, every name ever loaded (with its path), and the requests
        # using each loaded copy (by ``lora_id``).
        self._adapters: dict[str, LoRAAdapter] = {}
        self._ever_loaded: dict[str, str] = {}
        self._adapter_users: dict[str, int] = {}
        self._adapter_idle: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()

    def acquire(self, adapter: LoRAAdapter) -> None:
        """Count a request that runs with ``adapter`` (``release`` when it finishes)."""
        self._adapter_users[adapter.lora_id] = self._adapter_users.get(adapter.lora_id, 0) + 1

    def loaded_lora_adapters(self) -> dict[str, str]:
        """Loaded adapter names and their paths, in load order."""
        return {name: adapter.path for name, adapter in self._adapters.items()}

    def _lora_result(self, error: str | None = None) -> LoRAUpdateResponse:
        return LoRAUpdateResponse(
            success=error is None,
            error_message=error or "",
            loaded_adapters=self.loaded_lora_adapters(),
        )

    async def load_lora_adapter(self, name: str, path: str) -> LoRAUpdateResponse:
        """Read ``path`` (peft's directory) in a thread and serve it as ``name``; generation
        goes on meanwhile. SGLang's refusals: LoRA not enabled, a name already loaded."""
        if self.lora is None:
            return LoRAUpdateResponse(success=False, error_message=LORA_NOT_ENABLED)
        async with self._lock:
            return await self._load_locked(name, path)

    async def _load_locked(self, name: str, path: str) -> LoRAUpdateResponse:
        assert self.lora is not None
        if name in self._adapters:
            return self._lora_result(
                f"Failed to load LoRA adapter {name} because it is already loaded"
            )
        try:
            adapter = await asyncio.to_thread(
                read_adapter, path, name, self.lora.linears, max_lora_rank=self.max_lora_rank
            )
        except AdapterLoadError as exc:
            logger.warning("LoRA adapter %s not loaded from %s: %s", name, path, exc)
            return self._lora_result(str(exc))
        self._adapters[name] = adapter
        self._ever_loaded[name] = adapter.path
        logger.info("LoRA adapter %s loaded from %s (rank %d)", name, path, adapter.rank)
        return self._lora_result()

    async def unload_lora_adapter(self, name: str) -> LoRAUpdateResponse:
        """Stop serving ``name``: new requests cannot use it at once; the answer comes when
        the requests running with it have finished (SGLang's ``wait_for_unload``)."""
        if self.lora is None:
            return LoRAUpdateResponse(success=False, error_message=LORA_NOT_ENABLED)
        async with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                return LoRAUpdateResponse(
                    success=False,
                    error_message=f"LoRA with name {name} does not exist. "
                    f"Loaded LoRAs: odict_keys({list(self._adapters)})",
                )
            if self._adapter_users.get(adapter.lora_id, 0) > 0:
                idle = self._adapter_idle.setdefault(adapter.lora_id, asyncio.Event())
                await idle.wait()
            self._adapter_idle.pop(adapter.lora_id, None)
            self._adapter_users.pop(adapter.lora_id, None)
            logger.info("LoRA adapter %s unloaded", name)
            return self._lora_result()

    def release(self, adapter: LoRAAdapter) -> None:
        """A request that ran with ``adapter`` finished; an unload waiting for the last one
        goes on."""
        users = self._adapter_users[adapter.lora_id] - 1
        self._adapter_users[adapter.lora_id] = users
        if users == 0 and adapter.lora_id in self._adapter_idle:
            self._adapter_idle[adapter.lora_id].set()

    async def resolve_adapter(self, name: str) -> LoRAAdapter:
        """The adapter a request's ``lora_path`` names; one unloaded earlier is loaded again
        from its path (SGLang's reload of an evicted adapter). Raises
        :class:`InvalidRequestError` with SGLang's messages."""
        if self.lora is None:
            raise InvalidRequestError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths "
                "or /load_lora_adapter endpoint."
            )
        if name not in self._adapters:
            if name not in self._ever_loaded:
                raise InvalidRequestError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: dict_keys({list(self._ever_loaded)})."
                )
            async with self._lock:
                if name not in self._adapters:
                    logger.info("Reloading evicted adapter: %s", name)
                    result = await self._load_locked(name, self._ever_loaded[name])
                    if not result.success:
                        raise InvalidRequestError(
                            f"Failed to implicitly load LoRA adapter {name}: {result.error_message}"
                        )
        return self._adapters[name]
