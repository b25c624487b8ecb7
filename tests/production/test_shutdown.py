"""SIGTERM drains: in-flight responses finish and are recorded before the proxy exits."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy

from tests.production.procs import BackendProcess


def test_sigterm_drains_in_flight_streams(
    tiny_model_dir: Path, tmp_path: Path, fake_backend: BackendProcess
) -> None:
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        extra_args=["--backend", fake_backend.url],
        log_path=tmp_path / "serve.log",
    )
    proxy.start()
    try:
        sessions = [proxy.new_session() for _ in range(3)]
        results: dict[int, tuple[str, str | None]] = {}
        started = threading.Barrier(len(sessions) + 1)

        def client(i: int) -> None:
            s = sessions[i]
            stream = OpenAI(
                base_url=s["base_url"], api_key=s["api_key"], max_retries=0
            ).chat.completions.create(
                model=proxy.model_name,
                messages=[{"role": "user", "content": "go"}],
                max_tokens=600,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish, ids = None, ""
            for n, chunk in enumerate(stream):
                if n == 2:
                    started.wait()
                ids = chunk.id
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
            results[i] = (ids, finish)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(sessions))]
        for t in threads:
            t.start()
        started.wait()  # every stream is mid-generation (600 tokens at 400 tokens/s)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        # uvicorn re-raises the captured SIGTERM once its graceful shutdown is done.
        assert proxy.proc.wait(60) in (0, -signal.SIGTERM)
        # Every stream ran to its end, and each completion was committed before it ended.
        assert sorted(f for _, f in results.values()) == ["length"] * 3
        proxy.start()  # same database, same port
        for i, s in enumerate(sessions):
            (c,) = proxy.trajectory(s["session_id"])["completions"]
            assert c["id"] == results[i][0] and len(c["output_ids"]) == 600
    finally:
        proxy.stop()
