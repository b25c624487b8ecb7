"""Agent runs as Ray tasks: ``run_agent_return_reward(data)`` on any node of a Ray cluster.

``pip install 'proxima[ray]'``. The rollout controller (``mode="ray"``) keeps
everything it does today (sessions opened and finished by it, 429s waited out,
``max_concurrency`` runs in flight, the report) and hands only the agent call
to Ray: one task per run, placed by Ray's scheduler on any node with a free
slot. The task gets the item plus its session's ``base_url``, ``api_key`` and
``session_id``, and runs the agent in that worker process bound to the session:

- ``OPENAI_BASE_URL``/``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``
  and ``PROXIMA_SESSION_ID`` are set for the duration of the call (a Ray
  worker runs one task at a time) and restored afterwards;
- the httpx hook of :mod:`proxima.trainer.rollout.binding` puts the session key on the
  agent's requests to the session's ``/v1``, whatever key its client was built
  with (the same as in-process mode).

The agent is either ``"module:function"``, imported on the worker (the module
must be installed there, e.g. in the image or through the job's runtime
environment), or a function, shipped by Ray (cloudpickle; a module-level
function must be importable on the worker too).

Failures: an exception raised by the agent is a failed run; a task that dies
(its worker killed, out of memory, its node lost) is a failed run too, with
Ray's reason as the error; either way the controller finishes the session as
``failed`` and frees its slot. A task is never retried by Ray
(``max_retries=0``): a second attempt would add turns to a session that
already holds the first attempt's. Past ``timeout_s`` (counted from submission,
queueing in Ray included) the task is cancelled with ``force=True``, which
kills its worker.

What the agents print stays in Ray's worker logs (the controller joins with
``log_to_driver=False``: thousands of runs would flood its console); their
errors are in the report. Ray is imported lazily: without the extra, only
``mode="ray"`` is unavailable.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxima.trainer.rollout.agents import (
    AgentError,
    AgentFn,
    RolloutError,
    resolve_agent,
    session_env,
)
from proxima.trainer.rollout.binding import SessionBinding, bind_session

# Ray options of every agent task; the caller's ``ray_options`` are applied on top,
# except the retry settings, which stay off (see the module docstring).
DEFAULT_TASK_OPTIONS: dict[str, Any] = {"num_cpus": 1}
NO_RETRIES: dict[str, Any] = {"max_retries": 0, "retry_exceptions": False}


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`RolloutError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RolloutError(
            "mode='ray' needs Ray: pip install 'proxima[ray]' (the same Ray version on every node)"
        ) from exc
    return ray


@dataclass(frozen=True, slots=True)
class RayOutcome:
    """What one agent task returned, and where it ran."""

    value: Any
    node_id: str


def run_in_worker(
    agent: str | AgentFn,
    data: dict[str, Any],
    binding: SessionBinding,
    env: Mapping[str, str],
) -> tuple[Any, str]:
    """The body of one Ray task: the agent's return value and the id of the node it ran on."""
    import ray

    fn = resolve_agent(agent)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with bind_session(binding):
            value = fn(data)
            if inspect.isawaitable(value):

                async def _await(awaitable: Any) -> Any:
                    return await awaitable

                # asyncio.run copies this context: the binding follows the agent's tasks.
                value = asyncio.run(_await(value))
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
    return value, ray.get_runtime_context().get_node_id()


class RayAgentRunner:
    """Submits agent runs to the Ray cluster this process is connected to.

    Args:
        agent: ``"module:function"`` or the function itself.
        address: the cluster to join when this process has not called ``ray.init``
            (``"auto"``, ``"ray://head:10001"``, ...; ``None``: ``$RAY_ADDRESS`` or a
            new local instance, as ``ray.init`` decides).
        options: Ray task options (``num_cpus``, ``resources``, ``runtime_env``,
            ``scheduling_strategy``, ...), on top of ``num_cpus=1``.
        env: extra environment for the agent (set around the call on the worker).
        model: exported as ``OPENAI_MODEL``.
    """

    def __init__(
        self,
        agent: str | AgentFn,
        *,
        address: str | None = None,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        model: str | None = None,
    ) -> None:
        if isinstance(agent, str):
            module_name, sep, attr = agent.partition(":")
            if not sep or not module_name or not attr:
                raise RolloutError(f"agent must be 'module:function', got {agent!r}")
        elif not callable(agent):
            raise RolloutError(f"agent {agent!r} is not callable")
        self.agent = agent
        self.address = address
        self.options = {**DEFAULT_TASK_OPTIONS, **(options or {}), **NO_RETRIES}
        self.env = dict(env or {})
        self.model = model
        self._remote: Any = None

    def connect(self) -> None:
        """Join the cluster (unless this process already has) and register the task.

        Blocking (``ray.init`` may wait long for an unreachable cluster): the controller
        calls it on a worker thread before its first run. A failure is a
        :class:`RolloutError`: without a cluster no run can start.
        """
        ray = import_ray()
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, log_to_driver=False)
            except Exception as exc:  # noqa: BLE001 - Ray raises several types for this
                raise RolloutError(
                    f"cannot join the Ray cluster at {self.address or '$RAY_ADDRESS'}: {exc}"
                ) from exc
        if self._remote is None:
            self._remote = ray.remote(run_in_worker)

    async def call(self, data: dict[str, Any], binding: SessionBinding) -> RayOutcome:
        """Run the agent on ``data`` in a Ray task; cancelling this kills the task's worker."""
        ray = import_ray()
        if self._remote is None:
            await asyncio.to_thread(self.connect)
        task = self._remote
        env = {**session_env(binding, self.model), **self.env}
        ref = task.options(**self.options).remote(self.agent, data, binding, env)
        try:
            value, node_id = await ref
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)
            raise
        except ray.exceptions.RayTaskError as exc:
            # The agent raised: its own exception, with the worker's traceback in the message.
            raise AgentError(f"agent raised on a Ray worker: {exc.cause!r}") from exc
        except ray.exceptions.RayError as exc:
            # The task died (worker crashed or killed, out of memory, node lost, cancelled).
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise AgentError(f"agent task died: {type(exc).__name__}: {first_line}") from exc
        return RayOutcome(value=value, node_id=node_id)
