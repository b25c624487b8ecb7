"""The engine's asyncio-facing side: load the model, submit requests, control the worker.

Nothing here runs the model. :class:`Engine` validates requests, hands them to
the :class:`~proxy.embedded.worker.EngineWorker` thread, and returns a
:class:`~proxy.embedded.handle.RequestHandle` that turns the worker's deltas into
cumulative :class:`GenerationState` snapshots. Every await is on an asyncio queue or
a future, so the event loop never blocks on a forward pass. LoRA adapters are kept
by its :class:`~proxy.embedded.adapter_registry.AdapterRegistry`; its errors are
those of ``proxima.proxy.embedded.errors`` (importable from here too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from pathlib import Path

import torch
from proxima.proxy.backends.protocol import (
    LoRAUpdateResponse,
    SamplingParams,
    UpdateWeightsResponse,
)
from proxima.proxy.embedded import worker as cmd
from proxima.proxy.embedded.adapter_registry import AdapterRegistry
from proxima.proxy.embedded.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
)
from proxima.proxy.embedded.grammar import GrammarCompiler, InvalidGrammarError, grammar_of
from proxima.proxy.embedded.handle import GenerationState, RequestHandle
from proxima.proxy.embedded.launcher import default_num_threads
from proxima.proxy.embedded.lora import LoRAAdapter, LoRAHooks
from proxima.proxy.embedded.requests import DeltaSink, WorkerRequest
from proxima.proxy.embedded.sampling import make_generator
from proxima.proxy.embedded.weights import WeightLoadError, load_checked_state_dict
from proxima.proxy.embedded.worker import EngineWorker, WorkerStats
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

logger = logging.getLogger(__name__)


__all__ = [
    "Engine",
    "EngineError",
    "EngineUnavailableError",
    "GenerationState",
    "InvalidRequestError",
    "RequestHandle",
]


class Engine:
    """An HF causal LM served with continuous batching on CPU (float32).

    Construction loads the model (blocking; call it via ``asyncio.to_thread``
    from async code). :meth:`start` launches the worker thread and
    :meth:`stop` ends it, aborting whatever is still running.

    Args:
        model_dir: HF model directory (config, safetensors, tokenizer).
        weight_version: version reported until the first weight update.
        max_running_requests: rows in the decode batch; more requests wait.
        max_prefill_tokens: prompt tokens prefilled per scheduler iteration
            (at least one prompt), bounding the decode stall new prompts cause.
        num_threads: torch intra-op threads (process-wide); default half the
            available CPUs.
        enable_lora: serve LoRA adapters (SGLang's ``--enable-lora``): load and
            unload them at run time, each request names one in ``lora_path``.
        max_loras_per_batch: most distinct adapters in the running batch;
            requests of another adapter wait (SGLang's ``--max-loras-per-batch``).
        max_lora_rank: refuse adapters of a higher rank (``--max-lora-rank``);
            None: any rank.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        weight_version: str = "0",
        max_running_requests: int = 32,
        max_prefill_tokens: int = 4096,
        num_threads: int | None = None,
        enable_lora: bool = False,
        max_loras_per_batch: int = 8,
        max_lora_rank: int | None = None,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be at least 1")
        self.model_path = str(model_dir)
        torch.set_num_threads(num_threads or default_num_threads())
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.eval().requires_grad_(False)
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"only full attention is supported, model has layer types {set(layer_types)}"
            )
        self.context_length: int = int(config.max_position_embeddings)
        self.vocab_size: int = int(config.vocab_size)
        self.eos_token_ids = self._eos_token_ids(model)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.model = model
        self.lora = LoRAHooks(model) if enable_lora else None
        self.max_lora_rank = max_lora_rank
        self._registry = AdapterRegistry(self.lora, max_lora_rank)
        self._worker = EngineWorker(
            model,
            self.tokenizer,
            weight_version=weight_version,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            lora=self.lora,
            max_loras_per_batch=max_loras_per_batch,
        )
        self.max_running_requests = max_running_requests
        self._active: set[str] = set()
        self._paused = False
        logger.info(
            "engine loaded %s (context %d, %d threads)",
            self.model_path,
            self.context_length,
            torch.get_num_threads(),
        )

    def _eos_token_ids(self, model: PreTrainedModel) -> frozenset[int]:
        """Eos ids of the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        generation_config: GenerationConfig | None = getattr(model, "generation_config", None)
        for source in (getattr(generation_config, "eos_token_id", None), model.config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._worker.start()

    async def stop(self) -> None:
        """Abort everything and stop the worker thread."""
        if not self._worker.is_alive:
            return
        shutdown = cmd.Shutdown()
        self._worker.send(shutdown)
        await asyncio.wrap_future(shutdown.done)
        await asyncio.to_thread(self._worker.join)

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread runs."""
        return self._worker.is_alive

    @property
    def weight_version(self) -> str:
        """Version of the weights currently loaded."""
        return self._worker.weight_version

    @property
    def paused(self) -> bool:
        """Whether generation is paused (between ``pause`` and ``resume``)."""
        return self._paused

    @property
    def stats(self) -> WorkerStats:
        """The worker's counters (prefills, decode steps, peak batch size)."""
        return self._worker.stats

    @property
    def num_running(self) -> int:
        """Requests in the running batch (approximate)."""
        return self._worker.num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (approximate)."""
        return self._worker.num_waiting

    # ---- requests -------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (as SGLang tokenizes a ``text`` prompt)."""
        return list(self.tokenizer.encode(text))

    def decode(
        self, token_ids: list[int] | tuple[int, ...], *, skip_special_tokens: bool = True
    ) -> str:
        """Text of ``token_ids``."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        top_logprobs_num: int = 0,
        stream: bool = False,
        adapter: LoRAAdapter | None = None,
    ) -> RequestHandle:
        """Queue a request; must be called on the event loop that will read the handle.

        With ``stream`` the handle's :meth:`~RequestHandle.updates` sees every
        step; without it, only the final state arrives. ``adapter`` (from
        :meth:`resolve_adapter`) runs the request with that LoRA adapter.

        Raises :class:`InvalidRequestError` for an empty or too-long prompt
        (``len(prompt_ids) >= context_length``), out-of-vocabulary ids or a rid
        already in flight. Generation ends with ``length`` when prompt plus
        output reach the context length.
        """
        if not self._worker.is_alive:
            raise EngineUnavailableError("the engine worker is not running")
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context length is "
                f"{self.context_length} and at least one token must be generated"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must lie in [0, {self.vocab_size})")
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        self._check_logit_bias(params.logit_bias)
        grammar = None
        spec = grammar_of(
            json_schema=params.json_schema,
            regex=params.regex,
            ebnf=params.ebnf,
            structural_tag=params.structural_tag,
        )
        if spec is not None:
            try:
                grammar = self.grammars.matcher(self.grammars.compile(spec), stop_ids)
            except InvalidGrammarError as exc:
                raise InvalidRequestError(str(exc)) from exc
        if adapter is not None:
            self._registry.acquire(adapter)

        def on_finish() -> None:
            self._active.discard(rid)
            if adapter is not None:
                self._registry.release(adapter)

        sink = DeltaSink(asyncio.get_running_loop(), on_finish=on_finish)
        request = WorkerRequest(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            top_logprobs_num=top_logprobs_num,
            sink=sink,
            generator=make_generator(params.sampling_seed),
            stop_token_ids=frozenset(stop_ids),
            grammar=grammar,
            max_new_tokens=min(params.max_new_tokens, self.context_length - len(prompt_ids)),
            stream=stream,
            adapter=adapter,
        )
        handle = RequestHandle(self, rid, len(prompt_ids), sink, top=top_logprobs_num > 0)
        self._active.add(rid)
        self._worker.send(cmd.Submit(request))
        return handle

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar in a thread (xgrammar caches it for :meth:`submit`).

        A large schema over a large vocabulary takes tens of milliseconds to
        compile; doing it here keeps the event loop free. Raises
        :class:`InvalidRequestError` for a grammar that does not compile.
        """
        spec = grammar_of(
            json_schema=params.json_schema,
            regex=params.regex,
            ebnf=params.ebnf,
            structural_tag=params.structural_tag,
        )
        if spec is not None:
            try:
                await asyncio.to_thread(self.grammars.compile, spec)
            except InvalidGrammarError as exc:
                raise InvalidRequestError(str(exc)) from exc

    def _check_logit_bias(self, bias: dict[str, float] | None) -> None:
        for key, value in (bias or {}).items():
            if not 0 <= int(key) < self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias must have keys in [0, {self.vocab_size - 1}], got {key}"
                )
            if not math.isfinite(value):
                raise InvalidRequestError(f"logit_bias values must be finite, got {value}")

    # ---- LoRA adapters --------------------------------------------------------------

    def loaded_lora_adapters(self) -> dict[str, str]:
        """Loaded adapter names and their paths, in load order."""
        return self._registry.loaded_lora_adapters()

    async def load_lora_adapter(self, name: str, path: str) -> LoRAUpdateResponse:
        """Serve peft's directory ``path`` as ``name`` (``AdapterRegistry.load_lora_adapter``)."""
        return await self._registry.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> LoRAUpdateResponse:
        """Stop serving ``name`` (``AdapterRegistry.unload_lora_adapter``)."""
        return await self._registry.unload_lora_adapter(name)

    async def resolve_adapter(self, name: str) -> LoRAAdapter:
        """The adapter a request's ``lora_path`` names (``AdapterRegistry.resolve_adapter``)."""
        return await self._registry.resolve_adapter(name)

    # ---- control --------------------------------------------------------------------

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one request (by rid) or all; returns how many were aborted."""
        command = cmd.Abort(rid=rid, abort_all=abort_all)
        self._worker.send(command)
        return await asyncio.wrap_future(command.done)

    def request_abort(self, rid: str) -> None:
        """Ask the worker to abort ``rid`` without waiting (safe in cleanup code)."""
        self._worker.send(cmd.Abort(rid=rid, abort_all=False))

    async def pause(self, mode: str = "abort") -> int:
        """Hold new and queued requests; ``abort`` mode also aborts the running ones."""
        if mode not in ("abort", "in_place"):
            raise InvalidRequestError(f"unknown pause mode {mode!r}; use 'abort' or 'in_place'")
        command = cmd.Pause(mode="abort" if mode == "abort" else "in_place")
        self._paused = True
        self._worker.send(command)
        return await asyncio.wrap_future(command.done)

    async def resume(self) -> None:
        """Continue after :meth:`pause`."""
        command = cmd.Resume()
        self._paused = False
        self._worker.send(command)
        await asyncio.wrap_future(command.done)

    async def apply_weights(
        self, state_dict: dict[str, torch.Tensor], weight_version: str | None
    ) -> None:
        """Swap checked tensors into the model between two steps (the model keeps them, no
        copy: the caller hands them over) and, unless None, set the version it reports (a
        broadcast push's swap, ``proxima.proxy.embedded.weight_groups``)."""
        command = cmd.UpdateWeights(state_dict, weight_version, abort_all=False, swap=True)
        self._worker.send(command)
        await asyncio.wrap_future(command.done)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> UpdateWeightsResponse:
        """Load safetensors from ``model_path`` between two steps; old weights stay on failure."""
        try:
            state_dict = await asyncio.to_thread(
                load_checked_state_dict, self.model, model_path, load_format
            )
        except WeightLoadError as exc:
            logger.warning("rejected weights from %s: %s", model_path, exc)
            return UpdateWeightsResponse(success=False, message=f"failed to load weights: {exc}")
        command = cmd.UpdateWeights(state_dict, weight_version, abort_all_requests)
        self._worker.send(command)
        try:
            await asyncio.wrap_future(command.done)
        except (RuntimeError, ValueError) as exc:
            return UpdateWeightsResponse(success=False, message=f"failed to apply weights: {exc}")
        return UpdateWeightsResponse(
            success=True, message=f"weights loaded from {model_path}; version {self.weight_version}"
        )
