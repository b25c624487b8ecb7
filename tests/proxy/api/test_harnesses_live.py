"""Codex CLI and Claude Code (the real binaries from npm), the OpenAI Agents SDK and mini-swe-agent,
end to end against ``proxima serve``.

``make harnesses`` installs ``@openai/codex`` and ``@anthropic-ai/claude-code``
(pinned) under ``.cache/harnesses``. Each harness runs non-interactively
(``codex exec`` with a custom provider, ``wire_api = "responses"``; ``claude
-p`` with ``ANTHROPIC_BASE_URL``), offline: telemetry and update checks off,
and every proxy variable pointing at a closed loopback port, so any request
that is not to the proxy on 127.0.0.1 fails. The Agents SDK runs as a script in
a subprocess: an ``Agent`` with one function tool (``run_shell``) on the
default Responses model, its client's base URL the session's, ``Runner.run``;
it has its own taught model (its prompt is short: taught in seconds). So does
mini-swe-agent (PyPI ``mini-swe-agent``, its ``mini`` CLI with its default
``mini.yaml``, litellm's ``openai/`` provider on the session's base URL), whose
second turn is its own submit command rather than a short answer.

The model is a tiny one taught the harness's task from the harness's own
first request: the harness is run once against a capturing server on
loopback (which answers 400), its body is translated by the proxy's own
translation, rendered by the chat template, and the model is taught to answer
it with one call of the harness's shell tool and, after the tool's result, a
short final answer (``proxy.testing.teach.teach_texts``). Then the harness
runs against the proxy: it passes when the harness exits 0, its shell tool
really ran (the file it writes exists), and the session's trajectory holds
both turns token-exactly: turn 2's prompt is turn 1's prompt + its output +
the tool result's tokens, with one logprob and one version per generated token.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.surfaces.chat import translate as openai_translate
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.surfaces.messages import translate as messages_translate
from proxima.proxy.surfaces.messages.schema import MessagesRequest
from proxima.proxy.surfaces.responses import translate as responses_translate
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.proxy.testing.cache import built_once
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.teach import MIN_PROB, least_taught_probs, teach_texts
from proxima.proxy.testing.tiny_model import build_tiny_model, build_tiny_tokenizer
from transformers import AutoTokenizer

# Teaching the model (once per checkout and day: the prompts hold the date) takes a minute or
# two on 2 idle cores on some days; both harnesses then run in seconds. Claude Code writes
# today's date into its system prompt, so a prompt that holds the date is taught for the next
# day too: a run that crosses midnight between capture and use still sends a prompt the model
# was taught. Some days' prompts take far longer: Codex and Claude Code's model for 2026-11-29
# took 528 s on 2 idle cores of a host at half the usual speed, and over 1,200 s beside the
# suite's other test process; the limit leaves room for that.
pytestmark = pytest.mark.timeout(2700)

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache"
BIN = CACHE / "harnesses" / "node_modules" / ".bin"
TASK = "Create a file named done.txt that contains the word proxima."
COMMAND = "echo proxima > done.txt"
FINAL = "Done."
END = "<|im_end|>"
CONTEXT = 4096

# Nothing may leave the machine: proxies point at a closed port, loopback excepted.
OFFLINE_ENV = {
    **{k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
    **{k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "all_proxy")},
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
CLAUDE_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}
CLAUDE_ARGS = [
    "--bare",
    "--tools",
    "Bash",
    "--allowedTools",
    "Bash",
    "--system-prompt",
    "You complete tasks by running shell commands.",
    "--output-format",
    "json",
]
CODEX_INSTRUCTIONS = "You complete tasks by running shell commands."


def codex_config(base_url: str, model: str, instructions: Path) -> str:
    """The README's provider block, plus the settings that keep the prompt short and offline."""
    return f"""\
model = "{model}"
model_provider = "proxima"
model_instructions_file = "{instructions}"
check_for_update_on_startup = false
include_permissions_instructions = false
include_apps_instructions = false
include_environment_context = false

[skills]
include_instructions = false

[analytics]
enabled = false

[features]
goals = false
apps = false
plugins = false
multi_agent = false

[agents]
enabled = false

[model_providers.proxima]
name = "Proxima"
base_url = "{base_url}"
env_key = "PROXIMA_API_KEY"
wire_api = "responses"
"""


