"""``proxima serve`` supervises its embedded engine: SIGKILLed, it is reaped and restarted at
the current version with the current adapters, and no request waits for it.

Before the supervisor, a killed engine stayed a zombie child of ``proxima serve``; every
request then waited the pool's 30 s for a healthy backend and got a 503, until the proxy was
restarted, while ``/health`` said 200. Here, with one engine and a version and an adapter
pushed: every request while the engine is down is answered at once (a 503 with
``Retry-After``), the engine comes back serving version 1 with the adapter loaded, and the
killed process is gone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from proxima.proxy.backends.protocol import lora_name
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.lora import linear_shapes, write_peft_adapter
from proxima.proxy.testing.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM

TENANT = "tenant-a"


def _engine_pids(proxy: LiveProxy) -> list[int]:
    """The pids of ``proxy``'s embedded engine processes (its children running the engine)."""
    assert proxy.proc is not None
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == proxy.proc.pid and b"proxima.proxy.embedded" in cmdline:
            pids.append(int(entry.name))
    return pids


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``Z``: a zombie), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _training(proxy: LiveProxy) -> dict[str, Any]:
    state = httpx.get(proxy.url + "/admin/production", headers=proxy.admin_headers(), timeout=30)
    assert state.status_code == 200, state.text
    deployment: dict[str, Any] = state.json()["deployments"]["production"]  # follows training
    return deployment


def _chat(proxy: LiveProxy, session: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        session["base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json={
            "model": proxy.model_name,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        },
        # The old pool waited 30 s for a healthy backend: that is a failure here. 25 s leaves
        # room for a loaded CI machine (a full suite's run once took over 10 s for the first
        # request the restarted engine served, as it loaded its weights and adapter).
        timeout=25,
    )


def test_a_killed_engine_is_restarted_at_the_current_version_and_no_request_waits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapter = write_peft_adapter(
        tmp_path / "adapter", linear_shapes(model, ("q_proj", "v_proj")), rank=4, alpha=8
    )
    del model
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--enable-lora"],
    )
    proxy.start()
    try:
        proxy.push_weights(1, build_tiny_model(tmp_path / "v1", seed=1))
        pushed = httpx.post(
            proxy.url + "/admin/weights",
            json={"version": 1, "path": str(adapter), "adapter": TENANT},
            headers=proxy.admin_headers(),
            timeout=60,
        )
        assert pushed.status_code == 200, pushed.text
        (engine_url,) = [b["url"] for b in _training(proxy)["backends"]]
        (old_pid,) = _engine_pids(proxy)
        os.kill(old_pid, signal.SIGKILL)

        # Requests go on while the engine restarts: each is answered at once, a 503 with
        # Retry-After while it is down, then 200s.
        session = proxy.new_session(adapter=TENANT)
        answers: list[tuple[int, float]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = time.monotonic()
            reply = _chat(proxy, session)
            answers.append((reply.status_code, time.monotonic() - started))
            if reply.status_code == 200:
                break
            assert reply.status_code == 503, reply.text
            assert reply.headers.get("Retry-After") == "2", reply.headers
            time.sleep(0.5)
        assert answers[-1][0] == 200, answers
        assert max(seconds for _, seconds in answers) < 20.0, answers
        assert min(seconds for _, seconds in answers) < 5.0, answers  # the 503s come at once
        assert any(status == 503 for status, _ in answers), "the engine was down a while"

        # Back at the current version, with the adapter; the dead process was reaped.
        training = _training(proxy)
        assert training["engine_restarts"] == 1
        assert [(b["healthy"], b["version"]) for b in training["backends"]] == [(True, 1)]
        assert httpx.get(engine_url + "/model_info", timeout=10).json()["weight_version"] == "1"
        cards = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"]
        assert lora_name(TENANT, 1) in {card["id"] for card in cards}
        (new_pid,) = _engine_pids(proxy)
        assert new_pid != old_pid and _process_state(old_pid) is None
        # The base's sessions are served too (version 1, loaded by the restarted engine).
        assert _chat(proxy, proxy.new_session()).status_code == 200
    finally:
        proxy.stop()
