"""Weights by broadcast, end to end on CPU: trainer, proxy and two engine processes over gloo.

Two embedded engines (``BackendProcess``: separate processes the tests can SIGKILL and
restart) serve one proxy; the test process is the trainer (``BroadcastWeightSink``, rank 0
of each weight-update group). Each test pushes the version after the proxy's current one,
weights of a tiny model built with that version as its seed, so the tests run in any order.

- a push by broadcast lands mid-generation: the completion's tokens carry both versions,
  and each token's logprob is the HF model's of the version it carries;
- a group that cannot form (the trainer's address unreachable) fails within the timeout
  with a clear error, and the version is pushed from disk instead;
- a backend that dies mid-broadcast: the version still lands (from disk, on the other
  one); restarted, the backend loads the current version from disk before it serves, and
  the next push by broadcast opens a new group with both;
- a trainer that dies mid-broadcast: no backend serves half-updated weights, both report
  the old version, and a restarted trainer's push of that version lands;
- a training run (the trainer loop, ``transport = "broadcast"``) pushes from memory with
  no export before the push, exports after it, and a restarted backend and a restarted
  trainer come back at the version it pushed.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from proxima.proxy.embedded.weight_groups import TIMEOUT_ENV
from proxima.proxy.store import Store
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model
from proxima.trainer.config import TrainerConfig
from proxima.trainer.loop import Trainer
from proxima.trainer.run import weight_sink
from proxima.trainer.weight_broadcast import BroadcastWeightSink
from proxima.trainer.weights import ProxyWeightSink, PushResult, WeightPushError, weights_dir
from proxima.trainer.weights_config import WeightsConfig
from transformers import AutoModelForCausalLM

from tests.production.procs import BackendProcess, wait_until
from tests.trainer.test_trainer_live import run_sessions

GROUP_TIMEOUT_S = 3.0
BUCKET_MB = 0.1  # the tiny model (about 0.4 MiB) goes in several buckets


@dataclass
class Fleet:
    proxy: LiveProxy
    engines: list[BackendProcess]
    work: Path
    models: dict[int, Path] = field(default_factory=dict)

    def health(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(self.proxy.url + "/health", timeout=10).json()
        return answer

    def next_version(self) -> tuple[int, Path]:
        version = int(self.health()["version"]) + 1
        self.models[version] = build_tiny_model(self.work / f"v{version}", seed=version)
        return version, self.models[version]

    def reported(self, engines: list[BackendProcess] | None = None) -> list[str | None]:
        return [
            httpx.get(e.url + "/model_info", timeout=10).json()["weight_version"]
            for e in (self.engines if engines is None else engines)
        ]

    def sink(
        self, after_bucket: Callable[[int], None] | None = None, **settings: Any
    ) -> BroadcastWeightSink:
        config = WeightsConfig.model_validate(
            {
                "transport": "broadcast",
                "timeout_s": GROUP_TIMEOUT_S,
                "bucket_mb": BUCKET_MB,
                "master_address": "127.0.0.1",
                **settings,
            }
        )
        return BroadcastWeightSink(
            self.proxy.url,
            admin_token=self.proxy.admin_token,
            settings=config,
            timeout_s=60,
            after_bucket=after_bucket,
        )


def _push(sink: BroadcastWeightSink, version: int, path: Path) -> PushResult:
    async def run() -> PushResult:
        try:
            return await sink.push(version=version, path=path)
        finally:
            await sink.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("broadcast")
    engines = [BackendProcess.engine(tiny_model_dir, log_path=work / f"e{i}.log") for i in (0, 1)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TIMEOUT_ENV, str(GROUP_TIMEOUT_S))
        starting = [threading.Thread(target=e.start) for e in engines]  # load side by side
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join()
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=work / "serve.log",
        extra_args=[arg for e in engines for arg in ("--backend", e.url)],
        env={"PROXIMA_HEALTH_CHECK_INTERVAL": "0.5"},
    )
    try:
        proxy.start()
        yield Fleet(proxy, engines, work, {0: tiny_model_dir})
    finally:
        proxy.stop()
        for engine in engines:
            engine.stop()


def _hf_logprobs(model_dir: Path, ids: list[int], start: int) -> list[float]:
    """log-softmax (T = 1) of each token from ``start`` on, given the tokens before it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [float(logits[i - 1, ids[i]]) for i in range(start, len(ids))]


