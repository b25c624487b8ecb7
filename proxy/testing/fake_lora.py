"""The fake SGLang's LoRA adapters: SGLang's registry of names, paths and users, no tensors.

With ``enable_lora`` (SGLang's ``--enable-lora``) the fake SGLang server
(``proxima.proxy.testing.fake_sglang``) keeps its adapters here: ``/load_lora_adapter`` reads
the peft directory's ``adapter_config.json`` and refuses a name already loaded, a rank over
``max_lora_rank`` or a DoRA adapter with SGLang's messages; ``/unload_lora_adapter``
unregisters the name at once, then waits until the requests running with it finish
(``LoRARegistry.wait_for_unload``); a ``/generate`` naming an adapter never loaded is
refused before any token, and one unloaded earlier is loaded again from its old path
(``TokenizerManager._resolve_lora_path``).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

from proxima.proxy.backends.protocol import (
    LoadLoRAAdapterBody,
    LoRAUpdateResponse,
    UnloadLoRAAdapterBody,
)
from proxima.proxy.testing.sglang_routes import RequestRefused


class FakeLoRA:
    """SGLang's adapter registry: names, paths, and the requests using each loaded copy.

    Each load gets a fresh id (``LoRARef.lora_id``) and its own count of running
    requests, so an unload waits only for the requests of the copy it removes.
    """

    def __init__(self, *, max_lora_rank: int | None = None):
        self.max_lora_rank = max_lora_rank
        self.registry: dict[str, tuple[str, str]] = {}  # name -> (lora_id, path), in load order
        self.ever_loaded: dict[str, str] = {}  # name -> path (TokenizerManager.lora_ref_cache)
        self.users: dict[str, int] = {}  # lora_id -> running requests
        self.loads = 0
        self._lock = asyncio.Lock()  # lora_update_lock
        self._released = asyncio.Condition()

    def loaded(self) -> dict[str, str]:
        return {name: path for name, (_, path) in self.registry.items()}

    def _result(self, success: bool, error: str = "") -> LoRAUpdateResponse:
        return LoRAUpdateResponse(
            success=success, error_message=error, loaded_adapters=self.loaded()
        )

    def _check_adapter(self, name: str, path: str) -> None:
        """``LoRAConfig`` and ``LoRAManager.validate_new_adapter``'s checks, their messages."""
        if not os.path.isdir(path):
            # SGLang takes a path that is not a directory for a Hugging Face repo id
            # (snapshot_download); an absolute path fails huggingface_hub's validation.
            raise ValueError(
                "Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                f"'{path}'. Use `repo_type` argument if needed."
            )
        with open(os.path.join(path, "adapter_config.json")) as f:  # FileNotFoundError's text
            config = json.load(f)
        rank = config["r"]
        _ = (config["lora_alpha"], config["target_modules"])  # a KeyError as SGLang's
        if config.get("use_dora", False):
            raise ValueError(
                f"Failed to load {name} because LoRA serving currently doesn't support DoRA "
                "adapters"
            )
        if name in self.registry:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is within "
                "the configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`."
            )

    async def load(self, body: LoadLoRAAdapterBody) -> LoRAUpdateResponse:
        async with self._lock:
            return self._load_locked(body.lora_name, body.lora_path)

    def _load_locked(self, name: str, path: str) -> LoRAUpdateResponse:
        try:
            self._check_adapter(name, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._result(False, str(exc))
        lora_id = uuid.uuid4().hex
        self.registry[name] = (lora_id, path)
        self.ever_loaded[name] = path
        self.users[lora_id] = 0
        self.loads += 1
        return self._result(True)

    async def unload(self, body: UnloadLoRAAdapterBody) -> LoRAUpdateResponse:
        async with self._lock:
            entry = self.registry.pop(body.lora_name, None)
            if entry is None:
                keys = list(self.registry)
                return LoRAUpdateResponse(
                    success=False,
                    error_message=f"LoRA with name {body.lora_name} does not exist. "
                    f"Loaded LoRAs: odict_keys({keys})",
                )
            lora_id = entry[0]
            async with self._released:  # the requests already running with it finish first
                await self._released.wait_for(lambda: self.users[lora_id] == 0)
            del self.users[lora_id]
            return self._result(True)

    async def acquire(self, name: str) -> str:
        """The id of the copy a new request of ``name`` runs with (counted until released)."""
        if name not in self.registry:
            if name not in self.ever_loaded:
                raise RequestRefused(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: dict_keys({list(self.ever_loaded)})."
                )
            async with self._lock:  # reload the evicted adapter, after any unload in progress
                if name not in self.registry:
                    result = self._load_locked(name, self.ever_loaded[name])
                    if not result.success:
                        raise RequestRefused(
                            f"Failed to implicitly load LoRA adapter {name}: {result.error_message}"
                        )
        lora_id = self.registry[name][0]
        self.users[lora_id] += 1
        return lora_id

    def release(self, lora_id: str) -> None:
        self.users[lora_id] -= 1

        async def notify() -> None:
            async with self._released:
                self._released.notify_all()

        asyncio.get_running_loop().create_task(notify())