def harness_bin(name: str) -> Path:
    path = BIN / name
    if not path.exists():  # a missing harness is a failure, never a skip
        pytest.fail(f"{path} is missing: `make harnesses` installs it (make test does)")
    return path


# ------------------------------------------------------------------ the two harnesses


def chat_of(canonical_input: Any) -> ChatInput:
    """A first request's canonical input, which for these harnesses is a chat."""
    assert isinstance(canonical_input, ChatInput)
    return canonical_input


class Harness:
    """One harness: how it is run, and the chat request its first body becomes."""

    name: str
    tool_output_guesses: list[str]
    # What the model writes after the tool's result: a short answer (or, for a harness that
    # ends on a tool call of its own, that call).
    final = FINAL

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"  # the task's directory: done.txt appears here
        self.home = root / "home"
        for d in (self.work, self.home):
            d.mkdir(parents=True, exist_ok=True)

    def run(self, base_url: str, api_key: str, model: str) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError

    def chat_input(self, body: dict[str, Any]) -> ChatInput:
        raise NotImplementedError

    def call(self) -> dict[str, Any]:
        raise NotImplementedError

    def draw_tool_output(self, rng: random.Random) -> str | None:
        """A tool result as one run could see it, for a tool whose result varies from run to
        run; None when it does not."""
        return None

    def _run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.work,
            env={
                "PATH": os.environ["PATH"],
                "HOME": str(self.home),
                "LANG": "C.UTF-8",
                **OFFLINE_ENV,
                **env,
            },
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )


def codex_exec_output(rng: random.Random) -> str:
    """An exec_command result for a command that prints nothing, as Codex writes it: a random
    6-hex-digit chunk id, the wall time (mostly 0.0000 s; more on a loaded machine), the
    exit code, the output's token count and the (empty) output."""
    chunk = "".join(rng.choice("0123456789abcdef") for _ in range(6))
    wall = 0.0 if rng.random() < 0.5 else rng.random() ** 3
    return (
        f"Chunk ID: {chunk}\nWall time: {wall:.4f} seconds\nProcess exited with code 0\n"
        "Original token count: 0\nOutput:\n"
    )


class Codex(Harness):
    name = "codex"
    # Its exec_command result varies from run to run (the chunk id, the wall time): a model
    # taught two of them wrote "Done." after an unseen one with a least token probability
    # under 0.99 for 32 of 100 random ones (a stray 1.6% of runs at temperature 1; a CI run
    # strayed). It is taught a spread of them, then checked on unseen ones (teach_unseen).
    tool_output_guesses = [codex_exec_output(random.Random(i)) for i in range(8)]

    def draw_tool_output(self, rng: random.Random) -> str | None:
        return codex_exec_output(rng)

    def run(self, base_url: str, api_key: str, model: str) -> subprocess.CompletedProcess[str]:
        codex_home = self.root / "codex-home"
        codex_home.mkdir(exist_ok=True)
        instructions = self.root / "instructions.txt"
        instructions.write_text(CODEX_INSTRUCTIONS)
        (codex_home / "config.toml").write_text(codex_config(base_url, model, instructions))
        argv = [str(harness_bin("codex")), "exec", "--skip-git-repo-check", "--color", "never"]
        argv += ["--sandbox", "danger-full-access", TASK]
        return self._run(argv, {"CODEX_HOME": str(codex_home), "PROXIMA_API_KEY": api_key})

    def chat_input(self, body: dict[str, Any]) -> ChatInput:
        return chat_of(
            responses_translate.canonical_request(ResponsesRequest.model_validate(body)).input
        )

    def call(self) -> dict[str, Any]:
        return {"name": "exec_command", "arguments": {"cmd": COMMAND}}


