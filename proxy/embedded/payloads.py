"""JSON bodies of ``/generate`` replies and stream chunks, in SGLang's layout."""

from __future__ import annotations

import math
from typing import Any

from proxima.proxy.embedded.engine import Engine, GenerationState


def output_text(engine: Engine, state: GenerationState, *, skip_special_tokens: bool) -> str:
    """Decoded output; when a stop string matched, cut before it (SGLang semantics)."""
    text = engine.decode(state.output_ids, skip_special_tokens=skip_special_tokens)
    reason = state.finish_reason
    if reason is not None and reason["type"] == "stop" and isinstance(reason["matched"], str):
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return text


def _logprob(value: float) -> float | None:
    """A logprob as SGLang's orjson writes it: -inf and NaN become null (JSON has neither)."""
    return value if math.isfinite(value) else None


def generate_payload(
    engine: Engine,
    state: GenerationState,
    *,
    return_logprob: bool,
    skip_special_tokens: bool,
) -> dict[str, Any]:
    """``{"text", "output_ids", "meta_info"}`` for the (cumulative) state of one request."""
    meta_info: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": state.finish_reason,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        "weight_version": state.weight_version,
    }
    if return_logprob:
        meta_info["output_token_logprobs"] = [
            [_logprob(logprob), token_id, None]
            for logprob, token_id in zip(state.output_logprobs, state.output_ids, strict=True)
        ]
        if state.output_top_logprobs is not None:
            meta_info["output_top_logprobs"] = [
                [[_logprob(logprob), token_id, None] for logprob, token_id in position]
                for position in state.output_top_logprobs
            ]
    return {
        "text": output_text(engine, state, skip_special_tokens=skip_special_tokens),
        "output_ids": list(state.output_ids),
        "meta_info": meta_info,
    }
