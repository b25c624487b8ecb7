"""``bench/weight_push.py``'s default run: disk and broadcast pushes, interleaved in one run.

For each model: ``proxima serve --engines 2`` on it and the trainer's side here, the model in
float32 (what the embedded engines serve, so the wire is float32 too). The disk and broadcast
arms push to the same proxy, the three arms in turn (the order rotates every round), so whatever else loads the machine loads both alike; two warm-up rounds (an engine
has spare receive buffers from its third broadcast push on), then ``--pushes`` timed rounds. Every push is new weights (one tensor changed, all sent).

- disk: the version exported as the trainer exports it (HF safetensors, fsynced, atomic),
  then ``POST /admin/weights``: each engine reads it, screens it, copies it in;
- gloo alone (the floor, ``bench/_gloo_floor.py``): the broadcast arm's bucket sizes sent
  from this process to two receiver processes over a gloo group of their own, nothing else
  (no copy into buckets, no screen, no swap, no HTTP): no broadcast push can beat it;
- broadcast: ``BroadcastWeightSink`` with the model's tensors as its source, in
  ``--bucket-mb`` buckets: nothing is written or read on disk (the trainer loop exports a
  version pushed this way only after the push: ``trainer/publish.py``); the trainer is rank
  0 of a gloo group with both engines (one broadcast per bucket to both; a bucket of one
  tensor, the embedding, straight from its memory), each engine receives into its spare
  buffers, screens each bucket while the next arrives, and swaps the received tensors in.

A push's time is until ``POST /admin/weights`` answers (every engine serves it), plus the
export for disk. The breakdown printed beside it: the proxy's own time (generation paused);
for broadcast the trainer's fill (copying tensors into the bucket buffers, overlapped with
the wire but for the first bucket), wire (blocked in the broadcast) and the engines'
receive, screen and swap (from their ``/server_info``). Each push is a line of
a ``weight_push-TIME.jsonl`` file in ``bench/results/`` (``--jsonl``), with the commit and load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gloo_floor import GlooFloor, bucket_sizes  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer  # noqa: E402
from proxima.trainer.backends.base import copy_tokenizer_files  # noqa: E402
from proxima.trainer.pipeline.demo_model import prepare_smollm2  # noqa: E402
from proxima.trainer.weight_broadcast import BroadcastWeightSink  # noqa: E402
from proxima.trainer.weights import ProxyWeightSink, export_weights  # noqa: E402
from proxima.trainer.weights_config import WeightsConfig  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

logger = logging.getLogger("bench.weight_push")

ROOT = Path(__file__).resolve().parents[1]
QWEN2_05B = {  # Qwen2.5-0.5B's shapes: 494M parameters, embeddings tied
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
ENGINE_KEYS = ("receive_s", "check_s", "swap_s", "buffers_reused", "buffers_allocated")


def build_qwen2_05b(path: Path) -> Path:
    """A random Qwen2 with Qwen2.5-0.5B's shapes (the tiny byte tokenizer: the push does not
    depend on it), written once to ``path``."""
    if (path / "config.json").is_file():
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(**QWEN2_05B, eos_token_id=eos, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def git_commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


class Arms:
    """Both arms' sinks on one proxy, and one push of either."""

    def __init__(
        self, proxy: LiveProxy, model: PreTrainedModel, model_dir: Path, out: Path, bucket_mb: float
    ) -> None:
        self.proxy, self.model, self.model_dir, self.out = proxy, model, model_dir, out
        self.disk = ProxyWeightSink(proxy.url, admin_token=proxy.admin_token, timeout_s=600)
        settings = WeightsConfig(
            transport="broadcast",
            fallback_to_disk=False,
            master_address="127.0.0.1",
            timeout_s=600,
            bucket_mb=bucket_mb,
        )
        self.broadcast = BroadcastWeightSink(
            proxy.url,
            admin_token=proxy.admin_token,
            settings=settings,
            timeout_s=600,
            source=lambda: model.state_dict().items(),
            dtype=torch.float32,  # what the embedded engines serve
        )
        self.engines = [
            b["url"] for b in httpx.get(proxy.url + "/health", timeout=30).json()["backends"]
        ]
        sizes = bucket_sizes(model.state_dict().items(), bucket_mb, torch.float32)
        self.floor = GlooFloor(sizes, receivers=len(self.engines))

    def _write(self, out: Path) -> None:  # what the torch backend's export_hf writes
        self.model.save_pretrained(out, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out)

    async def push(self, arm: str, version: int) -> dict[str, Any]:
        with torch.no_grad():  # every version is new weights
            next(self.model.parameters()).add_(1e-3)
        load = os.getloadavg()[0]
        started = time.monotonic()
        row: dict[str, Any] = {"arm": arm, "version": version, "load_1min": load}
        if arm == "gloo":
            row.update(export_s=0.0, buckets=len(self.floor.sizes), bytes=sum(self.floor.sizes))
            row["total_s"] = row["push_s"] = self.floor.push()
            return row
        if arm == "disk":
            path = await asyncio.to_thread(export_weights, self.out, version, self._write)
            row["export_s"] = time.monotonic() - started
            result = await self.disk.push(version=version, path=path)
        else:
            path = self.out / "weights" / f"v{version}"  # recorded, never written
            row["export_s"] = 0.0
            result = await self.broadcast.push(version=version, path=path)
            row.update(result.breakdown or {})
            if path.exists():
                raise RuntimeError(f"a broadcast push wrote {path}")
        row["total_s"] = time.monotonic() - started
        row["push_s"] = row["total_s"] - row["export_s"]
        row["proxy_s"] = result.proxy_seconds
        if result.transport != arm:
            raise RuntimeError(f"version {version} went by {result.transport}")
        if arm == "broadcast":
            infos = [httpx.get(u + "/server_info", timeout=30).json() for u in self.engines]
            updates = [i["last_weight_update"] for i in infos]
            if any(u is None or u["weight_version"] != str(version) for u in updates):
                raise RuntimeError(f"an engine did not report version {version}: {updates}")
            row["engines"] = [{k: u[k] for k in ENGINE_KEYS} for u in updates]
        for old in (self.out / "weights").glob("v*"):  # the disk arm's older exports
            if old.name != f"v{version}":
                shutil.rmtree(old, ignore_errors=True)
        return row

    async def close(self) -> None:
        await self.disk.aclose()
        await self.broadcast.aclose()
        self.floor.close()