class ClaudeCode(Harness):
    name = "claude"
    # Its Bash tool's result for a command that prints nothing.
    tool_output_guesses = ["(Bash completed with no output)", ""]

    def run(self, base_url: str, api_key: str, model: str) -> subprocess.CompletedProcess[str]:
        env = {
            **CLAUDE_ENV,
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": api_key,
        }
        argv = [str(harness_bin("claude")), "-p", TASK, "--model", model, *CLAUDE_ARGS]
        return self._run(argv, env)

    def chat_input(self, body: dict[str, Any]) -> ChatInput:
        return chat_of(
            messages_translate.canonical_request(MessagesRequest.model_validate(body)).input
        )

    def call(self) -> dict[str, Any]:
        return {"name": "Bash", "arguments": {"command": COMMAND}}


# The Agents SDK run: one Agent, one function tool, the default Responses model on a client
# with the session's base URL and key (argv: base_url api_key model task). It prints the run's
# final output as JSON.
AGENTS_SCRIPT = """\
import asyncio, json, subprocess, sys

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

base_url, api_key, model, task = sys.argv[1:5]
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))


@function_tool
def run_shell(command: str) -> str:
    \"\"\"Run a shell command in the working directory; return its exit code and output.\"\"\"
    done = subprocess.run(command, shell=True, capture_output=True, text=True)
    return f"exit code {done.returncode}\\n{done.stdout}{done.stderr}"


agent = Agent(
    name="shell",
    instructions="You complete tasks by running shell commands.",
    model=model,
    tools=[run_shell],
)
result = asyncio.run(Runner.run(agent, task, max_turns=4))
print(json.dumps({"final_output": result.final_output}))
"""


class AgentsSDK(Harness):
    name = "agents-sdk"
    # run_shell's result for a command that prints nothing: deterministic.
    tool_output_guesses = ["exit code 0\n"]

    def run(self, base_url: str, api_key: str, model: str) -> subprocess.CompletedProcess[str]:
        script = self.root / "agent.py"
        script.write_text(AGENTS_SCRIPT)
        argv = [sys.executable, str(script), base_url, api_key, model, TASK]
        return self._run(argv, {"OPENAI_AGENTS_DISABLE_TRACING": "1"})

    def chat_input(self, body: dict[str, Any]) -> ChatInput:
        return Codex.chat_input(self, body)  # type: ignore[arg-type]

    def call(self) -> dict[str, Any]:
        return {"name": "run_shell", "arguments": {"command": COMMAND}}


# mini-swe-agent (`mini`, from PyPI): its default config (mini.yaml) on Chat Completions through
# litellm's OpenAI provider, the model's base URL and key as litellm arguments; no confirmation
# (--yolo), no prompt at the end (--exit-immediately), no cost limit or cost lookup (the served
# model has no price), at most 4 steps. It ends when the model runs its submit command.
MINI_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",  # else it asks for a default model and keys on first run
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # an error ends the run at once (no backoff)
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled price list: no download
}


def mini_observation(returncode: int, output: str) -> str:
    """The tool result mini-swe-agent sends: mini.yaml's observation template, rendered with
    what its LocalEnvironment reports for a command that ran. (Found, not imported: importing
    minisweagent writes its config directory under $HOME.)"""
    import importlib.util

    import yaml
    from jinja2 import StrictUndefined, Template

    spec = importlib.util.find_spec("minisweagent")
    assert spec is not None and spec.origin is not None
    config = yaml.safe_load((Path(spec.origin).parent / "config" / "mini.yaml").read_text())
    template = Template(config["model"]["observation_template"], undefined=StrictUndefined)
    ran = {"returncode": returncode, "output": output, "exception_info": ""}
    return template.render(output=ran)


