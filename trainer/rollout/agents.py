"""The user's agent: loading it, calling it for one session, and reading the reward it returns.

``run_agent_return_reward(data)`` is found from ``"module:function"``
(:func:`resolve_agent`) and called either here (:func:`call_inprocess`: async
agents awaited, sync ones on a worker thread that inherits the session
binding of ``proxima.trainer.rollout.binding``) or in a fresh interpreter
(:func:`call_subprocess`: ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` and
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` set for the session, the item as
JSON on stdin, the reward as JSON on stdout). What it returns is normalised by
:func:`parse_reward` (see ``proxima.trainer.rollout.controller`` for the contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import importlib.machinery
import inspect
import json
import math
import numbers
import os
import signal
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from proxima.trainer.rollout.binding import SessionBinding

AgentFn = Callable[[dict[str, Any]], Any]
Mode = Literal["inprocess", "subprocess", "ray"]

FINAL_KEY = "final"
# Kept from a failed subprocess agent's stderr, for the report and the log.
STDERR_TAIL_CHARS = 4000


class RolloutError(Exception):
    """The rollout cannot go on (proxy unreachable, bad admin token, bad agent spec)."""


class AgentError(Exception):
    """One agent run failed in a way that is the agent's doing; its session is failed."""


def first_rollout_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error to raise for a failed task group: its first :class:`RolloutError`, else
    its only exception, else the group itself."""
    leaves: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        else:
            leaves.append(exc)

    collect(group)
    rollout_errors = [e for e in leaves if isinstance(e, RolloutError)]
    if rollout_errors:
        return rollout_errors[0]
    return leaves[0] if len(leaves) == 1 else group


# --------------------------------------------------------------------------- rewards


@dataclass(frozen=True, slots=True)
class AgentReward:
    """An agent's return value, normalised: a final reward and per-completion rewards."""

    final: float | None
    per_completion: dict[str, float]

    @property
    def total(self) -> float:
        """Sum of every reward the run posted (the final one included)."""
        return (self.final or 0.0) + sum(self.per_completion.values())


def _as_reward(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real):
        raise AgentError(f"{what} must be a number, got {type(value).__name__}: {value!r}")
    reward = float(value)
    if not math.isfinite(reward):
        raise AgentError(f"{what} must be finite, got {reward}")
    return reward


def parse_reward(value: Any) -> AgentReward:
    """Normalise what ``run_agent_return_reward`` returned (see the module docstring)."""
    if isinstance(value, Mapping):
        final: float | None = None
        per_completion: dict[str, float] = {}
        for key, reward in value.items():
            if not isinstance(key, str):
                raise AgentError(f"reward keys must be completion ids (str), got {key!r}")
            if key == FINAL_KEY:
                final = _as_reward(reward, "the final reward")
            else:
                per_completion[key] = _as_reward(reward, f"the reward of completion {key}")
        if final is None and not per_completion:
            raise AgentError("the agent returned an empty reward mapping")
        return AgentReward(final=final, per_completion=per_completion)
    return AgentReward(final=_as_reward(value, "the reward"), per_completion={})


# --------------------------------------------------------------------------- loading


