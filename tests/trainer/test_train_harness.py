"""A harness in the training loop: ``proxima train`` runs mini-swe-agent and trains a PPO step.

The agent is ``agents_examples/harness_agent.py``: each rollout runs the real ``mini`` CLI
(mini-swe-agent 2.4.6) as a subprocess in a scratch directory on a shell task ("create
done.txt holding the word proxima"), and its verifier scores what the harness left there.
The policy is the tiny model taught mini-swe-agent's task from its own first request (the
teaching of ``tests/proxy/api/test_harnesses_live.py``, whose cached model this test shares):
it calls its ``bash`` tool with ``echo proxima > done.txt``, reads the tool's result, and
submits. The run trains one step; then the store shows what the trainer trained on:

- every trained session is one harness run that did the task (reward 1.0): two turns, the
  first prompt mini-swe-agent's long one (its system and instance templates, its tool);
- the turns are one chain, token-exact: turn 2's prompt is turn 1's prompt + its output +
  the tool result's tokens;
- the trainer's sequence of a session (``trainer.samples.build_samples``, what the step
  trains) has loss only on generated tokens: the prompt and the tool result are context.

Every run earns the same reward, so no group carries signal: ``zero_signal = "keep"`` steps
anyway (the update is the PPO step on these tokens with zero advantages).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from proxima.agents_examples.harness_agent import run_agent_return_reward
from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.proxy.store import Store
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.proxy.testing.cache import built_once
from proxima.proxy.testing.teach import MIN_PROB, teach_texts
from proxima.proxy.testing.tiny_model import build_tiny_model, build_tiny_tokenizer
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.samples import build_samples
from transformers import AutoTokenizer

from tests.proxy.api.test_harnesses_live import (
    CACHE,
    COMMAND,
    CONTEXT,
    MINI_SUBMIT,
    MiniSweAgent,
    _Capture,
    call_text,
    mini_observation,
    teaching_sequences,
)

pytestmark = pytest.mark.timeout(900)

MODEL_NAME = "tiny-harness"
TASK = {"kind": "create", "file": "done.txt", "content": "proxima"}


def first_request(tmp: Path) -> dict[str, Any]:
    """mini-swe-agent's first body, as the harness agent runs it (a capturing server on
    loopback answers 400, so the run scores 0)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    data = {
        "base_url": f"http://127.0.0.1:{server.server_port}/v1",
        "api_key": "sk-capture",
        "model": MODEL_NAME,
        "task": TASK,
        "keep_dir": str(tmp / "capture"),
    }
    try:
        assert asyncio.run(run_agent_return_reward(data)) == 0.0
    finally:
        server.shutdown()
        server.server_close()
    bodies: list[dict[str, Any]] = server.bodies  # type: ignore[attr-defined]
    assert bodies, "mini-swe-agent sent no request to the capturing server"
    return bodies[0]


def taught_model(tmp: Path) -> Path:
    """The tiny model taught the task from mini-swe-agent's own first request (cached)."""
    mini = MiniSweAgent(tmp / "mini")
    chat = mini.chat_input(first_request(tmp))
    sequences = teaching_sequences(
        ChatRenderer(build_tiny_tokenizer()),
        chat,
        mini.call(),
        [mini_observation(0, "")],
        call_text({"name": "bash", "arguments": {"command": MINI_SUBMIT}}),
    )
    texts = [text for seq in sequences for text, _ in seq]
    digest = hashlib.sha256(json.dumps([sequences, MIN_PROB]).encode()).hexdigest()[:16]

    def build(staging: Path) -> None:
        build_tiny_model(staging, max_position_embeddings=CONTEXT, merges_corpus=texts)
        teach_texts(staging, sequences)

    return built_once(CACHE / f"harness-taught-{digest}" / MODEL_NAME, build, "model.safetensors")


