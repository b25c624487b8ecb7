"""A harness in the training loop: ``run_agent_return_reward`` runs a real agent harness binary.

Each run makes a scratch directory, lays out the item's small shell task in it, runs the
harness as a subprocess pointed at the session (its ``base_url`` and ``api_key``, the served
``model``), and scores what the harness left behind with a verifier: 1.0 when the task is
done, else 0.0. The harness is unmodified; every turn it sends goes through the proxy and is
recorded token by token, so a PPO step trains on its trajectories like on any agent's.

Harnesses (``data["harness"]``):

- ``mini-swe-agent`` (default): its ``mini`` CLI with its own ``mini.yaml`` on Chat
  Completions (litellm's ``openai/`` provider), ``--yolo --exit-immediately``, at most
  ``data["step_limit"]`` model calls (default 4), no cost lookup, sampled at
  ``data["temperature"]`` when the item has one.
- ``codex``: Codex CLI (``codex exec``) on Responses through a custom provider, with the
  settings that shorten its prompt to fit a small context (about 1.3k tokens on the demo
  model instead of 8.9k: one line of instructions, no permissions, environment, skills,
  multi-agent or goal prompts) and nothing sent anywhere but the proxy. The binary is
  ``data["codex_bin"]``, else ``codex`` on PATH, else the checkout's
  ``.cache/harnesses/node_modules/.bin/codex`` (``make harnesses``). Its shell runs
  unsandboxed (``--sandbox danger-full-access``) inside the scratch directory: run the
  rollouts in a container or VM.

Tasks (``data["task"]``), each with its verifier:

- ``{"kind": "create", "file": "done.txt", "content": "proxima"}``: create the file with that
  word in it (verified: the file holds exactly the word, one trailing newline allowed);
- ``{"kind": "count", "lines": 7}``: ``data.txt`` holds that many lines; write their number to
  ``count.txt`` (verified: ``count.txt`` holds the number).

A run slower than ``data["timeout_s"]`` (default 240) is killed and scores 0. The run's
scratch directory is removed afterwards unless ``data["keep_dir"]`` names where to keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CODEX_FROM_CHECKOUT = REPO / ".cache" / "harnesses" / "node_modules" / ".bin" / "codex"
CODEX_INSTRUCTIONS = "You complete tasks by running shell commands."
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",  # else it asks for a default model and keys on first run
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # an error ends the run at once (no backoff)
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled price list: no download
}


@dataclass(frozen=True)
class Task:
    """A shell task: what the harness is told, how the directory starts, how it is scored."""

    instruction: str
    files: dict[str, str]
    verify: Callable[[Path], bool]


def _holds(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text(errors="replace") in (text, text + "\n")


def task_of(spec: dict[str, Any]) -> Task:
    """The task an item names (see the module docstring); a bad spec is a ValueError."""
    kind = spec.get("kind")
    if kind == "create":
        name, content = str(spec["file"]), str(spec["content"])
        if "/" in name or not name or not content or "\n" in content:
            raise ValueError(f"a create task needs a plain file name and one word: {spec}")
        return Task(
            f"Create a file named {name} that contains the word {content}.",
            {},
            lambda work: _holds(work / name, content),
        )
    if kind == "count":
        lines = int(spec["lines"])
        if not 0 <= lines <= 10_000:
            raise ValueError(f"a count task has 0 to 10000 lines: {spec}")
        return Task(
            "Count the lines of data.txt and write the number to count.txt.",
            {"data.txt": "".join(f"line {i + 1}\n" for i in range(lines))},
            lambda work: _holds(work / "count.txt", str(lines)),
        )
    raise ValueError(f"unknown task kind {kind!r}: use 'create' or 'count'")


def mini_command(data: dict[str, Any], instruction: str, root: Path) -> list[str]:
    """mini-swe-agent's command line for one run (its trajectory goes to ``root``)."""
    argv = [sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml"]
    specs = [
        f"model.model_kwargs.api_base={data['base_url']}",
        f"model.model_kwargs.api_key={data['api_key']}",
        "model.cost_tracking=ignore_errors",
        f"agent.step_limit={int(data.get('step_limit', 4))}",
    ]
    if data.get("temperature") is not None:
        specs.append(f"model.model_kwargs.temperature={float(data['temperature'])}")
    for spec in specs:
        argv += ["-c", spec]
    argv += ["-m", f"openai/{data['model']}", "-t", instruction, "--yolo", "--exit-immediately"]
    return argv + ["--cost-limit", "0", "-o", str(root / "trajectory.json")]


def codex_config(data: dict[str, Any], instructions: Path) -> str:
    """``config.toml`` for a run: the proxy as the provider, a prompt short enough for a small
    context, nothing sent elsewhere."""
    return f"""\
model = {json.dumps(str(data["model"]))}
model_provider = "proxima"
model_instructions_file = {json.dumps(str(instructions))}
include_permissions_instructions = false
include_apps_instructions = false
include_environment_context = false
web_search = "disabled"
check_for_update_on_startup = false

[skills]
include_instructions = false

[analytics]
enabled = false

[features]
multi_agent = false
goals = false
apps = false
plugins = false

[model_providers.proxima]
name = "Proxima"
base_url = {json.dumps(str(data["base_url"]))}
env_key = "PROXIMA_API_KEY"
wire_api = "responses"
"""


def codex_bin(data: dict[str, Any]) -> str:
    found = data.get("codex_bin") or shutil.which("codex")
    if found:
        return str(found)
    if CODEX_FROM_CHECKOUT.exists():
        return str(CODEX_FROM_CHECKOUT)
    raise FileNotFoundError("Codex CLI not found: `make harnesses`, or put codex on PATH")


def harness_command(
    data: dict[str, Any], instruction: str, root: Path
) -> tuple[list[str], dict[str, str]]:
    """The harness's argv and the environment it adds, for a run whose files are in ``root``
    (``root / "work"`` is its working directory, ``root / "home"`` its home)."""
    harness = data.get("harness", "mini-swe-agent")
    home = root / "home"
    if harness == "mini-swe-agent":
        env = {**MINI_ENV, "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent")}
        return mini_command(data, instruction, root), env
    if harness == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        instructions = codex_home / "instructions.txt"
        instructions.write_text(data.get("instructions", CODEX_INSTRUCTIONS))
        (codex_home / "config.toml").write_text(codex_config(data, instructions))
        argv = [codex_bin(data), "exec", "--skip-git-repo-check", "--color", "never"]
        argv += ["--sandbox", "danger-full-access", instruction]
        return argv, {"CODEX_HOME": str(codex_home), "PROXIMA_API_KEY": str(data["api_key"])}
    raise ValueError(f"unknown harness {harness!r}: use 'mini-swe-agent' or 'codex'")