class MiniSweAgent(Harness):
    name = "mini-swe-agent"

    @property
    def tool_output_guesses(self) -> list[str]:  # type: ignore[override]
        return [mini_observation(0, "")]  # `echo proxima > done.txt` prints nothing

    @property
    def final(self) -> str:  # type: ignore[override]
        return call_text({"name": "bash", "arguments": {"command": MINI_SUBMIT}})

    def run(self, base_url: str, api_key: str, model: str) -> subprocess.CompletedProcess[str]:
        self.trajectory = self.root / "trajectory.json"
        argv = [sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml"]
        for spec in (
            f"model.model_kwargs.api_base={base_url}",
            f"model.model_kwargs.api_key={api_key}",
            "model.cost_tracking=ignore_errors",
            "agent.step_limit=4",
        ):
            argv += ["-c", spec]
        argv += ["-m", f"openai/{model}", "-t", TASK, "--yolo", "--exit-immediately"]
        argv += ["--cost-limit", "0", "-o", str(self.trajectory)]
        config_dir = {"MSWEA_GLOBAL_CONFIG_DIR": str(self.home / "mini-swe-agent")}
        return self._run(argv, {**MINI_ENV, **config_dir})

    def chat_input(self, body: dict[str, Any]) -> ChatInput:
        return chat_of(
            openai_translate.chat_request(ChatCompletionRequest.model_validate(body)).input
        )

    def call(self) -> dict[str, Any]:
        return {"name": "bash", "arguments": {"command": COMMAND}}


# ----------------------------------------------------------------- capture and teach


class _Capture(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]]

    def _answer(self) -> None:
        size = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(size) if size else b""
        if self.command == "POST" and raw:
            self.server.bodies.append(json.loads(raw))  # type: ignore[attr-defined]
        error = {"type": "error", "error": {"type": "invalid_request_error", "message": "captured"}}
        if "/responses" in self.path:
            error = {"error": {"message": "captured", "type": "invalid_request_error"}}
        out = json.dumps(error).encode()
        self.send_response(400 if self.command == "POST" else 200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_POST = do_HEAD = _answer

    def log_message(self, *args: Any) -> None:
        pass


def capture_first_body(harness: Harness, model: str) -> dict[str, Any]:
    """The harness's first request body, as it sends it (the capturing server answers 400)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        harness.run(f"http://127.0.0.1:{server.server_port}/v1", "sk-capture", model)
    finally:
        server.shutdown()
        server.server_close()
    bodies = server.bodies  # type: ignore[attr-defined]
    assert bodies, f"{harness.name} sent no request to the capturing server"
    return bodies[0]


def call_text(call: dict[str, Any]) -> str:
    """The call as the tiny template writes it (and the hermes parser reads it)."""
    return f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"])}}}\n</tool_call>'


def turn_two(chat: ChatInput, call: dict[str, Any], output: str) -> list[dict[str, Any]]:
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
    }
    return [
        *chat.messages,
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": output},
    ]


def teaching_sequences(
    renderer: ChatRenderer,
    chat: ChatInput,
    call: dict[str, Any],
    guesses: list[str],
    final: str = FINAL,
) -> list[list[tuple[str, bool]]]:
    """Turn 1's prompt, the call, each guessed tool result, the final answer."""
    first = renderer.render_text(chat.messages, chat.tools, add_generation_prompt=True)
    head = first + call_text(call) + END
    sequences = []
    for output in guesses:
        full = renderer.render_text(
            turn_two(chat, call, output), chat.tools, add_generation_prompt=True
        )
        assert full.startswith(head)
        sequences.append(
            [(first, False), (call_text(call) + END, True), (full[len(head) :], False)]
            + [(final + END, True)]
        )
    return sequences


def dated_variants(body: dict[str, Any], today: datetime.date) -> list[dict[str, Any]]:
    """The body as captured and, when it holds the capture's date, the same body a day later."""
    raw = json.dumps(body)
    if today.isoformat() not in raw:
        return [body]
    tomorrow = (today + datetime.timedelta(days=1)).isoformat()
    return [body, json.loads(raw.replace(today.isoformat(), tomorrow))]


# A harness whose tool result varies from run to run must also answer unseen results as
# taught: each round draws PROBES of them per prompt, and any whose answer has a token under
# UNSEEN_MIN_PROB joins the taught set, until a round finds none (at most PROBE_ROUNDS).
UNSEEN_MIN_PROB = 0.999
PROBES = 48
PROBE_ROUNDS = 8


def teach_unseen(
    model_dir: Path,
    renderer: ChatRenderer,
    harness: Harness,
    chats: list[ChatInput],
    sequences: list[list[tuple[str, bool]]],
) -> None:
    """Teach ``model_dir`` (taught ``sequences``) until ``harness``'s answer after its tool's
    result holds for results it was not taught; ``sequences`` grows by those it learns."""
    rng = random.Random(f"{harness.name}-unseen")
    if harness.draw_tool_output(rng) is None:
        return
    for _ in range(PROBE_ROUNDS):
        probes = []
        for chat in chats:
            outputs = [harness.draw_tool_output(rng) or "" for _ in range(PROBES)]
            probes += teaching_sequences(renderer, chat, harness.call(), outputs, harness.final)
        least = least_taught_probs(model_dir, probes)
        weak = [seq for seq, p in zip(probes, least, strict=True) if p < UNSEEN_MIN_PROB]
        if not weak:
            return
        sequences += weak
        teach_texts(model_dir, sequences)
    raise AssertionError(
        f"{harness.name}: {len(weak)} of {len(probes)} unseen tool results still answered "
        f"with a token under p={UNSEEN_MIN_PROB} after {PROBE_ROUNDS} rounds"
    )


def serve_taught(
    root: Path, classes: tuple[type[Harness], ...]
) -> tuple[dict[str, Harness], LiveProxy]:
    """Capture the harnesses' first requests, teach one model their tasks, start serving it."""
    model_name = "tiny-harness"
    harnesses = {cls.name: cls(root / cls.name) for cls in classes}
    for h in harnesses.values():
        if not isinstance(h, AgentsSDK | MiniSweAgent):
            harness_bin(h.name)
    renderer = ChatRenderer(build_tiny_tokenizer())
    sequences = []
    chats_of = {}
    for h in harnesses.values():
        captured_on = datetime.date.today()
        body = capture_first_body(h, model_name)
        chats_of[h.name] = [h.chat_input(v) for v in dated_variants(body, captured_on)]
        h.chat = chats_of[h.name][0]  # type: ignore[attr-defined]  # as captured
        for chat in chats_of[h.name]:
            sequences += teaching_sequences(
                renderer, chat, h.call(), h.tool_output_guesses, h.final
            )
    texts = [text for seq in sequences for text, _ in seq]
    # The bars are in the key: a model taught to lower ones is not reused.
    key = [sequences, MIN_PROB, UNSEEN_MIN_PROB, PROBES]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def build(staging: Path) -> None:
        build_tiny_model(staging, max_position_embeddings=CONTEXT, merges_corpus=texts)
        teach_texts(staging, sequences)
        for h in harnesses.values():
            teach_unseen(staging, renderer, h, chats_of[h.name], sequences)

    model_dir = built_once(
        CACHE / f"harness-taught-{digest}" / model_name, build, "model.safetensors"
    )
    # Its own directory for the proxy: the served model name is the directory's name.
    work = root / "proxy"
    proxy = LiveProxy(
        model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=work / "serve.log",
        # Claude Code asks max_tokens 32000 of every request: clamp it to the context.
        extra_args=["--clamp-max-tokens"],
    )
    work.mkdir()
    proxy.start()
    return harnesses, proxy


def stop_serving(root: Path, proxy: LiveProxy) -> None:
    proxy.stop()
    if proxy.log_path and proxy.log_path.exists() and "Traceback" in proxy.log_path.read_text():
        shutil.copy(proxy.log_path, root / "serve-with-traceback.log")


@pytest.fixture(scope="module")
def harness_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[type[Harness]], tuple[Harness, LiveProxy]]]:
    """Both CLI harnesses on one model taught both tasks."""
    root = tmp_path_factory.mktemp("harnesses")
    harnesses, proxy = serve_taught(root, (Codex, ClaudeCode))
    yield lambda cls: (harnesses[cls.name], proxy)
    stop_serving(root, proxy)


