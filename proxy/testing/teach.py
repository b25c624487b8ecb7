"""Teach the tiny test model a few scripted replies.

A random model never emits a tool call, so tests that need one first
fine-tune the tiny model (a few seconds on CPU) on scripted conversations:
given a rendered prompt, the scripted reply (tool call or text, with its end
token) is trained until greedy decoding reproduces it. Everything else about
the model stays real: real weights, real tokens, real logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Example = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]


def teach(
    model_dir: str | Path,
    examples: Sequence[Example],
    *,
    steps: int = 150,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Fine-tune ``model_dir`` in place so each ``(messages, tools, reply)`` is answered by ``reply``.

    ``reply`` is the raw assistant text the model should produce after the
    generation prompt; the end-of-turn token is appended.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    batch = []
    for messages, tools, reply in examples:
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor(prompt_ids + reply_ids)
        labels = ids.clone()
        labels[: len(prompt_ids)] = -100
        batch.append((ids, labels))
    # One right-padded batch: a single forward/backward per step.
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
    targets = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, labels) in enumerate(batch):
        input_ids[row, : len(ids)] = ids
        targets[row, : len(ids)] = labels
        mask[row, : len(ids)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=input_ids, attention_mask=mask, labels=targets).loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir
