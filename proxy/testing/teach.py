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
# A whole conversation as rendered text: (text, taught) pieces, the taught ones learned.
Sequence_ = Sequence[tuple[str, bool]]


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


# The least probability ``teach_texts`` gives every taught token (see its docstring).
MIN_PROB = 0.9999


def teach_texts(
    model_dir: str | Path,
    sequences: Sequence[Sequence_],
    *,
    rounds: int = 1000,
    steps: int = 20,
    lr: float = 1e-2,
    min_prob: float = MIN_PROB,
    seed: int = 0,
) -> Path:
    """Fine-tune ``model_dir`` in place on whole rendered conversations.

    Each sequence is a list of ``(text, taught)`` pieces, tokenized piece by
    piece (special-token strings become their tokens); the ``taught`` pieces
    (replies, each ending with its end token written out) are learned, the
    rest is context. One conversation holds every turn of an agent run: turn
    2's prompt is turn 1's prompt + reply + the tool result, as the proxy
    builds it, so one sequence teaches both replies.

    Harness prompts are thousands of tokens, and back-propagating through
    their attention on CPU takes seconds a step. The first piece (the
    harness's first prompt) is context only, so it is run without gradients
    once per round and its keys and values reused for ``steps`` steps on the
    rest of the sequence (a few hundred tokens); each round recomputes them
    with the updated weights. The sequences of one prompt (a harness's replies
    after each tool result it is taught) share those keys and values and train
    as padded batches: a call of the model per prompt and step, not per
    sequence (one by one, those calls were 576 s of the 590 s that teaching
    Codex and Claude Code took on a quiet host). Training stops once a full
    forward pass, with no cached values, gives every taught token at least ``min_prob`` (a round
    takes under a second; the harness prompts hold the date, and some days'
    prompts need over a hundred rounds): harnesses
    sample at temperature 1 (they send none), so a 20-token reply must come out
    whole with near certainty, and no other engine's summation order can flip
    it; else an error. At 0.999, a taught Codex run still strayed with
    probability sum(1 - p) = 0.44% (11 taught tokens, the weakest just over the
    bar), about 2% over the suite's four harness runs, and one did; at 0.9999
    it is 0.05%, for about 20 s more of teaching per harness.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    prepared = _prepare(tokenizer, sequences)
    batches = _batches(prepared)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(rounds):
        _teach_round(model, optimizer, batches, len(prepared), steps)
        wrong = _wrong_tokens(model, prepared, min_prob)
        if not wrong:
            model.save_pretrained(model_dir, safe_serialization=True)
            return model_dir
    raise RuntimeError(
        f"teach_texts: {wrong} taught tokens under p={min_prob} after {rounds} rounds"
    )


# One sequence ready to teach: the prompt's ids but its last (context, run without
# gradients), then the ids after them and their labels (-100: not taught), each (1, n).
_Prepared = tuple[Any, Any, Any]


def _prepare(tokenizer: Any, sequences: Sequence[Sequence_]) -> list[_Prepared]:
    """Each sequence tokenized piece by piece: its prompt's head, and the rest with labels."""
    import torch

    prepared = []
    for pieces in sequences:
        (head, head_taught), *rest = pieces
        if head_taught:
            raise ValueError("a sequence's first piece is its prompt (not taught)")
        head_tokens = tokenizer.encode(head, add_special_tokens=False)
        # The prompt's last token runs with the rest: its logits predict the first reply token.
        tokens: list[int] = head_tokens[-1:]
        targets: list[int] = [-100]
        for text, taught in rest:
            piece = tokenizer.encode(text, add_special_tokens=False)
            tokens += piece
            targets += piece if taught else [-100] * len(piece)
        prepared.append(
            (torch.tensor([head_tokens[:-1]]), torch.tensor([tokens]), torch.tensor([targets]))
        )
    return prepared


