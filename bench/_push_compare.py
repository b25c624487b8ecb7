"""``bench/weight_push.py``'s default run: disk and broadcast pushes of the same versions.

For each model: ``proxima serve --engines 2`` on it, the trainer's side here (the model in
float32; each version exported as the trainer exports it, then pushed), one warm-up push
and ``--pushes`` timed ones per transport. A push's time is export + transfer + load, until
``POST /admin/weights`` answers (every engine serves the version); the proxy's own time,
generation paused, is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer  # noqa: E402
from proxima.trainer.backends.base import copy_tokenizer_files  # noqa: E402
from proxima.trainer.pipeline.demo_model import prepare_smollm2  # noqa: E402
from proxima.trainer.weight_broadcast import BroadcastWeightSink  # noqa: E402
from proxima.trainer.weights import ProxyWeightSink, WeightSink, export_weights  # noqa: E402
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


@dataclass(frozen=True)
class Timing:
    export_s: float
    push_s: float  # transfer + load, until every engine serves it
    proxy_s: float  # the proxy's own time: generation paused

    @property
    def total_s(self) -> float:
        return self.export_s + self.push_s


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


def _writer(model: PreTrainedModel, model_dir: Path) -> Callable[[Path], None]:
    def write(out: Path) -> None:  # what the torch backend's export_hf writes
        model.save_pretrained(out, safe_serialization=True)
        copy_tokenizer_files(model_dir, out)

    return write


def _sink(transport: str, proxy: LiveProxy) -> WeightSink:
    if transport == "disk":
        return ProxyWeightSink(proxy.url, admin_token=proxy.admin_token, timeout_s=600)
    settings = WeightsConfig(
        transport="broadcast",
        fallback_to_disk=False,
        master_address="127.0.0.1",
        timeout_s=600,
        bucket_mb=512,
    )
    return BroadcastWeightSink(
        proxy.url, admin_token=proxy.admin_token, settings=settings, timeout_s=600
    )


async def _pushes(
    proxy: LiveProxy,
    model: PreTrainedModel,
    model_dir: Path,
    out: Path,
    transport: str,
    first: int,
    n: int,
) -> list[Timing]:
    """One warm-up push, then ``n`` timed ones of versions ``first + 1 ..``."""
    sink = _sink(transport, proxy)
    write = _writer(model, model_dir)
    timings = []
    try:
        for i in range(n + 1):
            version = first + i
            with torch.no_grad():  # every version is new weights
                next(model.parameters()).add_(1e-3)
            started = time.monotonic()
            path = await asyncio.to_thread(export_weights, out, version, write)
            exported = time.monotonic()
            result = await sink.push(version=version, path=path)
            pushed = time.monotonic()
            if result.transport != transport:
                raise RuntimeError(f"version {version} went by {result.transport}")
            if i > 0:
                timings.append(Timing(exported - started, pushed - exported, result.proxy_seconds))
            shutil.rmtree(out / "weights" / f"v{version - 1}", ignore_errors=True)
    finally:
        await sink.aclose()
    return timings


def compare_model(name: str, model_dir: Path, work: Path, n: int) -> dict[str, list[Timing]]:
    """Disk then broadcast pushes of one model to ``proxima serve --engines 2``."""
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
        out = work / f"{name}-trainer"
        results: dict[str, list[Timing]] = {}
        version = 1
        for transport in ("disk", "broadcast"):
            results[transport] = asyncio.run(
                _pushes(proxy, model, model_dir, out, transport, version, n)
            )
            version += n + 1
        health = httpx.get(proxy.url + "/health", timeout=30).json()
        served = {b["version"] for b in health["backends"]}
        if served != {version - 1}:
            raise RuntimeError(f"the engines serve {served}, not version {version - 1}")
    finally:
        proxy.stop()
    return results


def _ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def report(name: str, model_dir: Path, results: dict[str, list[Timing]]) -> None:
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    print(f"{name}: {size:.0f} MiB float32 safetensors, 2 engines")
    for transport, timings in results.items():
        print(
            f"  {transport:9s} export {_ms([t.export_s for t in timings]):7.0f} ms + "
            f"transfer and load {_ms([t.push_s for t in timings]):7.0f} ms = "
            f"{_ms([t.total_s for t in timings]):7.0f} ms "
            f"(generation paused {_ms([t.proxy_s for t in timings]):6.0f} ms; "
            f"median of {len(timings)})"
        )


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="disk vs broadcast weight pushes")
    parser.add_argument("--pushes", type=int, default=3, help="timed pushes per transport")
    parser.add_argument("--models", default="smollm2,0.5b", help="smollm2 and/or 0.5b")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="proxima-bench-push-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            if name == "smollm2":
                model_dir, label = prepare_smollm2(args.cache_dir), "SmolLM2-135M-Instruct"
            elif name == "0.5b":
                model_dir = build_qwen2_05b(args.cache_dir / "qwen2-0.5b-random")
                label = "Qwen2 0.5B (random, Qwen2.5-0.5B's shapes)"
            else:
                parser.error(f"unknown model {name!r}")
            results = compare_model(name, model_dir, work, args.pushes)
            report(label, model_dir, results)
            for transport, timings in results.items():
                medians[f"{name}/{transport}"] = _ms([t.total_s for t in timings])
    if "0.5b/disk" in medians:
        print(
            f"weight push: disk {medians['0.5b/disk']:.0f} ms, "
            f"broadcast {medians['0.5b/broadcast']:.0f} ms (0.5B model)"
        )
    return 0
