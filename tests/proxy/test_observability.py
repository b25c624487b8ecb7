"""Metrics, request ids and structured logs."""

from __future__ import annotations

import json
import logging

import httpx
from openai import OpenAI
from proxima.proxy.logs import JsonFormatter, request_id_var, session_id_var
from proxima.proxy.testing.live import LiveProxy


def test_metrics_and_request_ids(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    raw = client.chat.completions.with_raw_response.create(
        model=live_proxy.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.headers["x-proxima-session-id"] == s["session_id"]
    assert len(raw.headers["x-request-id"]) == 32
    echoed = httpx.get(live_proxy.url + "/health", headers={"X-Request-Id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"
    text = httpx.get(live_proxy.url + "/metrics").text
    assert 'proxima_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "proxima_policy_version " in text
    assert 'proxima_tokens_total{direction="completion"}' in text
    assert 'proxima_completions_recorded_total{kind="chat"}' in text
    assert 'proxima_sessions{kind="train",status="open"}' in text
    assert "proxima_backend_healthy{" in text


def test_json_logs_carry_ids_and_never_keys() -> None:
    record = logging.LogRecord(
        "proxima.proxy.test",
        logging.WARNING,
        __file__,
        1,
        "auth with %s failed",
        ("sk-proxima-s-abcdefghijklmnop",),
        None,
    )
    record.backend = "http://127.0.0.1:1"
    t1, t2 = request_id_var.set("req-1"), session_id_var.set("sess-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(t1)
        session_id_var.reset(t2)
    assert line["request_id"] == "req-1" and line["session_id"] == "sess-1"
    assert line["msg"] == "auth with sk-*** failed"
    assert line["backend"] == "http://127.0.0.1:1" and line["level"] == "warning"
