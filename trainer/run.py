"""The trainer process: open the store and the weight sink, take a torchrun role, run the loop.

:func:`run_trainer` is what ``proxima trainer`` and ``proxima train`` call.
Under torchrun rank 0 runs :class:`~proxima.trainer.loop.Trainer` and the
other ranks replay its backend calls (``proxima.trainer.torchrun``). With
``[trainer.lora] adapters`` the process trains them all
(:class:`~proxima.trainer.adapter_loop.AdapterTrainers`).
"""

from __future__ import annotations

import asyncio

from proxima.trainer.adapter_loop import AdapterTrainers
from proxima.trainer.config import TrainerConfig
from proxima.trainer.loop import Trainer
from proxima.trainer.proxy_settings import adopt_proxy_settings, fetch_proxy_settings
from proxima.trainer.sft import WarmStartPlan, warm_start
from proxima.trainer.store_retry import RetryingStore
from proxima.trainer.torchrun import (
    RankZeroLeader,
    follow_rank_zero,
    init_ranks,
    torchrun_world_size,
)
from proxima.trainer.weight_broadcast import BroadcastWeightSink
from proxima.trainer.weights import ProxyWeightSink, WeightSink


def weight_sink(cfg: TrainerConfig, proxy_url: str, admin_token: str | None) -> WeightSink:
    """The sink ``[trainer.weights] transport`` names: the proxy loads the export from disk,
    or the trainer broadcasts the weights over a process group (adapters go by disk)."""
    if cfg.weights.transport == "broadcast":
        return BroadcastWeightSink(
            proxy_url,
            admin_token=admin_token,
            settings=cfg.weights,
            timeout_s=cfg.loop.push_timeout_s,
        )
    return ProxyWeightSink(
        proxy_url,
        admin_token=admin_token,
        timeout_s=cfg.loop.push_timeout_s,
        retry_window_s=cfg.loop.retry_window_s,
    )


async def run_trainer(
    cfg: TrainerConfig,
    *,
    stop_event: asyncio.Event | None = None,
    sink: WeightSink | None = None,
    console: bool = True,
    warm: WarmStartPlan | None = None,
) -> int:
    """Run the trainer until ``stop_event`` is set or ``cfg.loop.max_steps`` steps ran.

    Reads the staleness rule's settings from the proxy at
    ``cfg.connection.proxy_url`` (``proxima.trainer.proxy_settings``), opens
    the store at ``cfg.connection.db_url`` and pushes to the proxy (unless
    another ``sink`` is given). Returns
    the number of steps this run took. This is what ``proxima trainer`` and
    ``proxima train`` call.

    With ``warm`` the trainer takes the warm start's supervised steps instead
    (``proxima.trainer.sft``), pushes one version and returns 1 (0 when no session was kept).
    """
    conn = cfg.connection
    missing = [m for m in conn.missing() if not (m == "proxy_url" and sink is not None)]
    if missing:
        flags = {"proxy_url": "--proxy URL", "db_url": "--db URL", "model_dir": "--model DIR"}
        raise ValueError(
            "the trainer needs " + ", ".join(f"connection.{m} ({flags[m]})" for m in missing)
        )
    assert conn.db_url is not None
    leader: RankZeroLeader | None = None
    if torchrun_world_size() > 1:
        rank = init_ranks(cfg)
        if rank != 0:
            return await follow_rank_zero(cfg)
        leader = RankZeroLeader()
    try:
        if conn.proxy_url is not None:  # the staleness rule's settings are the proxy's
            token = conn.admin_token.get_secret_value() if conn.admin_token else None
            settings = await fetch_proxy_settings(
                conn.proxy_url, admin_token=token, retry_window_s=cfg.loop.retry_window_s
            )
            cfg = adopt_proxy_settings(cfg, settings, proxy_url=conn.proxy_url)
        # Its calls retry a store outage (a PostgreSQL restart) for [loop] retry_window_s.
        store = await RetryingStore.open_retrying(conn.db_url, window_s=cfg.loop.retry_window_s)
        own_sink = sink is None
        if sink is None:
            assert conn.proxy_url is not None
            token = conn.admin_token.get_secret_value() if conn.admin_token else None
            sink = weight_sink(cfg, conn.proxy_url, token)
        try:
            if cfg.adapters:  # LoRA adapters on a frozen base (torch backend, one process)
                adapters = await AdapterTrainers.start(cfg, store=store, sink=sink, console=console)
                return await adapters.run(stop_event or asyncio.Event())
            trainer = await Trainer.start(
                cfg, store=store, sink=sink, console=console, leader=leader
            )
            if warm is not None:
                try:
                    done = await warm_start(trainer, warm)
                finally:
                    await trainer.close()
                return 1 if "losses" in done else 0
            return await trainer.run(stop_event or asyncio.Event())
        finally:
            if own_sink:
                await sink.aclose()
            await store.close()
    finally:
        if leader is not None:
            await asyncio.to_thread(leader.stop)
