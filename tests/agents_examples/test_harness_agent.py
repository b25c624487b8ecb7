"""The harness agent's tasks, verifiers and commands, and Codex CLI's prompt as it runs it.

``tests/trainer/test_train_harness.py`` trains on its mini-swe-agent runs; here: each task's
verifier against files written by hand, bad items refused, and a real ``codex exec`` run
(``make harnesses``) against a capturing server: the prompt it sends fits the demo model's
8k context with room to spare (its default prompt does not), and the run scores 0 and cleans
up its scratch directory.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from proxima.agents_examples import harness_agent
from proxima.agents_examples.harness_agent import mini_command, run_agent_return_reward, task_of
from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.proxy.service.canonical import ChatInput
from proxima.proxy.surfaces.responses import translate as responses_translate
from proxima.proxy.surfaces.responses.schema import ResponsesRequest
from proxima.trainer.pipeline.demo_model import prepare_smollm2
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]


def test_create_task_is_done_only_when_the_file_holds_the_word(tmp_path: Path) -> None:
    task = task_of({"kind": "create", "file": "done.txt", "content": "proxima"})
    assert task.instruction == "Create a file named done.txt that contains the word proxima."
    assert not task.verify(tmp_path)
    (tmp_path / "done.txt").write_text("proxima\n")
    assert task.verify(tmp_path)
    (tmp_path / "done.txt").write_text("proxima and more\n")
    assert not task.verify(tmp_path)


def test_count_task_lays_out_its_lines_and_checks_the_number(tmp_path: Path) -> None:
    task = task_of({"kind": "count", "lines": 3})
    assert task.files == {"data.txt": "line 1\nline 2\nline 3\n"}
    (tmp_path / "count.txt").write_text("4\n")
    assert not task.verify(tmp_path)
    (tmp_path / "count.txt").write_text("3\n")
    assert task.verify(tmp_path)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "create", "file": "../x", "content": "a"}, "plain file name"),
        ({"kind": "create", "file": "x", "content": "two\nlines"}, "one word"),
        ({"kind": "count", "lines": -1}, "0 to 10000"),
        ({"kind": "delete"}, "unknown task kind"),
    ],
)
def test_a_bad_task_is_refused_with_its_reason(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        task_of(spec)


def test_mini_command_points_litellm_at_the_session(tmp_path: Path) -> None:
    data = {"base_url": "http://h/v1", "api_key": "sk-1", "model": "m", "temperature": 0.5}
    argv = mini_command(data, "Do it.", tmp_path)
    assert argv[argv.index("-m", 3) + 1] == "openai/m"
    specs = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert specs == [
        "mini.yaml",
        "model.model_kwargs.api_base=http://h/v1",
        "model.model_kwargs.api_key=sk-1",
        "model.cost_tracking=ignore_errors",
        "agent.step_limit=4",
        "model.model_kwargs.temperature=0.5",
    ]


class _Capture(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.bodies.append(json.loads(raw))  # type: ignore[attr-defined]
        out = b'{"error": {"message": "captured", "type": "invalid_request_error"}}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def test_codex_run_sends_a_prompt_that_fits_the_demo_models_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not harness_agent.CODEX_FROM_CHECKOUT.exists():  # a missing harness fails, never skips
        pytest.fail("Codex CLI is missing: `make harnesses` installs it (make test does)")
    demo_model = prepare_smollm2(REPO / ".cache" / "models")  # converted once per checkout
    scratch = tmp_path / "tmp"  # where the run makes (and removes) its scratch directory
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    data = {
        "base_url": f"http://127.0.0.1:{server.server_port}/v1",
        "api_key": "sk-capture",
        "model": demo_model.name,
        "harness": "codex",
        "codex_bin": str(harness_agent.CODEX_FROM_CHECKOUT),
        "task": {"kind": "count", "lines": 5},
        "timeout_s": 120,
    }
    try:
        assert asyncio.run(run_agent_return_reward(data)) == 0.0
    finally:
        server.shutdown()
        server.server_close()
    body = server.bodies[0]  # type: ignore[attr-defined]
    chat = responses_translate.canonical_request(ResponsesRequest.model_validate(body)).input
    assert isinstance(chat, ChatInput) and chat.tools is not None
    assert body["model"] == demo_model.name and "max_output_tokens" not in body
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    renderer = ChatRenderer(tokenizer, tool_fallback="hermes")
    text = renderer.render_text(chat.messages, chat.tools, add_generation_prompt=True)
    assert harness_agent.CODEX_INSTRUCTIONS in text
    assert "Count the lines of data.txt and write the number to count.txt." in text
    assert len(tokenizer.encode(text)) < 2000  # 1.3k measured; its default prompt: 8.9k
    assert list(scratch.iterdir()) == []