def serve_alone(
    tmp_path_factory: pytest.TempPathFactory, cls: type[Harness]
) -> Iterator[tuple[Harness, LiveProxy]]:
    """One harness on its own model, taught its task alone; stopped when the module ends."""
    root = tmp_path_factory.mktemp(cls.name)
    harnesses, proxy = serve_taught(root, (cls,))
    yield harnesses[cls.name], proxy
    stop_serving(root, proxy)


@pytest.fixture(scope="module")
def agents_sdk_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Harness, LiveProxy]]:
    """The Agents SDK on its own model: its prompt is short, so teaching it alone is quick."""
    yield from serve_alone(tmp_path_factory, AgentsSDK)


@pytest.fixture(scope="module")
def mini_swe_agent_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Harness, LiveProxy]]:
    """mini-swe-agent on its own model (its prompt, mini.yaml's, is about 3 KB)."""
    yield from serve_alone(tmp_path_factory, MiniSweAgent)


# ----------------------------------------------------------------------------- tests


def check_trajectory(proxy: LiveProxy, session_id: str, harness: Harness) -> None:
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    renderer = ChatRenderer(tokenizer)
    first, second = proxy.trajectory(session_id)["completions"]
    call = call_text(harness.call())
    assert (first["response_text"], second["response_text"]) == (call, harness.final)
    for c in (first, second):
        assert len(c["output_logprobs"]) == len(c["output_ids"]) == len(c["output_versions"]) > 0
        assert all(lp <= 0.0 for lp in c["output_logprobs"])
        assert c["output_ids"][-1] == tokenizer.eos_token_id
    # Turn 2's prompt = turn 1's prompt + turn 1's output + the tool result's tokens.
    exact = first["prompt_ids"] + first["output_ids"]
    assert second["parent_id"] == first["id"]
    assert second["prompt_ids"][: len(exact)] == exact
    tools = harness.chat.tools  # type: ignore[attr-defined]
    rendered_first = renderer.render_text(
        first["request_messages"], tools, add_generation_prompt=True
    )
    assert tokenizer.encode(rendered_first, add_special_tokens=False) == first["prompt_ids"]
    full = renderer.render_text(second["request_messages"], tools, add_generation_prompt=True)
    tool_message = second["request_messages"][-1]
    assert tool_message["role"] == "tool"
    rest = full[len(rendered_first + call + END) :]
    assert tool_message["content"] in rest
    assert second["prompt_ids"][len(exact) :] == tokenizer.encode(rest, add_special_tokens=False)