def _all_healthy(fleet: Fleet, version: int) -> Callable[[], bool]:
    def check() -> bool:
        health = fleet.health()
        return not health["updating"] and all(
            b["healthy"] and b["version"] == version for b in health["backends"]
        )

    return check


def test_broadcast_push_mid_generation_logprobs_are_the_new_models(fleet: Fleet) -> None:
    before = int(fleet.health()["version"])
    version, path = fleet.next_version()
    session = fleet.proxy.new_session()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    stream = client.chat.completions.create(
        model=fleet.proxy.model_name,
        messages=[{"role": "user", "content": "Tell a long story."}],
        stream=True,
        max_tokens=400,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    pushed: dict[str, PushResult] = {}
    pusher = threading.Thread(
        target=lambda: pushed.update(
            result=_push(fleet.sink(fallback_to_disk=False), version, path)
        )
    )
    for n, _ in enumerate(stream, 1):
        if n == 3:
            pusher.start()  # lands while this completion is being generated
    pusher.join()
    assert pushed["result"].transport == "broadcast"
    assert fleet.reported() == [str(version), str(version)]
    # A retried push whose first answer was lost: the proxy serves it already, success.
    again = _push(fleet.sink(fallback_to_disk=False), version, path)
    assert (again.transport, again.proxy_seconds) == ("broadcast", 0.0)
    with pytest.raises(WeightPushError, match=f"refused version {before}"):
        _push(fleet.sink(fallback_to_disk=False), before, fleet.models[before])

    (completion,) = fleet.proxy.trajectory(session["session_id"])["completions"]
    versions = completion["output_versions"]
    assert versions[0] == before and versions[-1] == version, "the push landed mid-completion"
    assert versions == sorted(versions)
    ids = completion["prompt_ids"] + completion["output_ids"]
    start = len(completion["prompt_ids"])
    for v in (before, version):
        expected = _hf_logprobs(fleet.models[v], ids, start)
        for i, (got, want, tag) in enumerate(
            zip(completion["output_logprobs"], expected, versions, strict=True)
        ):
            if tag == v:
                assert got == pytest.approx(want, abs=2e-4), (v, i)


def test_a_group_that_cannot_form_fails_in_time_and_falls_back_to_disk(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    version, path = fleet.next_version()
    unreachable = {"master_address": "192.0.2.1"}  # TEST-NET-1: nothing answers there
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="proxima.trainer.weight_broadcast"):
        result = _push(fleet.sink(**unreachable), version, path)
    assert time.monotonic() - started < 4 * GROUP_TIMEOUT_S + 10
    assert result.transport == "disk"
    (warning,) = [r.getMessage() for r in caplog.records if "pushing from disk" in r.getMessage()]
    assert "could not form" in warning and "weight_group_failed" in warning
    assert fleet.reported() == [str(version), str(version)]


def test_a_backend_dies_mid_broadcast_and_rejoins_after_restart(fleet: Fleet) -> None:
    version, path = fleet.next_version()
    victim = fleet.engines[1]

    def kill_after_first(index: int) -> None:
        if index == 0:
            victim.kill()

    result = _push(fleet.sink(after_bucket=kill_after_first), version, path)
    assert result.transport == "disk"  # the broadcast failed; the version landed from disk
    health = fleet.health()
    assert health["version"] == version
    assert [b["healthy"] for b in health["backends"]] == [True, False]
    assert fleet.reported(fleet.engines[:1]) == [str(version)]

    victim.start()  # it comes back at version 0 and loads the current version from disk
    wait_until(_all_healthy(fleet, version), 60, what="the restarted backend back at v")
    assert fleet.reported() == [str(version), str(version)]

    version, path = fleet.next_version()  # the old group is gone: a new one, both in it
    assert _push(fleet.sink(fallback_to_disk=False), version, path).transport == "broadcast"
    assert fleet.reported() == [str(version), str(version)]


TRAINER = """
import asyncio, os, sys
from pathlib import Path
from proxima.trainer.weight_broadcast import BroadcastWeightSink
from proxima.trainer.weights_config import WeightsConfig

url, token, version, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
settings = WeightsConfig(transport="broadcast", fallback_to_disk=False, timeout_s={timeout},
                         bucket_mb={bucket}, master_address="127.0.0.1")
def die(index: int) -> None:
    if index == 0:
        os._exit(3)  # the trainer dies mid-broadcast, after the first bucket
sink = BroadcastWeightSink(url, admin_token=token, settings=settings, after_bucket=die)
asyncio.run(sink.push(version=version, path=path))
"""


def test_a_trainer_that_dies_mid_broadcast_leaves_the_old_weights(fleet: Fleet) -> None:
    wait_until(_all_healthy(fleet, int(fleet.health()["version"])), 60, what="a whole fleet")
    old = int(fleet.health()["version"])
    version, path = fleet.next_version()
    script = TRAINER.format(timeout=GROUP_TIMEOUT_S, bucket=BUCKET_MB)
    trainer = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            fleet.proxy.url,
            fleet.proxy.admin_token,
            str(version),
            str(path),
        ],
        timeout=120,
    )
    assert trainer.returncode == 3
    wait_until(_all_healthy(fleet, old), 30, what="both backends serving the old version")
    assert fleet.reported() == [str(old), str(old)]
    # What they serve is the old model's, token for token.
    prompt = [5, 17, 42, 99, 7]
    for engine in fleet.engines:
        reply = httpx.post(
            engine.url + "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                "return_logprob": True,
            },
            timeout=30,
        ).json()
        got = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
        expected = _hf_logprobs(fleet.models[old], prompt + reply["output_ids"], len(prompt))
        assert got == pytest.approx(expected, abs=2e-4)
    # The restarted trainer pushes the same version again: it lands.
    assert _push(fleet.sink(fallback_to_disk=False), version, path).transport == "broadcast"
    assert fleet.reported() == [str(version), str(version)]