def run_config(model_dir: Path, tmp: Path) -> tuple[Path, Path]:
    out = tmp / "run"
    train = tmp / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "task": TASK}) + "\n" for i in range(4)))
    config = tmp / "run.toml"
    config.write_text(f"""
steps = 1
output_dir = "{out}"

[model]
path = "{model_dir}"

[data]
source = "{train}"

[rollout]
agent = "proxima.agents_examples.harness_agent:run_agent_return_reward"
group_size = 2
max_concurrency = 2
timeout_s = 180
item_fields = {{ harness = "mini-swe-agent", step_limit = 4, timeout_s = 150 }}

[trainer]
batch_size = 2
max_staleness = 0

[trainer.advantage]
zero_signal = "keep"
""")
    return config, out


async def trained_sessions(
    db: Path,
) -> list[tuple[SessionRecord, list[CompletionRecord]]]:
    with sqlite3.connect(db) as conn:
        ids = [i for (i,) in conn.execute("select id from sessions where status = 'trained'")]
    store = await Store.open(f"sqlite:///{db}")
    try:
        found = []
        for sid in ids:
            session = await store.get_session(session_id=sid)
            assert session is not None
            found.append((session, await store.list_completions(session_id=sid)))
        return found
    finally:
        await store.close()


def check_chain(session: SessionRecord, turns: list[CompletionRecord], tokenizer: Any) -> None:
    first, second = sorted(turns, key=lambda c: c.created_at)
    assert session.reward == 1.0  # the verifier found done.txt holding the word
    # mini-swe-agent's own long prompt (its templates, its tool): thousands of characters,
    # though few tokens (the tiny tokenizer's merges were learned from these very texts).
    prompt = tokenizer.decode(first.prompt_ids)
    assert len(prompt) > 3000 and "Please solve this issue: Create a file named done.txt" in prompt
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in prompt
    assert first.response_text == call_text({"name": "bash", "arguments": {"command": COMMAND}})
    assert MINI_SUBMIT in second.response_text
    # One chain: turn 2's prompt = turn 1's prompt + its output + the tool result's tokens.
    assert second.parent_id == first.id
    head = first.prompt_ids + first.output_ids
    assert second.prompt_ids[: len(head)] == head
    tool = tokenizer.decode(second.prompt_ids[len(head) :])
    assert '"returncode": 0' in tool
    for c in (first, second):
        assert len(c.output_ids) == len(c.output_logprobs) == len(c.output_versions) > 0
        assert set(c.output_versions) == {0}


def check_loss_mask(sessions: list[tuple[SessionRecord, list[CompletionRecord]]]) -> None:
    """The trainer's sequences: loss on every generated token and nowhere else."""
    samples = build_samples(sessions, AdvantageConfig())
    assert len(samples) == len(sessions)  # one sequence per session: the chain
    by_session = {session.id: turns for session, turns in sessions}
    for sample in samples:
        first, second = sorted(by_session[sample.session_id], key=lambda c: c.created_at)
        assert sample.input_ids == second.prompt_ids + second.output_ids
        generated = set(range(len(first.prompt_ids), len(first.prompt_ids) + len(first.output_ids)))
        generated |= set(range(len(second.prompt_ids), len(sample.input_ids)))
        assert {i for i, m in enumerate(sample.loss_mask) if m} == generated
        assert sample.completion_ids == (first.id, second.id)


def test_proxima_train_trains_a_step_on_mini_swe_agent_runs(tmp_path: Path) -> None:
    model_dir = taught_model(tmp_path)
    config, out = run_config(model_dir, tmp_path)
    argv = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level", "warning"]
    argv += ["train", "--config", str(config), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    log = [json.loads(line) for line in (out / "trainer" / "train_log.jsonl").open()]
    steps = [r for r in log if r["event"] == "step"]
    assert [s["version"] for s in steps] == [1]
    sessions = asyncio.run(trained_sessions(out / "store.db"))
    assert len(sessions) == 2  # the step's batch: one group of two harness runs
    # The step's loss tokens are exactly the tokens these runs generated.
    generated = sum(len(c.output_ids) for _, turns in sessions for c in turns)
    assert steps[0]["loss_tokens"] == generated
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for session, turns in sessions:
        check_chain(session, turns, tokenizer)
    check_loss_mask(sessions)
