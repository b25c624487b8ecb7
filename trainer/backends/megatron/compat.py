"""Run megatron-core on CPU: distributed setup, a CPU RNG tracker, one device shim.

megatron-core targets CUDA. Its model code runs on CPU once three things are
in place, and this module provides exactly those, each only when CUDA is
unavailable (on a GPU machine megatron's own paths are used untouched):

1. ``torch.distributed`` with the ``gloo`` backend. megatron's
   ``parallel_state.initialize_model_parallel`` builds its groups with the
   default backend, so gloo on CPU and NCCL on GPU need no other change.
2. An RNG tracker. ``tensor_parallel.model_parallel_cuda_manual_seed`` seeds
   CUDA generators, and the attention layer enters
   ``get_cuda_rng_tracker().fork()`` on every forward (even with dropout 0).
   :class:`CpuRNGStatesTracker` keeps the same named states (data-parallel,
   model-parallel, expert-parallel) on the CPU generator.
3. ``torch.cuda.current_device``. With ``use_cpu_initialization=True``
   parameters are created on CPU, but a few forward paths still call it to
   pick a device (the rotary embedding moves ``inv_freq`` there on every
   call, megatron 0.16.1 ``rotary_pos_embedding.py``). On a CUDA-less torch
   that call raises, so :func:`cpu_device_shim` makes it return the CPU device
   while megatron code runs, and restores the original afterwards.

One more CUDA assumption is avoided rather than patched: the local attention
builds its default causal mask with ``device="cuda"``, so callers pass an
explicit mask (see ``proxima.trainer.backends.megatron.backend.causal_attention_mask``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random
from proxima.proxy.serving import free_port

logger = logging.getLogger(__name__)

# megatron's offsets, so the same seed gives the same streams on CPU and GPU
# (``model_parallel_cuda_manual_seed`` in megatron/core/tensor_parallel/random.py).
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024
# The tracker's default stream; megatron exposes no getter for this name.
_MODEL_PARALLEL_RNG_NAME: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME


def cuda_available() -> bool:
    """True when megatron can use its CUDA paths (and no shim is installed)."""
    return torch.cuda.is_available()


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


def init_distributed(*, timeout_s: float = 600.0) -> DistributedEnv:
    """Initialise the default process group once: NCCL with CUDA, gloo without.

    Rank and world size come from torchrun's ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``; without them this is a single process (rank 0 of 1) with
    a rendezvous on 127.0.0.1 and a free port. Calling it again returns the
    existing group's coordinates.
    """
    backend = "nccl" if cuda_available() else "gloo"
    if dist.is_initialized():
        return DistributedEnv(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            backend=str(dist.get_backend()),
        )
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    logger.info(
        "distributed initialised",
        extra={"rank": rank, "world_size": world_size, "backend": backend},
    )
    return DistributedEnv(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend)


# Rank 0 may wait for data far longer than a collective's timeout (the trainer
# polls the store for a full batch), so control messages use their own group.
_CONTROL_TIMEOUT = timedelta(days=30)
_control_group: Any = None


def control_group() -> Any:
    """A gloo group over the whole world for control messages, with a long timeout.

    Collective: every rank must call it the first time (in the same order as
    other group creations). Gloo on GPU too, so pickled objects travel on CPU.
    """
    global _control_group
    if _control_group is None:
        _control_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return _control_group


def broadcast_object(obj: Any = None, *, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (over :func:`control_group`)."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def gather_objects(obj: Any, *, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on ``dst`` (None elsewhere), over the control group."""
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=control_group())
    return out


def init_model_parallel(*, tensor_parallel: int, pipeline_parallel: int, seed: int) -> None:
    """Build megatron's parallel groups (once) and seed its RNG tracker.

    Data parallel size is what is left of the world: ``world / (tp * pp)``.
    Re-initialising with different sizes in one process is rejected, since
    megatron's groups are process-global.
    """
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if current != (tensor_parallel, pipeline_parallel):
            raise RuntimeError(
                f"megatron model parallel is already initialised with (tp, pp) = {current}; "
                f"cannot switch to ({tensor_parallel}, {pipeline_parallel}) in the same process "
                "(call parallel_state.destroy_model_parallel() first)"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
        )
    model_parallel_manual_seed(seed)


def model_parallel_manual_seed(seed: int) -> None:
    """megatron's ``model_parallel_cuda_manual_seed`` on GPU, its CPU twin otherwise."""
    if cuda_available():
        mcore_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tracker.add(mcore_random.get_data_parallel_rng_tracker_name(), seed)
    tracker.add(_MODEL_PARALLEL_RNG_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(
        mcore_random.get_expert_parallel_rng_tracker_name(),
        seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank,
    )
    # megatron reads the tracker from these module globals
    # (``get_cuda_rng_tracker``); installing ours there is the whole patch.
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# megatron-core ships no type information: its classes are Any to mypy.
class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):  # type: ignore[misc]
    """megatron's named RNG streams, kept as CPU generator states.

    Same contract as ``CudaRNGStatesTracker``: ``add`` records a seeded state
    under a name, ``fork`` runs a block on that stream and saves where it
    left off, restoring the default stream afterwards.
    """

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name: str, seed: int) -> None:
        """Record the CPU generator state for ``seed`` under ``name``."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_NAME) -> Iterator[None]:
        """Run the block on stream ``name``; the default stream resumes afterwards."""
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def cpu_device_shim() -> Iterator[None]:
    """While megatron code runs on a CUDA-less torch, ``current_device()`` is the CPU.

    Re-entrant, and a no-op when CUDA is available. Only
    ``torch.cuda.current_device`` is replaced; anything else megatron needs
    from CUDA still fails loudly rather than silently running elsewhere.
    """
    installed: object = torch.cuda.current_device  # ours while a shim is active
    if cuda_available() or installed is _cpu_current_device:
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original
