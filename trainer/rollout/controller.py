"""Rollout controller: drive ``run_agent_return_reward(data)`` over a dataset.

For every dataset item the controller runs the user's agent ``group_size``
times, each run in its own proxy session (docs/design.md,
"Protocols")::

    for item in dataset:                          # in order, bounded by max_concurrency
        for k in range(group_size):
            session = POST /rl/sessions {group_id, data_id, metadata}
                      # 429 + Retry-After (staleness capacity): wait, retry
                      # lost in transport, 502/503/504: retry with the same Idempotency-Key
            reward  = run_agent_return_reward(item + {base_url, api_key, ...})
                      # bound to the session; raises or times out -> failed
            POST /rl/sessions/{id}/reward  (final, or one per completion)
            POST /rl/sessions/{id}/finish  {status: finished | failed}

Every call to the proxy that is lost in transport or answered "not now" is retried for
``retry_window_s`` (a PostgreSQL or engine restart is waited out, not the end of the run).

The agent module is not modified (loading and calling it: ``proxima.trainer.rollout.agents``). In ``"inprocess"`` mode its HTTP requests
to the proxy's ``/v1`` carry the session key through :mod:`proxima.trainer.rollout.binding`
(a context variable plus an httpx hook), whatever ``api_key`` the agent
passed; sync agents run in worker threads, which inherit the context. In
``"subprocess"`` mode each run is a fresh ``python -c`` process with
``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (and ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``)
set for its session, the item as JSON
on stdin and the reward as JSON on stdout, for agents that read globals or
must be killable. In ``"ray"`` mode (``pip install 'proxima[ray]'``) each run is
a Ray task on any node of a Ray cluster, bound to its session the same two
ways (environment and httpx hook); the controller still opens, rewards and
finishes every session itself (``proxima.trainer.rollout.ray_agents``).

What an agent may return:

- a number (``float``, ``int`` or ``bool``): the session's final reward;
- a mapping ``{completion_id: reward, ..., "final": reward}``: per-turn
  rewards for the named completions (chat response ``id``; ``{id}-{i}`` for
  choice ``i > 0``) and an optional final reward.

Anything else, an exception, a rejected reward, or running past ``timeout_s``
finishes the session as ``failed``: it is counted in the report, never
trained on, and the rollout goes on.

Every pass (:meth:`RolloutController.run`) groups the runs of one item under
``group_id = f"{data_id}@{tag}"`` with a fresh random ``tag`` (or the
``group_tag`` given), so that the group-relative baseline never mixes runs
of the same item from different passes (different policies); ``data_id`` is
stored unchanged.

The report a pass returns (:class:`RolloutReport`, one :class:`RunResult` per run) is
``proxima.trainer.rollout.report``'s; reading a dataset is ``proxima.trainer.rollout.dataset``'s.
Both are importable from here too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from proxima.trainer.config import ADAPTER_NAME, RETRY_WINDOW_S
from proxima.trainer.rollout.agents import (
    AgentError,
    AgentFn,
    Mode,
    agent_spec,
    call_inprocess,
    call_subprocess,
    check_importable,
    first_rollout_error,
    parse_reward,
    resolve_agent,
)
from proxima.trainer.rollout.binding import SessionBinding, bound_context
from proxima.trainer.rollout.dataset import Dataset, item_id, iter_dataset
from proxima.trainer.rollout.ray_agents import RayAgentRunner, RayOutcome, import_ray
from proxima.trainer.rollout.report import RolloutReport, RunResult
from proxima.trainer.rollout.sessions import finish_session, open_session, post_rewards

__all__ = [
    "CANCEL_GRACE_S",
    "Dataset",
    "RolloutController",
    "RolloutReport",
    "RunResult",
    "item_id",
    "iter_dataset",
    "main",
]

logger = logging.getLogger(__name__)

# How long a cancelled in-process agent gets to unwind before the run is given up on.
CANCEL_GRACE_S = 5.0


# --------------------------------------------------------------------------- controller


class RolloutController:
    """Runs an unmodified agent over a dataset, one proxy session per run.

    Args:
        proxy_url: the proxy's root URL (``http://host:port``, no ``/v1``).
        admin_token: bearer token allowed to open sessions (``POST /rl/sessions``).
        agent: ``run_agent_return_reward`` itself or ``"module:function"``;
            async or sync (sync ones run in worker threads).
        group_size: runs (sessions) per item, sharing one ``group_id``.
        max_concurrency: runs in flight at once (waiting for a session included).
        timeout_s: wall-clock limit of one agent run; past it the run is
            cancelled (in-process) or killed (subprocess) and its session failed.
            A sync in-process agent's worker thread cannot be interrupted: it is
            abandoned and holds its worker until it returns, so use subprocess
            mode for sync agents that may hang.
        mode: ``"inprocess"``, ``"subprocess"`` or ``"ray"`` (see the module docstring).
        model: if given, added to each item as ``data["model"]`` (unless the
            item has one) and exported as ``OPENAI_MODEL`` to subprocess and Ray runs.
        env: extra environment for subprocess and Ray runs (e.g. ``PYTHONPATH``).
        group_tag: suffix of this controller's group ids (random per pass if unset).
        http_timeout_s: timeout of the controller's own calls to the proxy.
        python: interpreter for subprocess runs.
        ray_address: the Ray cluster to join in ``"ray"`` mode when this process has not
            called ``ray.init`` itself (``"auto"``, ``"ray://head:10001"``; default
            ``$RAY_ADDRESS``).
        ray_options: Ray task options for every run (``num_cpus``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``...); retries stay off.
        adapter: the LoRA adapter these runs train (each session is opened with
            ``{"adapter": ...}``: served by that adapter, trained into it); None: the base.
        transport: the httpx transport of the controller's own calls to the proxy
            (default: httpx's; tests hand in one that loses requests); one pass's
            client closes it at the end of :meth:`run`.
        retry_window_s: how long a call that is lost in transport or answered "not now"
            (502/503/504, 429 with ``Retry-After``: the store or an engine restarting) is
            retried: the controller's own calls (``proxima.trainer.rollout.sessions``) and,
            in ``"inprocess"`` and ``"ray"`` modes, the agent's calls to its session's
            ``/v1`` (``proxima.trainer.rollout.binding``). 0: none is retried.
    """

    def __init__(
        self,
        proxy_url: str,
        admin_token: str,
        agent: str | AgentFn,
        *,
        group_size: int = 1,
        max_concurrency: int = 8,
        timeout_s: float = 600.0,
        mode: Mode = "inprocess",
        model: str | None = None,
        env: Mapping[str, str] | None = None,
        group_tag: str | None = None,
        http_timeout_s: float = 60.0,
        python: str = sys.executable,
        ray_address: str | None = None,
        ray_options: Mapping[str, Any] | None = None,
        adapter: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not retry_window_s >= 0:
            raise ValueError(f"retry_window_s must be >= 0, got {retry_window_s}")
        if mode not in ("inprocess", "subprocess", "ray"):
            raise ValueError(f"mode must be 'inprocess', 'subprocess' or 'ray', got {mode!r}")
        if adapter is not None and not ADAPTER_NAME.match(adapter):
            raise ValueError(
                f"adapter {adapter!r} is not an adapter name (lower-case letters, digits, '-', "
                "'_'; first a letter or digit; at most 64 characters)"
            )
        self.proxy_url = proxy_url.rstrip("/")
        self.admin_token = admin_token
        self.group_size = group_size
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.mode: Mode = mode
        self.model = model
        self.env = dict(env or {})
        self.group_tag = group_tag
        self.http_timeout_s = http_timeout_s
        self.python = python
        self.adapter = adapter
        self._transport = transport
        self.retry_window_s = retry_window_s
        self._ray: RayAgentRunner | None = None
        # Fail at construction, not on the first run, when the agent cannot be found.
        if mode == "inprocess":
            self._agent_fn: AgentFn | None = resolve_agent(agent)
            self._agent_spec: str | None = None
        elif mode == "ray":
            import_ray()
            # Resolved on the workers: the module need not be importable here.
            self._agent_fn, self._agent_spec = None, None
            self._ray = RayAgentRunner(
                agent, address=ray_address, options=ray_options, env=self.env, model=model
            )
        else:
            self._agent_fn = None
            self._agent_spec = agent_spec(agent)
            # Not imported here: subprocess agents may need their run's environment to import.
            check_importable(self._agent_spec, self.env.get("PYTHONPATH", ""))
        self._report = RolloutReport()
        self._stopping: asyncio.Event | None = None

    # -- public ---------------------------------------------------------------------------

    @property
    def progress(self) -> RolloutReport:
        """The report of the current (or last) pass, updated live."""
        return self._report

    def stop(self) -> None:
        """Start no new runs and stop waiting for capacity; runs in flight finish.

        Call it from the event loop that runs :meth:`run`.
        """
        if self._stopping is not None:
            self._stopping.set()

    async def run(self, dataset: Dataset) -> RolloutReport:
        """Run the agent ``group_size`` times on every item of ``dataset``; see the module docs."""
        report = self._report = RolloutReport()
        self._stopping = asyncio.Event()
        tag = self.group_tag or secrets.token_hex(4)
        started = time.monotonic()
        slots = asyncio.Semaphore(self.max_concurrency)
        executor = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="agent")
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        try:
            if self._ray is not None:
                await asyncio.to_thread(self._ray.connect)  # off the event loop: may block long
            async with (
                httpx.AsyncClient(
                    base_url=self.proxy_url,
                    headers=headers,
                    timeout=self.http_timeout_s,
                    transport=self._transport,
                ) as client,
                asyncio.TaskGroup() as runs,
            ):
                index = -1
                async for item in iter_dataset(dataset):
                    index += 1
                    if self._stopping.is_set():
                        break
                    report.items += 1
                    data_id = item_id(item, index)
                    for sample in range(self.group_size):
                        await slots.acquire()  # items start in dataset order
                        if self._stopping.is_set():
                            slots.release()
                            break
                        runs.create_task(
                            self._run_one(
                                client,
                                executor,
                                slots,
                                item,
                                data_id=data_id,
                                group_id=f"{data_id}@{tag}",
                                sample=sample,
                                index=index,
                                tag=tag,
                            )
                        )
        except BaseExceptionGroup as group:
            raise first_rollout_error(group) from None
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            report.elapsed_s = time.monotonic() - started
        logger.info("rollout finished", extra={"rollout": report.summary()})
        return report

    # -- one run --------------------------------------------------------------------------

    def _count_wait(self, seconds: float) -> None:
        """A 429 from ``POST /rl/sessions``, waited out for ``seconds``."""
        self._report.waits_429 += 1
        self._report.wait_seconds_429 += seconds

    async def _run_one(
        self,
        client: httpx.AsyncClient,
        executor: ThreadPoolExecutor,
        slots: asyncio.Semaphore,
        item: dict[str, Any],
        *,
        data_id: str,
        group_id: str,
        sample: int,
        index: int,
        tag: str,
    ) -> None:
        report = self._report
        try:
            metadata = {
                "sample": sample,
                "item_index": index,
                "rollout": tag,
                "group_size": self.group_size,  # the trainer claims the group once all exist
            }
            assert self._stopping is not None
            opened = await open_session(
                client,
                self._stopping,
                self._count_wait,
                group_id=group_id,
                data_id=data_id,
                metadata=metadata,
                adapter=self.adapter,
                window_s=self.retry_window_s,
            )
            if opened is None:
                return
            report.sessions_started += 1
            session_id = opened["session_id"]
            result = RunResult(session_id, group_id, data_id, sample, status="failed", reward=None)
            t0 = time.monotonic()
            try:
                result = await self._agent_run(client, executor, item, opened, result)
            finally:
                result.seconds = time.monotonic() - t0
                await asyncio.shield(
                    finish_session(client, session_id, result.status, window_s=self.retry_window_s)
                )
                report.runs.append(result)
                if result.status == "finished":
                    report.sessions_rewarded += 1
                else:
                    report.sessions_failed += 1
                    report.timeouts += result.timed_out
        finally:
            slots.release()

    async def _agent_run(
        self,
        client: httpx.AsyncClient,
        executor: ThreadPoolExecutor,
        item: dict[str, Any],
        opened: dict[str, Any],
        result: RunResult,
    ) -> RunResult:
        session_id, api_key, base_url = opened["session_id"], opened["api_key"], opened["base_url"]
        data = {**item, "base_url": base_url, "api_key": api_key, "session_id": session_id}
        data.setdefault("group_index", result.sample)  # which of the group's runs (seeded sampling)
        if self.model is not None:
            data.setdefault("model", self.model)
        binding = SessionBinding(
            session_id=session_id,
            api_key=api_key,
            base_url=base_url,
            prefixes=(self.proxy_url + "/v1",),
            retry_window_s=self.retry_window_s,
        )
        if self._ray is not None:
            agent_call = self._ray.call(data, binding)
        elif self._agent_fn is not None:
            agent_call = call_inprocess(self._agent_fn, executor, data)
        else:
            assert self._agent_spec is not None
            agent_call = call_subprocess(
                self._agent_spec,
                data,
                binding,
                env=self.env,
                model=self.model,
                python=self.python,
            )
        task = asyncio.create_task(agent_call, context=bound_context(binding))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
                result.timed_out = True
                result.error = f"agent timed out after {self.timeout_s:g}s"
                logger.warning(
                    "agent timed out", extra={"session_id": session_id, "timeout_s": self.timeout_s}
                )
                return result
            value = task.result()
            if isinstance(value, RayOutcome):
                result.node_id, value = value.node_id, value.value
            reward = parse_reward(value)
            await post_rewards(client, session_id, reward, window_s=self.retry_window_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the agent contract: any agent failure fails its session
            result.error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "agent run failed",
                extra={"session_id": session_id, "error": result.error},
                exc_info=not isinstance(exc, AgentError),
            )
            return result
        result.status, result.reward = "finished", reward.total
        return result


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m proxima.trainer.rollout.controller``: run an agent over a JSONL dataset, print the report."""
    parser = argparse.ArgumentParser(
        prog="python -m proxima.trainer.rollout.controller", description=main.__doc__
    )
    parser.add_argument("--proxy", required=True, help="proxy root URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("PROXIMA_ADMIN_TOKEN"),
        help="admin bearer token (default: $PROXIMA_ADMIN_TOKEN)",
    )
    parser.add_argument("--agent", required=True, help="module:function")
    parser.add_argument("--dataset", required=True, type=Path, help="JSONL file, one item per line")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per agent run")
    parser.add_argument("--mode", choices=["inprocess", "subprocess", "ray"], default="inprocess")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster for --mode ray (default: $RAY_ADDRESS, else a local instance)",
    )
    parser.add_argument("--model", default=None, help="model name given to the agent")
    parser.add_argument(
        "--adapter", default=None, help="the LoRA adapter the sessions train (default: the base)"
    )
    args = parser.parse_args(argv)
    if not args.admin_token:
        parser.error("--admin-token or PROXIMA_ADMIN_TOKEN is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    controller = RolloutController(
        args.proxy,
        args.admin_token,
        args.agent,
        group_size=args.group_size,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        mode=args.mode,
        model=args.model,
        ray_address=args.ray_address,
        adapter=args.adapter,
    )
    report = asyncio.run(controller.run(args.dataset))
    print(json.dumps(report.summary(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
