"""The training loop: claim a batch, build samples, proximal logprobs, PPO updates, push weights.

One step (:meth:`Trainer.step`), top to bottom:

1. Wait until ``batch_size`` rewarded, finished sessions are claimed in
   whole groups, oldest finished first. ``Store.claim_groups`` is atomic, so
   each session goes to exactly one trainer and a group is never split
   across batches; claims accumulate over polls until the batch is full.
2. Load their completions and build samples (returns, group-relative
   advantages; ``proxima.trainer.samples``). A session whose records cannot
   be trained (``samples.session_problem``) is dropped with its reason logged,
   so a bad session can never fail a step again after every restart. Constrained
   completions get the grammar masks they were sampled under (``proxima.trainer.constrained``).
3. Bound staleness: tokens older than ``current_version - max_staleness``
   leave the loss (``stale_rule = "token"``, the default; ``"sample"`` drops
   their whole sample), samples left without trained tokens
   are dropped (counted),
   samples longer than ``batching.max_tokens_per_mb`` (counted, with a
   warning), and samples without signal (``advantage.zero_signal``: all
   advantages zero). Sessions with no sample left are marked DROPPED; a batch
   with nothing left takes no optimizer step and pushes no version. With
   ``zero_signal = "refill"`` (the default) step 1 already screens each
   claimed group this way and drops those that cannot train whole, claiming
   others in their place (``proxima.trainer.batch_claims``), so the batch is
   full of signal.
4. Proximal logprobs: the current weights (the policy before this step) at
   each sample's sampling temperature; ``prox = behav`` when
   ``ppo.decoupled`` is false. With one minibatch per step they come from
   the training forward pass itself (the weights have not moved yet), so no
   separate pass runs; with several, one no-grad pass runs before the first.
5. PPO minibatch updates (``backend.train_step``).
6. Export the weights as version ``v + 1`` and push them to the proxy. With a sink
   that pushes from memory (``[trainer.weights] transport = "broadcast"``) and a backend
   with in-memory HF tensors (torch), the push goes first and the export after it, on
   the compute thread ahead of the next step's model work (step 7 waits for it while
   the next batch is claimed).
7. Mark the sessions TRAINED into ``v + 1``; checkpoint every
   ``checkpoint_every`` steps; log the step.

Start-up applies the recovery rule of ``proxima.trainer.weights``
(``proxima.trainer.recovery``: settle a pending push, release this
trainer's stale claims, resume at the last pushed version). Stopping (``stop_event``, set by SIGINT/SIGTERM in the CLI): a step
that is still waiting for data or recomputing proximal logprobs is abandoned;
one that has started training is finished through its push, so the weights
in memory always equal a pushed version. Then claims are released and a
checkpoint is written.

Model work runs on one dedicated thread so the event loop stays responsive
(the stop signal, store polling); every backend call happens on that thread.

Under ``torchrun`` (``backend = "megatron"``) this loop runs on rank 0 alone;
every backend call is replayed on the other ranks (``proxima.trainer.torchrun``).

LoRA adapters (``[trainer.lora] adapters``): :class:`AdapterTrainers` runs one
:class:`Trainer` per adapter over one ``LoraBackend`` (one frozen base in
memory, one compute thread). Each is the loop above for its own policy: it
claims only its adapter's sessions (under the trainer id
``<trainer_id>/<adapter>``, so recovering one never releases another's
claims), bounds staleness by its adapter's version, trains with its adapter
applied and its own AdamW, and pushes the adapter alone as that adapter's
next version (``proxima.trainer.weights`` layout, per policy). Between them
the schedule is round-robin over the adapters with a full batch claimed
(:func:`next_turn`): every adapter tops up its claims, then the next ready one
after the last that stepped takes its step, so a busy tenant cannot starve a
slower one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from proxima.proxy.store import SessionRecord, SessionStatus, Store
from proxima.trainer.backends.base import PPOBackend, StepStats
from proxima.trainer.batch_claims import Batch, BatchClaims, trainable_samples
from proxima.trainer.config import TrainerConfig
from proxima.trainer.constrained import GrammarReplay
from proxima.trainer.log import (
    BatchMetrics,
    StepRecord,
    StepTimes,
    TrainLog,
    policy_home,
)
from proxima.trainer.production import production_use
from proxima.trainer.publish import Publishing
from proxima.trainer.recovery import recover
from proxima.trainer.samples import Sample, vocab_size_of
from proxima.trainer.torchrun import (
    BroadcastingBackend,
    RankZeroLeader,
    load_backend,
)
from proxima.trainer.weights import (
    PushResult,
    TrainerState,
    WeightSink,
    read_pending,
    remove_partial_writes,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Trainer(Publishing):
    """A running trainer: its backend, its place in the version sequence, its store and proxy.

    Build it with :meth:`start`, drive it with :meth:`run` (or :meth:`step`),
    and always :meth:`close` it (``run`` does).
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        store: Store,
        sink: WeightSink,
        backend: PPOBackend,
        state: TrainerState,
        log: TrainLog,
        executor: ThreadPoolExecutor,
        adapter: str | None = None,
        owns_executor: bool = True,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.sink = sink
        self.backend = backend
        self.state = state
        self.log = log
        self.adapter = adapter  # the policy trained: None (full weights) or a LoRA adapter
        self.home = policy_home(cfg.output_dir, adapter)  # its pending step, checkpoints, log
        self._executor = executor
        self._owns_executor = owns_executor
        self._checkpointed_step = state.step
        self._weights_ahead = False  # trained weights not (yet) pushed: never checkpoint those
        self._vocab_size = vocab_size_of(cfg.connection.model_dir)
        self._replay: GrammarReplay | None = None  # constrained completions' masks
        self._init_publishing()  # steps 6-7: by disk, or from memory (exported after)
        # Claims held toward the next batch, and what ``refill`` dropped while it filled.
        self.claims = BatchClaims(
            cfg, store, trainer_id=state.trainer_id, adapter=adapter, vocab_size=self._vocab_size
        )

    # ------------------------------------------------------------------ start-up

    @classmethod
    async def start(
        cls,
        cfg: TrainerConfig,
        *,
        store: Store,
        sink: WeightSink,
        console: bool = True,
        leader: RankZeroLeader | None = None,
    ) -> Trainer:
        """Recover (``proxima.trainer.weights`` rule), load the backend, and resume at the pushed version.

        With ``leader`` (rank 0 under torchrun) the resume plan is broadcast
        to the other ranks first, and every backend call is broadcast too.
        """
        model_dir = cfg.connection.model_dir
        if model_dir is None:
            raise ValueError("connection.model_dir is not set: pass --model DIR")
        output_dir = cfg.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(output_dir)
        trainer_id = cfg.loop.trainer_id

        recovery = await recover(store, output_dir, trainer_id)
        plan, released, settled = recovery.plan, recovery.released, recovery.settled

        if leader is not None:
            await asyncio.to_thread(leader.send_plan, plan)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        loop = asyncio.get_running_loop()
        try:
            backend = await loop.run_in_executor(
                executor, functools.partial(load_backend, cfg, model_dir, plan)
            )
        except BaseException:
            executor.shutdown(wait=True)
            raise
        if leader is not None:
            backend = BroadcastingBackend(backend, leader)
        state = TrainerState(trainer_id=trainer_id, version=plan.version, step=plan.step)
        log = TrainLog(
            output_dir, console=console, total_steps=cfg.loop.max_steps, tracking=cfg.tracking
        )
        log.event(
            "start",
            trainer_id=trainer_id,
            version=plan.version,
            step=plan.step,
            source=plan.source,
            checkpoint=str(plan.checkpoint.path) if plan.checkpoint else None,
            checkpoint_version=plan.checkpoint.state.version if plan.checkpoint else None,
            weights=str(plan.weights_path) if plan.weights_path else None,
            released_claims=released,
            settled_pending=settled,
        )
        logger.info(
            "trainer resumed",
            extra={"version": plan.version, "step": plan.step, "source": plan.source},
        )
        return cls(
            cfg,
            store=store,
            sink=sink,
            backend=backend,
            state=state,
            log=log,
            executor=executor,
        )

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> int:
        """Train until ``stop`` is set or ``loop.max_steps`` steps ran; then :meth:`close`."""
        steps = 0
        max_steps = self.cfg.loop.max_steps
        try:
            while not stop.is_set() and (max_steps is None or steps < max_steps):
                if await self.step(stop) is None:
                    break
                steps += 1
        finally:
            await self.close()
        return steps

    async def step(self, stop: asyncio.Event | None = None) -> StepRecord | None:
        """One training step (module docstring); None when ``stop`` abandoned it."""
        stop = stop or asyncio.Event()
        started = time.monotonic()
        version = self.state.version

        # 1. Wait for a full batch of rewarded, finished sessions and claim it.
        sessions = await self._claim_batch(stop)
        if sessions is None:
            return None
        wait_s = time.monotonic() - started

        # 2-3. Trajectories -> samples with returns and group-relative advantages, less what
        #    cannot be trained (``trainable_samples``); the sessions left without one are
        #    dropped.
        samples, metrics, trained_ids, dropped_ids = await self._samples_of(sessions, version)
        if not samples:
            times = StepTimes(wait=wait_s, total=time.monotonic() - started)
            return self._log_step(metrics, dropped_ids, None, None, times)
        if stop.is_set():
            return None  # abandoned before training: the claims are released on close

        # 4. Proximal logprobs: the policy before this step, at each sample's temperature.
        t = time.monotonic()
        samples = await self._with_prox_logprobs(samples)
        prox_s = time.monotonic() - t
        if stop.is_set():
            return None

        # 5. PPO minibatch updates.
        t = time.monotonic()
        self._weights_ahead = True
        stats = await self._compute(self.backend.train_step, samples)
        train_s = time.monotonic() - t

        # 6. The new weights become version v + 1 on every inference backend.
        new_version = version + 1
        push, export_s, push_s = await self._export_and_push(new_version, trained_ids)

        # 7. The sessions are consumed by v + 1; checkpoint; log.
        await self._consume(trained_ids, new_version)
        times = StepTimes(
            wait=wait_s,
            prox=prox_s,
            train=train_s,
            export=export_s,
            push=push_s,
            proxy_update=push.proxy_seconds,
            total=time.monotonic() - started,
        )
        return self._log_step(metrics, dropped_ids, stats, push, times)

    async def close(self) -> None:
        """Settle an interrupted push, release claims, checkpoint if due, stop the compute thread.

        A step whose push raised may still have landed (the answer was lost):
        the store's policy version says which, and the pending step is
        settled as at start-up before any claim is released. A version pushed from
        memory is exported (and its sessions marked) first; if that export fails, its
        pending step stays for the recovery rule (its sessions are trained again), no
        checkpoint is written, and the error is raised after the claims are released.
        """
        export_error: Exception | None = None
        try:
            try:
                await self._exported()
            except Exception as exc:
                export_error = exc
                logger.error("the export of version %s failed: %r", self.state.version, exc)
            pending = read_pending(self.home)
            if self._weights_ahead and pending is not None and pending.version > self.state.version:
                await self._settle_interrupted_push()
            released = await self.store.release_claims(trainer_id=self.state.trainer_id)
            due = self.cfg.checkpoint_every and self.state.step > self._checkpointed_step
            if due and export_error is None:
                await self.checkpoint()
            self.log.event(
                "stop", version=self.state.version, step=self.state.step, released_claims=released
            )
        finally:
            self.log.close()
            if self._owns_executor:
                self._executor.shutdown(wait=True)
        if export_error is not None:
            raise export_error

    # ------------------------------------------------------------------ helpers

    async def _claim_batch(self, stop: asyncio.Event) -> list[SessionRecord] | None:
        """Claim whole groups until ``batch_size`` sessions are held; None if ``stop`` is set first.

        ``batch_size`` counts sessions in whole groups: the last group claimed
        may carry the batch past it, and no group is ever split across batches.
        The claims returned are the step's own (none are held after).
        """
        while True:
            await self.top_up()
            if self.batch_ready:
                return self.claims.take()
            if await stopped_within(stop, self.cfg.loop.poll_interval_s):
                return None

    @property
    def batch_ready(self) -> bool:
        """Whether the claims held make a full batch (``batch_size`` sessions)."""
        return self.claims.ready

    async def top_up(self) -> None:
        """One claim poll toward a full batch (claims are kept until a step takes them)."""
        await self.claims.top_up(self.state.version)

    async def _samples_of(
        self, sessions: list[SessionRecord], version: int
    ) -> tuple[list[Sample], BatchMetrics, list[str], list[str]]:
        """Steps 2-3: the samples of ``sessions`` that train at ``version``, the batch's metrics,
        the ids of the sessions trained and of those dropped (marked DROPPED here).

        A session whose records cannot be trained is dropped with its reason (never a
        failed step, which would release the claim and fail again on the next claim).
        Groups that ``refill`` screened out while the batch filled count in this step's
        metrics (their rewards are part of the curve).
        """
        batch: Batch = [(s, await self.store.list_completions(session_id=s.id)) for s in sessions]
        self.log.note_batch(batch)  # the trackers' rollout table of this step
        samples, removed, _ = trainable_samples(batch, version, self.cfg, self._vocab_size)
        if any(s.constraints for s in samples):  # the masks the engine sampled under
            samples = await self._compute(self._grammar_replay().attach, samples)
        trained_ids = list(dict.fromkeys(s.session_id for s in samples))
        trained = set(trained_ids)
        dropped_ids = [s.id for s in sessions if s.id not in trained]
        await self.store.mark_sessions(session_ids=dropped_ids, status=SessionStatus.DROPPED)
        screened = self.claims.take_screened()
        dropped_ids += [s.id for s, _ in screened.sessions]
        metrics = BatchMetrics.of(
            screened.sessions + batch, samples, version, removed + screened.samples
        )
        kinds = {s.id: s.kind for s in sessions}
        metrics = dataclasses.replace(metrics, production=production_use(samples, kinds, version))
        return samples, metrics, trained_ids, dropped_ids

    def _grammar_replay(self) -> GrammarReplay:
        """The replay of constrained completions' masks, built on first use."""
        if self._replay is None:
            assert self.cfg.connection.model_dir is not None
            self._replay = GrammarReplay(self.cfg.connection.model_dir)
        return self._replay

    async def _with_prox_logprobs(self, samples: list[Sample]) -> list[Sample]:
        """Samples carrying proximal logprobs (recomputed, or the behaviour ones).

        With one minibatch per step the optimizer step is the first after
        the proximal policy, so the training forward pass computes them itself
        (``prox_logprobs`` stays None; ``proxima.trainer.loss``): no separate pass.
        """
        if not self.cfg.ppo.decoupled:
            return [dataclasses.replace(s, prox_logprobs=list(s.behav_logprobs)) for s in samples]
        if self.cfg.ppo.ppo_minibatches == 1:
            return samples
        prox = await self._compute(self.backend.compute_logprobs, samples)
        return [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(samples, prox, strict=True)]

    def _log_step(
        self,
        metrics: BatchMetrics,
        dropped_ids: Sequence[str],
        stats: StepStats | None,
        push: PushResult | None,
        times: StepTimes,
    ) -> StepRecord:
        record = StepRecord(
            step=self.state.step,
            version=self.state.version,
            pushed=push is not None,
            sessions=metrics.sessions,
            trained_sessions=metrics.sessions - len(dropped_ids),
            dropped_sessions=len(dropped_ids),
            samples=metrics.samples,
            dropped_samples=metrics.dropped_samples,
            tokens=metrics.tokens,
            loss_tokens=metrics.loss_tokens,
            reward_mean=metrics.reward_mean,
            advantage_mean=metrics.advantage_mean,
            advantage_std=metrics.advantage_std,
            staleness=metrics.staleness,
            production_samples=metrics.production.samples,
            production_staleness_mean=metrics.production.staleness_mean,
            ppo=stats.as_dict() if stats is not None else {},
            times=times,
        )
        self.log.step(record)
        return record


# --------------------------------------------------------------------------- internals


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``stop``; True if it is set."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True