async def run_harness(
    argv: list[str], env: dict[str, str], work: Path, home: Path, timeout_s: float
) -> int | None:
    """Runs the harness in ``work``; its exit status, or None when it ran out of time (it and
    everything it started are killed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=work,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LANG": "C.UTF-8", **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        return None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def run_agent_return_reward(data: dict[str, Any]) -> float:
    """One harness run on the item's task: 1.0 when its verifier passes, else 0.0."""
    task = task_of(data.get("task") or {"kind": "create", "file": "done.txt", "content": "proxima"})
    keep = data.get("keep_dir")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="proxima-harness-"))
    work, home = root / "work", root / "home"
    try:
        for d in (work, home):
            d.mkdir(parents=True, exist_ok=True)
        for name, text in task.files.items():
            (work / name).write_text(text)
        argv, env = harness_command(data, task.instruction, root)
        await run_harness(argv, env, work, home, float(data.get("timeout_s", 240)))
        return 1.0 if task.verify(work) else 0.0
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    """Standalone: one run against an endpoint (``--harness``, ``--task`` as JSON)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), required=False)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "proxima"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--harness", default="mini-swe-agent", choices=["mini-swe-agent", "codex"])
    parser.add_argument("--task", default='{"kind": "create", "file": "done.txt", "content": "x"}')
    args = parser.parse_args()
    data = {
        "base_url": args.base_url or "http://127.0.0.1:8000/v1",
        "api_key": args.api_key,
        "model": args.model,
        "harness": args.harness,
        "task": json.loads(args.task),
    }
    print(asyncio.run(run_agent_return_reward(data)))


if __name__ == "__main__":
    main()
