"""One session as the inspector shows it: its tree of chains and every turn token by token.

Built from the session's completions (one query: ``Store.list_completions``) and the
tokenizer the proxy holds; nothing here reads the store.

- The tree: a completion with a ``parent_id`` extends that parent token-exactly (its prompt is
  the parent's prompt and generated tokens, then the new messages' tokens); one without starts
  a chain. Why a chain starts is told from what the store keeps: the first turn; a text prompt
  extending no earlier tokens; messages that extend an earlier turn's messages and reply whose
  tokens were not reused (the template renders that reply otherwise: a new rendering); or
  messages that depart from every earlier turn's (history edited or compacted). A parent with
  several children is a fork; a parent that is not the latest turn before its child is a
  branch back to an earlier turn.
- Each turn: the messages it adds to its parent's (the earlier ones folded), beside the prompt
  tokens it adds (decoded one by one); its generated tokens with their logprob and version,
  and where the version changed inside the completion (a push interrupted it); its tool
  calls, reasoning and per-turn reward.
- Returns and advantages: the store keeps rewards (the session's and per turn), not the
  trainer's advantages (computed when a batch is claimed, with the trainer's settings). The
  page shows each turn's return at discount 1 and the advantage it gets under the trainer's
  defaults (group mean baseline, divided by the group's std) from the group's session rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from markupsafe import Markup, escape
from proxima.proxy.store.chains import chat_sequence
from proxima.proxy.store.records import CompletionRecord


def token_texts(tokenizer: Any, ids: Sequence[int]) -> dict[int, str]:
    """Each distinct id of ``ids`` decoded alone (special tokens shown), in one batch."""
    unique = sorted(set(ids))
    if not unique:
        return {}
    vocab = len(tokenizer)
    inside = [i for i in unique if 0 <= i < vocab]
    texts = tokenizer.batch_decode(
        [[i] for i in inside], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    out = dict(zip(inside, texts, strict=True))
    for i in unique:
        out.setdefault(i, f"<{i}?>")  # outside the vocabulary: shown, never raised
    return out


def _shown(text: str) -> str:
    if not text:
        return "\u2205"
    return text.replace("\n", "\u21b5\n")


def prompt_html(ids: Sequence[int], texts: dict[int, str]) -> Markup:
    """Prompt tokens as spans; the hover box reads ``data-i``."""
    return Markup(
        "".join(f'<span class="t" data-i="{i}">{escape(_shown(texts[i]))}</span>' for i in ids)
    )


def output_html(
    ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    texts: dict[int, str],
) -> Markup:
    """Generated tokens: coloured by probability (``--p``) or version (``--h``), a mark
    where the version changes."""
    parts: list[str] = []
    previous: int | None = None
    for i, lp, v in zip(ids, logprobs, versions, strict=True):
        if previous is not None and v != previous:
            parts.append(
                f'<span class="vchg" title="policy version {previous} \u2192 {v}: a push '
                f'interrupted the completion here">v{v}</span>'
            )
        previous = v
        p = math.exp(lp) if lp > -700 else 0.0
        parts.append(
            f'<span class="t o" data-i="{i}" data-l="{lp:.4f}" data-v="{v}" '
            f'style="--p:{p:.3f};--h:{(v * 137) % 360}">{escape(_shown(texts[i]))}</span>'
        )
    return Markup("".join(parts))


@dataclass
class TurnView:
    record: CompletionRecord
    number: int  # 1-based, in creation order
    depth: int = 0  # in the tree
    relation: str = "root"  # root | extends | fork | branch
    note: str = ""  # why it starts a chain, or how it attaches
    shared_tokens: int = 0  # prompt tokens that are the parent's prompt + output
    earlier_messages: int = 0  # request messages that are the parent's messages + reply
    tools_shown: bool = True
    prompt: Markup = Markup("")
    output: Markup = Markup("")
    version_changes: list[tuple[int, int, int]] = field(default_factory=list)  # (pos, from, to)
    turn_return: float | None = None
    advantage: float | None = None

    @property
    def new_messages(self) -> list[dict[str, Any]]:
        return list(self.record.request_messages or [])[self.earlier_messages :]

    @property
    def mean_logprob(self) -> float | None:
        lps = self.record.output_logprobs
        return sum(lps) / len(lps) if lps else None

    @property
    def versions(self) -> str:
        vs = self.record.output_versions
        if not vs:
            return "-"
        return str(vs[0]) if min(vs) == max(vs) else f"{min(vs)}\u2013{max(vs)}"


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def why_new_chain(c: CompletionRecord, earlier: Sequence[CompletionRecord]) -> str:
    """Why ``c`` (no parent) starts a chain, told from the turns before it."""
    if not earlier:
        return "first turn of the session"
    if c.request_messages is None:
        return "a text prompt that extends no earlier completion's tokens"
    best, shared = earlier[-1], -1
    for e in earlier:
        k = _common_prefix(c.request_messages, chat_sequence(e))
        if k >= shared:
            best, shared = e, k
    sequence = chat_sequence(best)
    if shared == len(sequence) and len(c.request_messages) > shared:
        if (c.request_tools or None) != (best.request_tools or None):
            return f"extends the messages of {best.id} with other tools: rendered anew"
        return (
            f"its messages extend {best.id}'s messages and reply, but the template renders "
            "that reply otherwise than its generated tokens (e.g. reasoning dropped): the "
            "prompt is the template's new rendering"
        )
    if shared <= 0:
        return "its messages share nothing with an earlier turn: a new conversation"
    return (
        f"its messages depart from {best.id}'s at message {shared + 1} of {len(sequence)}: "
        "history edited or compacted"
    )


def _attach(turn: TurnView, parent: CompletionRecord, siblings: int, latest: str | None) -> None:
    c = turn.record
    n = len(parent.prompt_ids) + len(parent.output_ids)
    exact = c.prompt_ids[:n] == [*parent.prompt_ids, *parent.output_ids]
    turn.shared_tokens = n if exact else 0
    turn.earlier_messages = _common_prefix(c.request_messages or [], chat_sequence(parent))
    how = (
        f"extends {parent.id} token-exactly: its {len(parent.prompt_ids)} prompt and "
        f"{len(parent.output_ids)} generated tokens, then {len(c.prompt_ids) - n} new"
        if exact
        else f"recorded as extending {parent.id}, but its prompt does not start with it"
    )
    if siblings > 1:
        turn.relation = "fork"
        how += f"; a fork: one of {siblings} continuations of {parent.id}"
    elif latest is not None and latest != parent.id:
        turn.relation = "branch"
        how += f"; a branch back: the latest turn before it was {latest}"
    else:
        turn.relation = "extends"
    turn.note = how


def tree_order(turns: list[TurnView]) -> list[TurnView]:
    """``turns`` depth-first from each root (children in creation order), depths set."""
    by_id = {t.record.id: t for t in turns}
    children: dict[str | None, list[TurnView]] = {}
    for t in turns:
        parent = t.record.parent_id if t.record.parent_id in by_id else None
        children.setdefault(parent, []).append(t)
    out: list[TurnView] = []
    stack = [(t, 0) for t in reversed(children.get(None, []))]
    while stack:
        turn, depth = stack.pop()
        turn.depth = depth
        out.append(turn)
        stack.extend((c, depth + 1) for c in reversed(children.get(turn.record.id, [])))
    return out


def _returns(turns: list[TurnView], reward: float | None, group: Sequence[float]) -> None:
    """Return at discount 1 and the default advantage of every turn (see the module docs)."""
    if not turns:
        return
    g = reward or 0.0
    for turn in reversed(turns):  # creation order, the last turn first
        g += turn.record.reward or 0.0
        turn.turn_return = g
    if len(group) < 2:
        return
    mean = sum(group) / len(group)
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
    for turn in turns:
        assert turn.turn_return is not None
        turn.advantage = 0.0 if std == 0 else (turn.turn_return - mean) / std


def build_turns(
    completions: Sequence[CompletionRecord],
    tokenizer: Any,
    *,
    reward: float | None = None,
    group_rewards: Sequence[float] = (),
) -> list[TurnView]:
    """The session's turns, in tree order (see the module docs)."""
    turns = [TurnView(c, n) for n, c in enumerate(completions, 1)]
    by_id = {c.id: c for c in completions}
    child_count: dict[str, int] = {}
    for c in completions:
        if c.parent_id is not None:
            child_count[c.parent_id] = child_count.get(c.parent_id, 0) + 1
    for k, turn in enumerate(turns):
        c = turn.record
        parent = by_id.get(c.parent_id) if c.parent_id is not None else None
        if parent is None:
            turn.note = why_new_chain(c, completions[:k])
            if c.parent_id is not None:
                turn.note = f"its parent {c.parent_id} is not in this session; " + turn.note
        else:
            latest = completions[k - 1].id if k else None
            _attach(turn, parent, child_count[parent.id], latest)
            turn.tools_shown = (c.request_tools or None) != (parent.request_tools or None)
    ids = [i for t in turns for i in t.record.prompt_ids[t.shared_tokens :]]
    ids += [i for c in completions for i in c.output_ids]
    texts = token_texts(tokenizer, ids)
    for turn in turns:
        c = turn.record
        turn.prompt = prompt_html(c.prompt_ids[turn.shared_tokens :], texts)
        turn.output = output_html(c.output_ids, c.output_logprobs, c.output_versions, texts)
        vs = c.output_versions
        turn.version_changes = [
            (k, vs[k - 1], vs[k]) for k in range(1, len(vs)) if vs[k] != vs[k - 1]
        ]
    _returns(turns, reward, group_rewards)
    return tree_order(turns)
