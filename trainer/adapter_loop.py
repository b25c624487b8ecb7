"""Several LoRA adapters trained by one process: one ``Trainer`` per adapter, round-robin.

:class:`AdapterTrainers` builds one ``LoraBackend`` (the base model once, every
adapter of ``[trainer.lora] adapters`` on it) and one
:class:`~proxima.trainer.loop.Trainer` per adapter over that adapter's policy
view. Each runs the training step of ``proxima.trainer.loop`` on its own
policy: its sessions (``claim_groups(adapter=...)``), its version sequence and
staleness bound, its AdamW, its pushes (``POST /admin/weights`` with
``adapter``), its pending step and checkpoints (``<output_dir>/adapters/<name>``).

The schedule (:meth:`AdapterTrainers.run`), one round::

    for each adapter: one claim poll toward its batch      # Trainer.top_up
    ready = adapters holding a full batch
    the first ready adapter after the one that stepped last takes its step
    none ready: wait loop.poll_interval_s

so adapters with batches ready take turns (round-robin, :func:`next_turn`)
and one with a steady flow of sessions cannot starve another. Steps run one at
a time on the one compute thread; while one trains, the others' sessions wait
in the store (claims are only topped up between steps).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from proxima.proxy.store import Store
from proxima.trainer.backends.lora import LoraBackend
from proxima.trainer.config import TrainerConfig
from proxima.trainer.log import StepRecord, TrainLog, policy_home
from proxima.trainer.loop import Trainer, stopped_within
from proxima.trainer.recovery import Recovery, recover
from proxima.trainer.torchrun import apply_plan
from proxima.trainer.weights import TrainerState, WeightSink, remove_partial_writes

logger = logging.getLogger(__name__)


def next_turn(ready: Sequence[bool], last: int | None) -> int | None:
    """The adapter (index) that steps next: the first ready one after ``last``, cyclically.

    ``last`` is the index of the adapter that stepped last (None: none yet, the
    first ready one goes). None when no adapter is ready.
    """
    n = len(ready)
    start = 0 if last is None else (last + 1) % n
    for k in range(n):
        i = (start + k) % n
        if ready[i]:
            return i
    return None


def adapter_trainer_id(trainer_id: str, adapter: str) -> str:
    """The id an adapter's claims are held under (each adapter recovers its own claims)."""
    return f"{trainer_id}/{adapter}"


class AdapterTrainers:
    """One :class:`Trainer` per LoRA adapter on one shared ``LoraBackend``; round-robin steps.

    Build it with :meth:`start`, drive it with :meth:`run` (or :meth:`step`),
    and always :meth:`close` it (``run`` does).
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        trainers: Sequence[Trainer],
        backend: LoraBackend,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.cfg = cfg
        self.trainers = list(trainers)
        self.backend = backend
        self._executor = executor
        self._last: int | None = None
        self.steps = {t.adapter: 0 for t in self.trainers}  # steps of this run, per adapter

    @classmethod
    async def start(
        cls,
        cfg: TrainerConfig,
        *,
        store: Store,
        sink: WeightSink,
        console: bool = True,
    ) -> AdapterTrainers:
        """Recover every adapter (``proxima.trainer.weights`` rule, per policy), load the base
        and the adapters once, and resume each at its pushed version."""
        model_dir = cfg.connection.model_dir
        if model_dir is None:
            raise ValueError("connection.model_dir is not set: pass --model DIR")
        if not cfg.adapters:
            raise ValueError("AdapterTrainers needs lora.adapters")
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(cfg.output_dir)
        recoveries: dict[str, Recovery] = {}
        for adapter in cfg.adapters:
            trainer_id = adapter_trainer_id(cfg.loop.trainer_id, adapter)
            recoveries[adapter] = await recover(store, cfg.output_dir, trainer_id, adapter)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        loop = asyncio.get_running_loop()
        try:
            backend = await loop.run_in_executor(
                executor, functools.partial(_load, cfg, recoveries)
            )
        except BaseException:
            executor.shutdown(wait=True)
            raise
        trainers = []
        for adapter, recovery in recoveries.items():
            plan = recovery.plan
            trainer_id = adapter_trainer_id(cfg.loop.trainer_id, adapter)
            state = TrainerState(trainer_id=trainer_id, version=plan.version, step=plan.step)
            log = TrainLog(
                policy_home(cfg.output_dir, adapter),
                console=console,
                total_steps=cfg.loop.max_steps,
                desc=f"train {adapter}",
                tracking=cfg.tracking,
                adapter=adapter,
            )
            log.event(
                "start",
                trainer_id=trainer_id,
                adapter=adapter,
                version=plan.version,
                step=plan.step,
                source=plan.source,
                checkpoint=str(plan.checkpoint.path) if plan.checkpoint else None,
                weights=str(plan.weights_path) if plan.weights_path else None,
                released_claims=recovery.released,
                settled_pending=recovery.settled,
            )
            trainers.append(
                Trainer(
                    cfg,
                    store=store,
                    sink=sink,
                    backend=backend.policy(adapter),
                    state=state,
                    log=log,
                    executor=executor,
                    adapter=adapter,
                    owns_executor=False,
                )
            )
            logger.info(
                "adapter trainer resumed",
                extra={"adapter": adapter, "version": plan.version, "source": plan.source},
            )
        return cls(cfg, trainers, backend, executor)

    async def run(self, stop: asyncio.Event) -> int:
        """Round-robin steps until ``stop`` is set or every adapter ran ``loop.max_steps``
        steps; then :meth:`close`. Returns the steps taken (all adapters)."""
        try:
            while not stop.is_set() and self._eligible():
                if await self.step(stop) is None:
                    break
        finally:
            await self.close()
        return sum(self.steps.values())

    async def step(self, stop: asyncio.Event | None = None) -> StepRecord | None:
        """One round of the schedule (module docstring): a step of the adapter whose turn it
        is, after waiting for one to have a full batch; None when ``stop`` came first."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            eligible = self._eligible()
            for trainer in eligible:
                await trainer.top_up()
            ready = [t in eligible and t.batch_ready for t in self.trainers]
            turn = next_turn(ready, self._last)
            if turn is not None:
                trainer = self.trainers[turn]
                record = await trainer.step(stop)
                if record is None:
                    return None
                self._last = turn
                self.steps[trainer.adapter] += 1
                return record
            if await stopped_within(stop, self.cfg.loop.poll_interval_s):
                break
        return None

    async def checkpoint(self) -> None:
        """Checkpoint every adapter (its LoRA weights and optimizer) now."""
        for trainer in self.trainers:
            await trainer.checkpoint()

    async def close(self) -> None:
        """Close every adapter's trainer (settle, release its claims, checkpoint), then the
        compute thread."""
        try:
            for trainer in self.trainers:
                await trainer.close()
        finally:
            self._executor.shutdown(wait=True)

    def _eligible(self) -> list[Trainer]:
        max_steps = self.cfg.loop.max_steps
        return [t for t in self.trainers if max_steps is None or self.steps[t.adapter] < max_steps]


def _load(cfg: TrainerConfig, recoveries: dict[str, Recovery]) -> LoraBackend:
    """The base and every adapter, each adapter brought to its resume plan."""
    assert cfg.connection.model_dir is not None
    backend = LoraBackend(
        cfg.connection.model_dir,
        lora=cfg.lora,
        ppo=cfg.ppo,
        batching=cfg.batching,
        optim=cfg.optim,
        device=cfg.device,
        seed=cfg.seed,
    )
    for adapter, recovery in recoveries.items():
        apply_plan(backend.policy(adapter), recovery.plan)
    return backend
