"""Recording: finished choices to durable completion records (the durability rule).

``ChoiceRecorder`` is the driver's ``commit`` step. It turns each finished
choice into a ``CompletionRecord`` (canonical request messages and reply,
token ids, behaviour logprobs, per-token policy versions, timings), commits
them through ``GroupCommit`` and returns only when they are durable; then it
makes them visible to the session's next turn (``HistoryCache``) and counts
them (tokens, interruptions, staleness).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.caches import HistoryCache
from proxima.proxy.metrics import Metrics
from proxima.proxy.rendering.canonical_message import as_json, as_json_list
from proxima.proxy.rendering.parents import RenderedTexts
from proxima.proxy.rendering.structured import GrammarRules
from proxima.proxy.service.canonical import assistant_message
from proxima.proxy.service.driver import ChoiceRun
from proxima.proxy.service.events import Finish
from proxima.proxy.service.prepare import Prepared
from proxima.proxy.store.group_commit import GroupCommit
from proxima.proxy.store.records import CompletionRecord


class ChoiceRecorder:
    def __init__(
        self,
        *,
        model_name: str,
        pool: BackendPool,
        group_commit: GroupCommit,
        histories: HistoryCache,
        metrics: Metrics,
        rendered: RenderedTexts | None = None,
        grammar_rules: GrammarRules = "proxima-engine",
    ) -> None:
        self.model_name = model_name
        # Whose masking rules the training pool's backends apply to a grammar: recorded with
        # each constrained completion so the trainer replays the same mask.
        self.grammar_rules: GrammarRules = grammar_rules
        self.rendered = rendered  # the prompt texts of chat completions, for their next turn
        self.pool = pool  # the training pool: staleness of recorded tokens is measured to it
        self.group_commit = group_commit
        self.histories = histories
        self.metrics = metrics

    async def __call__(self, prep: Prepared, finished: list[tuple[ChoiceRun, Finish]]) -> None:
        """Make the completions durable (group commit), then visible to the next turn."""
        runs = [run for run, _ in finished]
        self._account(len(prep.prompt_ids), runs)
        if prep.session is None:
            return
        records = [self.record(prep, run, finish) for run, finish in finished]
        await self.group_commit.commit(records, parent=prep.parent)
        self.histories.append(records)
        if self.rendered is not None and prep.rendered is not None:
            self.rendered.add([r.id for r in records], *prep.rendered)
        current = self.pool.policy(prep.adapter)[0]
        m = self.metrics
        for r in records:
            m.child(m.completions, "chat" if r.request_messages is not None else "text").inc()
            if r.output_versions:
                m.staleness.observe(current - min(r.output_versions))

    def record(self, prep: Prepared, run: ChoiceRun, finish: Finish) -> CompletionRecord:
        """The record of one finished choice of a request that has a session."""
        assert prep.session is not None
        r = run.result
        grammar = prep.params.grammar
        return CompletionRecord(
            id=run.completion_id,
            session_id=prep.session.id,
            parent_id=prep.parent_id,
            prompt_ids=prep.prompt_ids,
            output_ids=r.output_ids,
            output_logprobs=r.logprobs,
            output_versions=r.versions,
            finish_reason=finish.finish_reason,
            created_at=_now(),
            request_messages=None if prep.messages is None else as_json_list(prep.messages),
            request_tools=prep.tools,
            response_message=as_json(assistant_message(finish.parsed))
            if finish.parsed is not None
            else None,
            response_text=finish.text,
            sampling=_sampling_of(prep.sampling, r.logit_transforms),
            model=self.model_name,
            choice_index=run.index,
            finished_at=_now(),
            time_to_first_token=(run.first_token_at - run.started) if run.first_token_at else None,
            duration=time.monotonic() - run.started,
            backend=r.backend,
            adapter=prep.adapter,
            grammar=None if grammar is None else grammar.record(self.grammar_rules),
        )

    def _account(self, prompt_len: int, runs: list[ChoiceRun]) -> None:
        m = self.metrics
        m.child(m.tokens, "prompt").inc(prompt_len)
        m.child(m.tokens, "completion").inc(sum(len(r.result.output_ids) for r in runs))
        interruptions = sum(r.result.interruptions for r in runs)
        if interruptions:
            self.metrics.interruptions.inc(interruptions)


def _now() -> datetime:
    return datetime.now(UTC)


def _sampling_of(sampling: dict[str, Any], transforms: list[str]) -> dict[str, Any]:
    """The request's sampling record plus what this choice's generation added to it."""
    if not transforms:
        return sampling
    return {**sampling, "logit_transforms": [*sampling.get("logit_transforms", []), *transforms]}
