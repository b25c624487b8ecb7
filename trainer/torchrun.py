"""Torchrun leader/follower protocol: rank 0 runs the trainer loop, the other ranks replay it.

Under ``torchrun`` (``backend = "megatron"``; world = ``tensor_parallel`` x
data-parallel replicas): rank 0 alone opens the store, talks to the proxy,
writes weights, checkpoints and the log. It broadcasts the resume plan, then
every backend call (the step's samples for the proximal logprobs and the
train step, the export, the checkpoint gather) over a gloo control group; the
other ranks load the same plan and replay those calls, so the model runs on
every rank together: each data-parallel replica takes its share of the
step's micro-batches, and every rank gets the whole result (logprobs, step
statistics). When rank 0 stops (``max_steps``, a signal, an error) it
broadcasts a stop sentinel and the other ranks exit; they ignore signals
themselves.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from proxima.trainer.backends import build_backend
from proxima.trainer.backends.base import PPOBackend, StepStats
from proxima.trainer.config import TrainerConfig
from proxima.trainer.samples import Sample
from proxima.trainer.weights import ResumePlan


def torchrun_world_size() -> int:
    """The number of processes torchrun started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(cfg: TrainerConfig) -> int:
    """Join the torchrun job (process group and control group); this process's rank."""
    if cfg.backend != "megatron":
        raise ValueError(
            f'backend = "{cfg.backend}" runs in one process, but torchrun started '
            f"{torchrun_world_size()}: launch `proxima trainer` without torchrun, or set "
            'backend = "megatron" for a multi-process run (the processes are [megatron] '
            "tensor_parallel x data-parallel replicas)"
        )
    from proxima.trainer.backends.megatron.compat import control_group, init_distributed

    env = init_distributed()
    control_group()
    return env.rank


class RankZeroLeader:
    """Rank 0's side of the torchrun protocol.

    Messages, in order: the :class:`ResumePlan` (or None: rank 0 failed to
    start), then ``(method, *args)`` per backend call, then ``("stop",)``.
    """

    def __init__(self) -> None:
        self._plan_sent = False
        self._stopped = False

    def send_plan(self, plan: ResumePlan) -> None:
        from proxima.trainer.backends.megatron.compat import broadcast_object

        broadcast_object(plan)
        self._plan_sent = True

    def send(self, method: str, *args: Any) -> None:
        from proxima.trainer.backends.megatron.compat import broadcast_object

        if self._stopped:
            raise RuntimeError("the other ranks were already told to stop")
        broadcast_object((method, *args))

    def stop(self) -> None:
        """Tell the other ranks to exit (once)."""
        if self._stopped:
            return
        from proxima.trainer.backends.megatron.compat import broadcast_object

        self._stopped = True
        broadcast_object(("stop",) if self._plan_sent else None)


class BroadcastingBackend:
    """Rank 0's backend: each call is broadcast to the other ranks, then run here."""

    def __init__(self, backend: PPOBackend, leader: RankZeroLeader) -> None:
        self.backend = backend
        self.leader = leader

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        self.leader.send("compute_logprobs", list(samples))
        return self.backend.compute_logprobs(samples)

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        self.leader.send("train_step", list(samples))
        return self.backend.train_step(samples)

    def export_hf(self, out_dir: Path) -> None:
        self.leader.send("export_hf", out_dir)
        self.backend.export_hf(out_dir)

    def load_hf_weights(self, model_dir: Path) -> None:
        self.leader.send("load_hf_weights", model_dir)
        self.backend.load_hf_weights(model_dir)

    def state_dict(self) -> dict[str, Any]:
        self.leader.send("state_dict")
        return self.backend.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.leader.send("load_state_dict", state)
        self.backend.load_state_dict(state)


_FOLLOWED_METHODS = frozenset(
    {
        "compute_logprobs",
        "train_step",
        "export_hf",
        "load_hf_weights",
        "state_dict",
        "load_state_dict",
    }
)


async def follow_rank_zero(cfg: TrainerConfig) -> int:
    """A rank other than 0: replay rank 0's backend calls until it says stop.

    Never opens the store or the proxy. Returns the number of train steps run.
    """
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
    try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, _follow, cfg)
    finally:
        executor.shutdown(wait=True)


def _follow(cfg: TrainerConfig) -> int:
    from proxima.trainer.backends.megatron.compat import broadcast_object

    plan = broadcast_object()
    if plan is None:
        return 0  # rank 0 failed before loading the model
    assert cfg.connection.model_dir is not None
    backend = load_backend(cfg, cfg.connection.model_dir, plan)
    steps = 0
    while True:
        method, *args = broadcast_object()
        if method == "stop":
            return steps
        if method not in _FOLLOWED_METHODS:
            raise RuntimeError(f"rank 0 sent an unknown command {method!r}")
        getattr(backend, method)(*args)
        steps += method == "train_step"


def load_backend(cfg: TrainerConfig, model_dir: Path, plan: ResumePlan) -> PPOBackend:
    """Build the backend from the initial model and bring it to ``plan``'s state."""
    backend = build_backend(cfg, model_dir)
    apply_plan(backend, plan)
    return backend


def apply_plan(backend: PPOBackend, plan: ResumePlan) -> None:
    """Bring a freshly built backend (or one adapter's policy) to ``plan``'s state."""
    if plan.checkpoint is not None:
        backend.load_state_dict(plan.checkpoint.load_tensors())
    if plan.weights_path is not None:
        backend.load_hf_weights(plan.weights_path)