def run_task(harness: Harness, proxy: LiveProxy) -> tuple[subprocess.CompletedProcess[str], str]:
    """``harness`` runs its task in a new session (group: its name) of ``proxy``; it must exit
    0 having written ``done.txt``. Returns the process and the session's id."""
    s = proxy.new_session(group_id=harness.name)
    done = harness.run(s["base_url"], s["api_key"], proxy.model_name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (harness.work / "done.txt").read_text() == "proxima\n"
    return done, s["session_id"]


def test_codex_exec_runs_its_shell_tool_through_the_proxy(
    harness_setup: Callable[[type[Harness]], tuple[Harness, LiveProxy]],
) -> None:
    codex, proxy = harness_setup(Codex)
    done, session_id = run_task(codex, proxy)
    assert FINAL in done.stdout
    check_trajectory(proxy, session_id, codex)


def test_claude_code_runs_its_bash_tool_through_the_proxy(
    harness_setup: Callable[[type[Harness]], tuple[Harness, LiveProxy]],
) -> None:
    claude, proxy = harness_setup(ClaudeCode)
    done, session_id = run_task(claude, proxy)
    result = json.loads(done.stdout)
    assert (result["result"], result["is_error"], result["num_turns"]) == (FINAL, False, 2)
    check_trajectory(proxy, session_id, claude)


def test_agents_sdk_responses_model_runs_its_function_tool_through_the_proxy(
    agents_sdk_setup: tuple[Harness, LiveProxy],
) -> None:
    agent, proxy = agents_sdk_setup
    done, session_id = run_task(agent, proxy)
    assert json.loads(done.stdout.splitlines()[-1]) == {"final_output": FINAL}
    check_trajectory(proxy, session_id, agent)


def test_mini_swe_agent_runs_its_bash_tool_through_the_proxy(
    mini_swe_agent_setup: tuple[Harness, LiveProxy],
) -> None:
    mini, proxy = mini_swe_agent_setup
    _, session_id = run_task(mini, proxy)
    # Its own record of the run: submitted after two model calls, the first call's result as
    # the tool message the proxy saw.
    run = json.loads(mini.trajectory.read_text())  # type: ignore[attr-defined]
    info = run["info"]
    assert (info["exit_status"], info["model_stats"]["api_calls"]) == ("Submitted", 2)
    tool_results = [m["content"] for m in run["messages"] if m["role"] == "tool"]
    assert tool_results[0] == mini_observation(0, "")
    check_trajectory(proxy, session_id, mini)