def _engine_logprobs_match(fleet: Fleet, model_dir: Path) -> None:
    """Each engine's greedy tokens' logprobs are the HF model's at ``model_dir``."""
    prompt = [5, 17, 42, 99, 7]
    for engine in fleet.engines:
        reply = httpx.post(
            engine.url + "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                "return_logprob": True,
            },
            timeout=30,
        ).json()
        got = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
        expected = _hf_logprobs(model_dir, prompt + reply["output_ids"], len(prompt))
        assert got == pytest.approx(expected, abs=2e-4)


def test_a_push_from_memory_writes_nothing_and_the_engines_reuse_their_buffers(
    fleet: Fleet,
) -> None:
    """Pushes from the trainer's memory (``source``): no file is written or read (the path
    the version records does not exist), the engines serve exactly the model pushed, and
    from the third push on they receive into the buffers the push before last swapped in:
    no receive buffer allocated, none copied."""
    wait_until(_all_healthy(fleet, int(fleet.health()["version"])), 60, what="a whole fleet")
    unwritten = fleet.work / "unwritten"
    for push in range(3):
        version, model_dir = fleet.next_version()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = WeightsConfig(
            transport="broadcast",
            fallback_to_disk=False,
            timeout_s=GROUP_TIMEOUT_S,
            bucket_mb=BUCKET_MB,
            master_address="127.0.0.1",
        )
        sink = BroadcastWeightSink(
            fleet.proxy.url,
            admin_token=fleet.proxy.admin_token,
            settings=config,
            timeout_s=60,
            source=lambda model=model: model.state_dict().items(),
            dtype=torch.float32,  # what the embedded engines serve
        )
        result = _push(sink, version, unwritten / f"v{version}")
        assert result.transport == "broadcast" and result.breakdown is not None
        assert result.breakdown["buckets"] >= 2 and result.breakdown["wire_s"] > 0
        assert not unwritten.exists()
        assert fleet.reported() == [str(version), str(version)]
        _engine_logprobs_match(fleet, model_dir)
        if push == 2:
            for engine in fleet.engines:
                info = httpx.get(engine.url + "/server_info", timeout=10).json()
                update = info["last_weight_update"]
                assert update["weight_version"] == str(version)
                assert update["buffers_allocated"] == 0
                assert update["buffers_reused"] == result.breakdown["buckets"]