def resolve_agent(agent: str | AgentFn) -> AgentFn:
    """Import ``"package.module:function"`` (or return a callable as is)."""
    if callable(agent):
        return agent
    module_name, sep, attr = agent.partition(":")
    if not sep or not module_name or not attr:
        raise RolloutError(f"agent must be 'module:function', got {agent!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RolloutError(f"cannot import agent module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise RolloutError(f"{module_name!r} has no attribute {attr!r}") from exc
    if not callable(target):
        raise RolloutError(f"agent {agent!r} is not callable")
    fn: AgentFn = target
    return fn


def agent_spec(agent: str | AgentFn) -> str:
    """The ``"module:function"`` spelling of ``agent`` (for subprocess mode)."""
    if isinstance(agent, str):
        return agent
    module, qualname = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise RolloutError(
            f"subprocess mode needs an importable agent; pass 'module:function' instead of {agent!r}"
        )
    return f"{module}:{qualname}"


def check_importable(spec: str, pythonpath: str = "") -> None:
    """Raise :class:`RolloutError` unless ``spec``'s top-level module can be found (not imported).

    The search covers ``sys.path`` and the ``pythonpath`` entries a subprocess will get.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RolloutError(f"agent must be 'module:function', got {spec!r}")
    top = module_name.split(".")[0]
    if top in sys.modules or top in sys.builtin_module_names:
        return
    search = [p for p in pythonpath.split(os.pathsep) if p] + sys.path
    if importlib.machinery.PathFinder.find_spec(top, search) is None:
        raise RolloutError(
            f"cannot find agent module {module_name!r} (searched sys.path and PYTHONPATH)"
        )


# --------------------------------------------------------------------------- calling


# Runs one agent in a fresh interpreter: spec in argv, item JSON on stdin, reward JSON on the
# original stdout. The agent's own prints go to stderr so they cannot corrupt the result.
def session_env(binding: SessionBinding, model: str | None) -> dict[str, str]:
    """The environment variables that point the usual SDKs at one session."""
    env = {
        "OPENAI_BASE_URL": binding.base_url,
        "OPENAI_API_KEY": binding.api_key,
        # Anthropic clients append /v1/messages to the proxy's root themselves.
        "ANTHROPIC_BASE_URL": binding.base_url.rstrip("/").removesuffix("/v1"),
        "ANTHROPIC_API_KEY": binding.api_key,
        "PROXIMA_SESSION_ID": binding.session_id,
    }
    if model is not None:
        env["OPENAI_MODEL"] = model
    return env


SUBPROCESS_RUNNER = """\
import asyncio, importlib, inspect, json, os, sys
result_out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
module_name, _, attr = sys.argv[1].partition(":")
fn = importlib.import_module(module_name)
for part in attr.split("."):
    fn = getattr(fn, part)
data = json.load(sys.stdin)
result = fn(data)
if inspect.isawaitable(result):
    async def _await(awaitable):
        return await awaitable
    result = asyncio.run(_await(result))
json.dump({"reward": result}, result_out, default=float)
result_out.flush()
"""


async def call_inprocess(fn: AgentFn, executor: ThreadPoolExecutor, data: dict[str, Any]) -> Any:
    """Call ``fn(data)`` here: awaited if async, else on ``executor`` in this task's context."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(data)
    loop = asyncio.get_running_loop()
    # The worker thread runs in a copy of this task's context: the session binding follows.
    value = await loop.run_in_executor(executor, contextvars.copy_context().run, fn, data)
    if inspect.isawaitable(value):
        value = await value
    return value


async def call_subprocess(
    spec: str,
    data: dict[str, Any],
    binding: SessionBinding,
    *,
    env: Mapping[str, str],
    model: str | None,
    python: str,
) -> Any:
    """Run ``spec`` on ``data`` in a fresh interpreter bound to the session; its reward.

    Killed with its process group when cancelled (a timeout); a non-zero exit
    or no reward on stdout is an :class:`AgentError`.
    """
    env = {**os.environ, **session_env(binding, None), **env}
    if model is not None:
        env["OPENAI_MODEL"] = model
    proc = await asyncio.create_subprocess_exec(
        python,
        "-c",
        SUBPROCESS_RUNNER,
        spec,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = await proc.communicate(json.dumps(data).encode())
    finally:
        if proc.returncode is None:  # timed out or cancelled: kill the agent and its children
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    stderr = err.decode(errors="replace")
    if proc.returncode != 0:
        raise AgentError(
            f"agent process exited with {proc.returncode}: {stderr[-STDERR_TAIL_CHARS:]}"
        )
    try:
        return json.loads(out)["reward"]
    except (ValueError, KeyError, TypeError) as exc:
        raise AgentError(f"agent process wrote no reward: {out[:200]!r}") from exc
