"""Proxy crash under load: ``kill -9``, restart on the same store and port.

Sixteen OpenAI-SDK clients hold multi-turn conversations (streamed and not)
in training sessions while the proxy is SIGKILLed. Every completion a client
received in full before the kill must be in the store after the restart
(a response never ends before its completion is committed), and every
session that was open goes on with its own key: the next turn extends the
last acknowledged completion token for token.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy

from tests.production.procs import BackendProcess, wait_until

CLIENTS = 16
TURNS_PER_SESSION = 6
MAX_TOKENS = 24


@dataclass
class OpenSession:
    session_id: str
    api_key: str
    base_url: str
    messages: list[dict[str, Any]]  # the conversation up to and including the last reply
    last_completion_id: str


@dataclass
class Client:
    index: int
    proxy: LiveProxy
    acked: list[tuple[str, str]] = field(default_factory=list)  # (session_id, completion id)
    open_session: OpenSession | None = None
    error: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        """Converse until the proxy goes away (or ``stop``); sessions of a few turns each."""
        try:
            while not stop.is_set():
                s = self.proxy.new_session(group_id=f"client-{self.index}")
                client = OpenAI(
                    base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=60
                )
                messages: list[dict[str, Any]] = []
                for turn in range(TURNS_PER_SESSION):
                    messages.append(
                        {"role": "user", "content": f"client {self.index} turn {turn}: go on"}
                    )
                    cid, reply = self._turn(client, messages, stream=turn % 2 == 1)
                    # Acknowledged: the client holds the whole response.
                    messages.append({"role": "assistant", "content": reply})
                    self.acked.append((s["session_id"], cid))
                    self.open_session = OpenSession(
                        s["session_id"], s["api_key"], s["base_url"], list(messages), cid
                    )
                # Not open any more as far as the check goes: a kill after the finish
                # commits but before its answer arrives leaves the session finished.
                self.open_session = None
                httpx.post(
                    f"{self.proxy.url}/rl/sessions/{s['session_id']}/finish",
                    timeout=30,
                    headers={"Authorization": f"Bearer {s['api_key']}"},
                ).raise_for_status()
        except Exception as exc:  # the proxy was killed under us: expected, kept for the report
            self.error = exc

    def _turn(
        self, client: OpenAI, messages: list[dict[str, Any]], *, stream: bool
    ) -> tuple[str, str]:
        model = self.proxy.model_name
        if not stream:
            r = client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS
            )
            return r.id, r.choices[0].message.content or ""
        text, cid, finished = "", "", False
        for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True
        ):
            cid = chunk.id
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finished = finished or chunk.choices[0].finish_reason is not None
        assert finished, "stream ended without a finish_reason"
        return cid, text


@pytest.fixture
def proxy(
    tiny_model_dir: Path, tmp_path: Path, fake_backend: BackendProcess
) -> Iterator[LiveProxy]:
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--backend", fake_backend.url],
    )
    live.start()
    yield live
    live.stop()


def _in_flight(proxy: LiveProxy) -> int:
    return sum(
        b["in_flight"] for b in httpx.get(proxy.url + "/health", timeout=10).json()["backends"]
    )


def test_kill_9_under_load_loses_no_acknowledged_completion(proxy: LiveProxy) -> None:
    clients = [Client(i, proxy) for i in range(CLIENTS)]
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    acked = lambda: sum(len(c.acked) for c in clients)  # noqa: E731
    wait_until(lambda: acked() >= 120, timeout=120, what="120 acknowledged completions")
    wait_until(lambda: _in_flight(proxy) >= 4, timeout=30, what="requests in flight")
    proxy.stop(kill=True)
    assert proxy.proc is not None and proxy.proc.returncode == -9
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    # Every client was cut off by the kill, none by a bug of its own.
    for c in clients:
        assert c.error is not None and not isinstance(c.error, AssertionError), (c.index, c.error)

    proxy.start()

    acknowledged = [pair for c in clients for pair in c.acked]
    by_session: dict[str, set[str]] = {}
    for session_id, cid in acknowledged:
        by_session.setdefault(session_id, set()).add(cid)
    missing = []
    for session_id, cids in by_session.items():
        stored = {c["id"]: c for c in proxy.trajectory(session_id)["completions"]}
        missing += sorted(cids - stored.keys())
        for cid in cids & stored.keys():
            c = stored[cid]
            assert (
                len(c["output_ids"])
                == len(c["output_logprobs"])
                == len(c["output_versions"])
                == MAX_TOKENS
            )
    assert missing == [], f"{len(missing)} of {len(acknowledged)} acknowledged completions lost"

    # Open sessions go on after the restart, token-exactly, with their own keys.
    open_sessions = [c.open_session for c in clients if c.open_session is not None]
    # How many clients are mid-session at the kill depends on timing (10 of 16 on a quiet
    # machine, 7 under load); a quarter is always there, and each one is checked below.
    assert len(open_sessions) >= CLIENTS // 4
    for s in open_sessions:
        client = OpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=proxy.model_name,
            max_tokens=MAX_TOKENS,
            messages=[*s.messages, {"role": "user", "content": "after the restart"}],
        )
        stored = {c["id"]: c for c in proxy.trajectory(s.session_id)["completions"]}
        new, parent = stored[r.id], stored[s.last_completion_id]
        assert new["parent_id"] == parent["id"]
        prefix = parent["prompt_ids"] + parent["output_ids"]
        assert new["prompt_ids"][: len(prefix)] == prefix
        assert len(new["prompt_ids"]) > len(prefix)