def test_a_training_run_pushes_from_memory_and_exports_after(fleet: Fleet, tmp_path: Path) -> None:
    """The trainer loop with ``transport = "broadcast"``: each step's version goes to both
    engines from the trainer's memory while its export does not exist yet (checked at every
    bucket sent), the export is written after it and holds what the engines serve; a backend
    restarted afterwards comes back at the current version from that export, and a
    restarted trainer resumes at it."""
    wait_until(_all_healthy(fleet, int(fleet.health()["version"])), 60, what="a whole fleet")
    start, start_dir = fleet.next_version()  # the trainer starts from a version on disk
    asyncio.run(_disk_push(fleet, start, start_dir))
    run_sessions(fleet.proxy, 8)
    out = tmp_path / "trainer"
    cfg = TrainerConfig.model_validate(
        {
            "batch_size": 4,
            "output_dir": str(out),
            "optim": {"lr": 1e-2},
            "loop": {"poll_interval_s": 0.1, "trainer_id": "broadcast-trainer"},
            "weights": {
                "transport": "broadcast",
                "fallback_to_disk": False,
                "timeout_s": GROUP_TIMEOUT_S,
                "bucket_mb": BUCKET_MB,
                "master_address": "127.0.0.1",
            },
            "connection": {
                "proxy_url": fleet.proxy.url,
                "db_url": fleet.proxy.db_url,
                "model_dir": str(start_dir),
                "admin_token": fleet.proxy.admin_token,
            },
        }
    )
    seen: list[tuple[int, bool]] = []  # (bucket, was the version's export on disk?)

    async def train() -> list[Any]:
        store = await Store.open(fleet.proxy.db_url)
        sink = weight_sink(cfg, fleet.proxy.url, fleet.proxy.admin_token)
        assert isinstance(sink, BroadcastWeightSink)
        trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
        sink.after_bucket = lambda i: seen.append(
            (i, weights_dir(out, trainer.state.version + 1).exists())
        )
        try:
            return [await trainer.step(), await trainer.step()]
        finally:
            await trainer.close()
            await sink.aclose()
            await store.close()

    records = asyncio.run(train())
    assert [(r.version, r.pushed) for r in records] == [(start + 1, True), (start + 2, True)]
    assert seen and not any(exported for _, exported in seen)  # no export before a push
    assert len(seen) >= 4  # both pushes went in several buckets
    version = start + 2
    assert fleet.reported() == [str(version), str(version)]
    assert (weights_dir(out, version) / "config.json").is_file()
    _engine_logprobs_match(fleet, weights_dir(out, version))

    victim = fleet.engines[0]
    victim.kill()
    victim.start()  # back at its start-up weights: it loads the current version's export
    wait_until(_all_healthy(fleet, version), 60, what="the restarted backend back at v")
    _engine_logprobs_match(fleet, weights_dir(out, version))

    async def restart() -> int:
        store = await Store.open(fleet.proxy.db_url)
        trainer = await Trainer.start(
            cfg, store=store, sink=ProxyWeightSink(fleet.proxy.url, admin_token=None), console=False
        )
        resumed = trainer.state.version
        await trainer.close()
        await store.close()
        return resumed

    assert asyncio.run(restart()) == version


async def _disk_push(fleet: Fleet, version: int, path: Path) -> None:
    sink = ProxyWeightSink(fleet.proxy.url, admin_token=fleet.proxy.admin_token)
    try:
        await sink.push(version=version, path=path)
    finally:
        await sink.aclose()