def _taught_probs(model: Any, prepared: list[_Prepared]) -> list[Any]:
    """Each sequence's taught tokens' probabilities (a full pass, no cached values)."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for head_ids, ids, labels in prepared:
            full = torch.cat([head_ids, ids], dim=1)
            start = head_ids.shape[1]
            probs = model(input_ids=full).logits[0, start:-1].softmax(-1)
            mask = labels[0, 1:] != -100
            out.append(probs[mask].gather(1, labels[0, 1:][mask][:, None]).squeeze(1))
    return out


def _wrong_tokens(model: Any, prepared: list[_Prepared], min_prob: float) -> int:
    """Taught tokens whose probability is under ``min_prob``."""
    return sum(int((p < min_prob).sum()) for p in _taught_probs(model, prepared))


def least_taught_probs(model_dir: str | Path, sequences: Sequence[Sequence_]) -> list[float]:
    """For each sequence, the least probability ``model_dir`` gives one of its taught tokens:
    how close an unseen variant of a taught conversation comes to being answered as taught."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [float(p.min()) for p in _taught_probs(model, _prepare(tokenizer, sequences))]


# Rows of one padded batch of replies are bounded by this many attention scores (rows x
# reply length x keys), so a long prompt with many replies trains in a few chunks, not at once.
_SCORES_PER_CHUNK = 1 << 24


# A prompt head and its sequences' replies, right-padded in chunks: (ids, labels, mask) each.
_Batch = tuple[Any, list[tuple[Any, Any, Any]]]


def _batches(prepared: list[_Prepared]) -> list[_Batch]:
    """The sequences grouped by prompt head, each group's replies in right-padded chunks:
    ``(head, [(ids, labels, attention_mask), ...])``, rows of one chunk sharing the head."""
    import torch

    groups: dict[tuple[int, ...], tuple[Any, list[tuple[Any, Any]]]] = {}
    for head, ids, labels in prepared:
        key = tuple(head[0].tolist())
        groups.setdefault(key, (head, []))[1].append((ids[0], labels[0]))
    out = []
    for head, rows in groups.values():
        width = max(len(ids) for ids, _ in rows)
        per_chunk = max(1, _SCORES_PER_CHUNK // (width * (head.shape[1] + width)))
        chunks = []
        for at in range(0, len(rows), per_chunk):
            part = rows[at : at + per_chunk]
            ids = torch.zeros((len(part), width), dtype=torch.long)
            labels = torch.full((len(part), width), -100)
            mask = torch.zeros((len(part), head.shape[1] + width), dtype=torch.long)
            mask[:, : head.shape[1]] = 1
            for row, (row_ids, row_labels) in enumerate(part):
                ids[row, : len(row_ids)] = row_ids
                labels[row, : len(row_ids)] = row_labels
                mask[row, head.shape[1] : head.shape[1] + len(row_ids)] = 1
            chunks.append((ids, labels, mask))
        out.append((head, chunks))
    return out


def _teach_round(
    model: Any, optimizer: Any, batches: list[_Batch], sequences: int, steps: int
) -> None:
    """One round: each distinct prompt head's keys and values once without gradients, then
    ``steps`` steps on the rest of every sequence. The ``sequences`` sequences, in
    ``_batches`` of one head each (a harness's replies after each tool result), train as
    right-padded batches over those keys and values, the loss of each sequence its own mean
    over its taught tokens, as if run one by one."""
    import torch
    from torch.nn.functional import cross_entropy
    from transformers.cache_utils import DynamicCache

    model.eval()
    with torch.no_grad():
        caches = [model(input_ids=head, use_cache=True).past_key_values for head, _ in batches]
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        for cache, (head, chunks) in zip(caches, batches, strict=True):
            start = head.shape[1]
            for ids, labels, mask in chunks:
                rows, width = ids.shape
                # The head's keys and values for every row (``update`` concatenates: the
                # head's own tensors are never written).
                past = DynamicCache(
                    [
                        (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
                        for layer in cache.layers
                    ]
                )
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    past_key_values=past,
                    position_ids=torch.arange(start, start + width).expand(rows, -1),
                ).logits
                targets = labels[:, 1:]
                losses = cross_entropy(
                    logits[:, :-1].transpose(1, 2), targets, ignore_index=-100, reduction="none"
                )
                taught = (targets != -100).sum(1).clamp(min=1)
                ((losses.sum(1) / taught).sum() / sequences).backward()
        optimizer.step()