ARMS = ("disk", "broadcast", "gloo")
WARMUP_ROUNDS = 2  # an engine receives into spare buffers from its third broadcast push on


async def _rounds(arms: Arms, n: int) -> list[dict[str, Any]]:
    """Warm-up rounds, then ``n`` timed ones, the arms' order flipping every round."""
    rows = []
    version = 1
    for round_ in range(n + WARMUP_ROUNDS):
        turn = round_ % len(ARMS)
        for arm in ARMS[turn:] + ARMS[:turn]:
            row = await arms.push(arm, version)
            row.update(round=round_, warmup=round_ < WARMUP_ROUNDS)
            rows.append(row)
            if arm != "gloo":  # the floor arm pushes no version
                version += 1
    return rows


def compare_model(
    name: str, model_dir: Path, work: Path, n: int, bucket_mb: float
) -> list[dict[str, Any]]:
    """Interleaved disk and broadcast pushes of one model to ``proxima serve --engines 2``."""
    proxy = LiveProxy(
        model_dir,
        db_url=f"sqlite:///{work / f'{name}.db'}",
        log_path=work / f"{name}-serve.log",
        extra_args=["--engines", "2"],
        env={"PROXIMA_WEIGHT_GROUP_TIMEOUT_S": "600"},
    )
    proxy.start(timeout=600)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

        async def run() -> list[dict[str, Any]]:
            arms = Arms(proxy, model, model_dir, work / f"{name}-trainer", bucket_mb)
            try:
                return await _rounds(arms, n)
            finally:
                await arms.close()

        rows = asyncio.run(run())
        health = httpx.get(proxy.url + "/health", timeout=30).json()
        served = {b["version"] for b in health["backends"]}
        if served != {rows[-1]["version"]}:
            raise RuntimeError(f"the engines serve {served}, not version {rows[-1]['version']}")
    finally:
        proxy.stop()
    return rows


def _ms(rows: list[dict[str, Any]], key: str) -> float:
    return 1000 * statistics.median(r[key] for r in rows)


def _engine_ms(rows: list[dict[str, Any]], key: str) -> float:
    return 1000 * statistics.median(max(e[key] for e in r["engines"]) for r in rows)


def report(label: str, size_mib: float, rows: list[dict[str, Any]]) -> None:
    timed = [r for r in rows if not r["warmup"]]
    disk = [r for r in timed if r["arm"] == "disk"]
    bcast = [r for r in timed if r["arm"] == "broadcast"]
    loads = [r["load_1min"] for r in timed]
    print(
        f"{label}: {size_mib:.0f} MiB float32, 2 engines; medians of {len(disk)} interleaved "
        f"pushes per arm; load average {min(loads):.1f}-{max(loads):.1f} (1 min)"
    )
    print(
        f"  disk       {_ms(disk, 'total_s'):7.0f} ms = export {_ms(disk, 'export_s'):.0f} + "
        f"engines read, screen and copy {_ms(disk, 'push_s'):.0f} "
        f"(generation paused {_ms(disk, 'proxy_s'):.0f})"
    )
    print(
        f"  broadcast  {_ms(bcast, 'total_s'):7.0f} ms = no export; push "
        f"{_ms(bcast, 'push_s'):.0f} (generation paused {_ms(bcast, 'proxy_s'):.0f}): trainer "
        f"fill {_ms(bcast, 'fill_s'):.0f} (waited for {_ms(bcast, 'wait_fill_s'):.0f}), wire "
        f"{_ms(bcast, 'wire_s'):.0f}; slowest engine receive {_engine_ms(bcast, 'receive_s'):.0f}, "
        f"screen {_engine_ms(bcast, 'check_s'):.0f}, swap {_engine_ms(bcast, 'swap_s'):.0f}"
    )
    floor = [r for r in timed if r["arm"] == "gloo"]
    print(
        f"  gloo alone {_ms(floor, 'total_s'):7.0f} ms = the same {floor[0]['buckets']} buckets "
        f"({floor[0]['bytes'] / 2**20:.0f} MiB) to {len(bcast[0]['engines'])} processes, "
        f"nothing else: the floor of a broadcast push, {_ms(floor, 'total_s') / _ms(disk, 'total_s'):.2f}"
        f" of the disk push"
    )
    reused = sum(e["buffers_reused"] for r in bcast for e in r["engines"])
    allocated = sum(e["buffers_allocated"] for r in bcast for e in r["engines"])
    rounds = ", ".join(
        f"{b['total_s'] / d['total_s']:.2f}" for d, b in zip(disk, bcast, strict=True)
    )
    print(
        f"  ratio broadcast/disk {_ms(bcast, 'total_s') / _ms(disk, 'total_s'):.2f} "
        f"(each round's: {rounds}); engine receive buffers reused {reused}, "
        f"allocated {allocated}"
    )


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="disk vs broadcast weight pushes")
    parser.add_argument("--pushes", type=int, default=3, help="timed pushes per arm")
    parser.add_argument("--models", default="smollm2,0.5b", help="smollm2 and/or 0.5b")
    parser.add_argument(
        "--bucket-mb", type=float, default=512.0, help="broadcast bucket size (the config default)"
    )
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "models")
    parser.add_argument("--jsonl", type=Path, help="raw results (default bench/results/...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.jsonl or ROOT / "bench" / "results" / f"weight_push-{stamp}.jsonl"
    commit = git_commit()
    print(
        f"commit {commit}; {os.cpu_count()} cores; load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at start"
    )
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="proxima-bench-push-") as tmp, open(out, "a") as raw:
        work = Path(tmp)
        for name in args.models.split(","):
            if name == "smollm2":
                model_dir, label = prepare_smollm2(args.cache_dir), "SmolLM2-135M-Instruct"
            elif name == "0.5b":
                model_dir = build_qwen2_05b(args.cache_dir / "qwen2-0.5b-random")
                label = "Qwen2 0.5B (random, Qwen2.5-0.5B's shapes)"
            else:
                parser.error(f"unknown model {name!r}")
            rows = compare_model(name, model_dir, work, args.pushes, args.bucket_mb)
            size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
            for row in rows:
                raw.write(
                    json.dumps(
                        {
                            "bench": "weight_push",
                            "time": stamp,
                            "commit": commit,
                            "model": name,
                            "bucket_mb": args.bucket_mb,
                            **row,
                        }
                    )
                    + "\n"
                )
            report(label, size, rows)
            for arm in ARMS:
                timed = [r for r in rows if r["arm"] == arm and not r["warmup"]]
                medians[f"{name}/{arm}"] = _ms(timed, "total_s")
    print(f"raw results: {out}")
    if "0.5b/disk" in medians:
        print(
            f"transport floor: gloo alone {medians['0.5b/gloo']:.0f} ms, "
            f"{medians['0.5b/gloo'] / medians['0.5b/disk']:.2f}x of the disk push; "
            f"broadcast {medians['0.5b/broadcast'] / medians['0.5b/disk']:.2f}x (0.5B model)"
        )
        print(
            f"weight push: disk {medians['0.5b/disk']:.0f} ms, "
            f"broadcast {medians['0.5b/broadcast']:.0f} ms (0.5B model)"
        )
    return 0
