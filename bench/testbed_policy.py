"""The testbed's task (small addition) and its starting policy, built once and cached.

Task: the prompt is the chat message ``"a+b="``; the reward is 1 when the reply is
exactly ``str(a + b)``, else 0. The starting policy is the tiny byte-level Qwen2
model (``proxima.proxy.testing.tiny_model``) fine-tuned on ``a, b`` in
``0..DIGITS-1`` with noisy answers (``TaskSettings``; see ``bench/testbed.py``).

:func:`prepare_model` caches it under ``cache_dir/addition-KEY``. The key
(:func:`starting_policy_key`) hashes everything the fine-tuned weights depend on:
the settings, every file of the random base model by content (config, initial
weights, tokenizer, chat template), the fine-tuning data, the source of the
fine-tuning code and the torch/transformers versions. A change to any of them is a
new key, so an old cache is never silently reused; a cached policy whose manifest
or tokenizer files no longer match is refused (``RuntimeError``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DIGITS = 5  # a, b in 0..DIGITS-1
MAX_SUM = 2 * (DIGITS - 1)


@dataclass(frozen=True)
class TaskSettings:
    """How the testbed's starting policy is fine-tuned (part of its cache key)."""

    p_correct: float = 0.3  # share of fine-tuning answers that are right
    width: int = 1  # answers zero-padded to this many digits (2: "07", a 3-token reply)
    noise: str = "near"  # wrong answers: "near" (sum +- 1 or 2) or "uniform" (any of 0..MAX_SUM)
    sft_steps: int = 600
    sft_batch: int = 64
    sft_lr: float = 3e-3
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2


def prompt_of(a: int, b: int) -> str:
    """The user message for the pair ``(a, b)``."""
    return f"{a}+{b}="


def answer_of(a: int, b: int, width: int = 1) -> str:
    """The sum's decimal digits, zero-padded to ``width``."""
    return str(a + b).zfill(width)


def reward_of(a: int, b: int, reply: str | None, width: int = 1) -> float:
    """1.0 when the reply is exactly the sum's decimal digits (``answer_of``), else 0.0."""
    return 1.0 if (reply or "") == answer_of(a, b, width) else 0.0


def pairs(digits: int) -> list[tuple[int, int]]:
    """Every ``(a, b)`` with ``a, b`` in ``0..digits-1``."""
    return [(a, b) for a in range(digits) for b in range(digits)]


ALL_PAIRS = pairs(DIGITS)


# The base model's files that the fine-tune reads or the proxy serves (weights, config,
# tokenizer, chat template): every byte of them is in the cache key.
_BASE_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")
# The files the proxy tokenizes with: a cached policy must still have them as keyed.
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "added_tokens", "vocab")


def starting_policy_key(
    settings: TaskSettings, base_dir: Path, data: list[tuple[int, int]] | None = None
) -> tuple[str, dict[str, Any]]:
    """The cache key of the starting policy, and the manifest it hashes.

    Everything the fine-tuned weights depend on: the settings; every file of the
    random base model in ``base_dir`` (config, initial weights, tokenizer files and
    chat template), by content; the fine-tuning data (``data``: the pairs, their
    prompts and sums; default :data:`ALL_PAIRS`); the source of the fine-tuning
    code; and the torch and transformers versions whose numerics it runs on. A
    change to any of them is a new key, so an old cache is never reused.
    """
    import torch
    import transformers

    data = ALL_PAIRS if data is None else data
    files = sorted({f for pattern in _BASE_FILES for f in Path(base_dir).glob(pattern)})
    manifest = {
        "settings": asdict(settings),
        "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "data": hashlib.sha256(
            json.dumps([[a, b, prompt_of(a, b), a + b] for a, b in data]).encode()
        ).hexdigest(),
        "max_sum": MAX_SUM,
        "code": hashlib.sha256(
            "".join(
                inspect.getsource(f) for f in (_fine_tune, _wrong, prompt_of, answer_of)
            ).encode()
        ).hexdigest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    raw = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16], manifest


def prepare_model(cache_dir: Path, settings: TaskSettings = TaskSettings()) -> Path:
    """The testbed's starting policy (built once and cached under ``cache_dir``).

    The random base model is rebuilt every call (about a second) and hashed with
    everything else the fine-tune depends on (:func:`starting_policy_key`); a cached
    policy is reused only under the same key, and only when its manifest and
    tokenizer files still match (else :class:`RuntimeError`: a cache edited by hand).
    """
    from proxima.proxy.testing.tiny_model import build_tiny_model

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="base-", dir=cache_dir))
    try:
        build_tiny_model(
            base,
            seed=settings.seed,
            hidden_size=settings.hidden_size,
            num_layers=settings.num_layers,
        )
        key, manifest = starting_policy_key(settings, base)
        out = cache_dir / f"addition-{key}"
        if (out / "testbed.json").is_file():
            _check_cached(out, manifest)
            logger.info("testbed: cached starting policy %s", out)
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        _fine_tune(tmp, settings)
        (tmp / "testbed.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _check_cached(out: Path, manifest: dict[str, Any]) -> None:
    """Refuse a cached policy whose manifest or tokenizer files differ from ``manifest``."""
    stored = json.loads((out / "testbed.json").read_text())
    if stored != json.loads(json.dumps(manifest)):
        raise RuntimeError(f"{out}: its manifest does not match its key; delete it to rebuild")
    for name, digest in manifest["files"].items():
        if not name.startswith(_TOKENIZER_FILES):
            continue  # the fine-tune rewrote the weights (and their config) by design
        if hashlib.sha256((out / name).read_bytes()).hexdigest() != digest:
            raise RuntimeError(f"{out / name} differs from the base it was keyed on; delete it")


def _fine_tune(model_dir: Path, settings: TaskSettings) -> None:
    """Fine-tune the model in ``model_dir`` on noisy sums (see the module doc), in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    torch.set_num_threads(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.sft_lr, weight_decay=0.0)
    prompts = {}
    for a, b in ALL_PAIRS:
        messages = [{"role": "user", "content": prompt_of(a, b)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts[a, b] = tokenizer.encode(text, add_special_tokens=False)
    model.train()
    for _ in range(settings.sft_steps):
        rows = []
        for _ in range(settings.sft_batch):
            a, b = rng.choice(ALL_PAIRS)
            answer = a + b if rng.random() < settings.p_correct else _wrong(a + b, settings, rng)
            reply = tokenizer.encode(str(answer).zfill(settings.width), add_special_tokens=False)
            reply.append(tokenizer.eos_token_id)
            rows.append((prompts[a, b], reply))
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, r) in enumerate(rows):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)


def _wrong(total: int, settings: TaskSettings, rng: random.Random) -> int:
    """A wrong fine-tuning answer for the sum ``total``."""
    if settings.noise == "uniform":
        return rng.randint(0, MAX_SUM)
    near = [total + d for d in (-2, -1, 1, 2) if 0 <= total + d <= MAX_SUM]
    return rng.choice(near)
