"""The inspector in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``make chromium``) driven by Selenium against a live
``proxima serve`` with the taught tiny model.

A session is recorded through the real API: the scripted tool conversation (a tool call, the
tool's result, a follow-up) and a fourth turn whose history was edited, which starts a new
chain; a weight push, a second session of the group on the new version, and held-out scores.
The browser signs in with ``?token=`` (then holds only the HttpOnly cookie), filters the list,
opens the session (its tree, a token's hover box, the colouring by version), and follows its
run to the run page. Each page is saved as a screenshot: under the test's temporary folder, or
in ``$PROXIMA_SCREENSHOTS_DIR`` when set (``docs/`` holds the ones the reference shows).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.proxy.scripts import ANSWER, QUESTION, THANKS, TOOL_RESULT, TOOLS, WELCOME

CHROMIUM = Path("/usr/bin/chromium")
DRIVER = Path("/usr/bin/chromedriver")
RUN = "inspect-run"
GROUP = f"weather@{RUN}"
WAIT_S = 10


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    for path in (CHROMIUM, DRIVER):
        if not path.exists():  # a missing browser is a failure, never a skip
            pytest.fail(f"{path} is missing: `make chromium` installs it (make test does)")
    profile = tempfile.mkdtemp(prefix="inspector-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1400,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _chat(client: OpenAI, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, **kw
    ).choices[0]


def record_sessions(proxy: LiveProxy) -> tuple[str, str]:
    """The rewarded tool session (4 turns, 2 chains) and a second one of its group on v1."""
    meta = {"rollout": RUN, "sample": 0}
    s = proxy.new_session(group_id=GROUP, data_id="weather", metadata=meta)
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    model = proxy.model_name
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = _chat(client, model, messages, max_tokens=80)
    call = first.message.tool_calls[0]
    assert first.finish_reason == "tool_calls" and call.function.name == "get_weather"
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = _chat(client, model, messages, max_tokens=80)
    assert second.message.content == ANSWER
    messages += [second.message.model_dump(exclude_none=True), {"role": "user", "content": THANKS}]
    assert _chat(client, model, messages, max_tokens=80).message.content == WELCOME
    # The agent rewrites its history (the tool call becomes prose): a new chain.
    edited = [messages[0], {"role": "assistant", "content": "Let me look."}, messages[-1]]
    _chat(client, model, edited, max_tokens=6)
    key = {"Authorization": f"Bearer {s['api_key']}"}
    root = f"{proxy.url}/rl/sessions/{s['session_id']}"
    httpx.post(f"{root}/reward", json={"reward": 1.0}, headers=key).raise_for_status()
    httpx.post(f"{root}/finish", headers=key).raise_for_status()

    proxy.push_weights(1, proxy.model_dir)  # the same weights, as version 1
    admin = proxy.admin_headers()
    for version, score in ((0, 0.25), (1, 0.5)):
        httpx.post(
            f"{proxy.url}/admin/versions/{version}/evals",
            json={"score": score, "items": 4, "name": "held-out"},
            headers=admin,
        ).raise_for_status()
    other = proxy.new_session(group_id=GROUP, data_id="weather", metadata={**meta, "sample": 1})
    client = OpenAI(base_url=other["base_url"], api_key=other["api_key"])
    _chat(client, model, [{"role": "user", "content": QUESTION}], max_tokens=80)
    key = {"Authorization": f"Bearer {other['api_key']}"}
    root = f"{proxy.url}/rl/sessions/{other['session_id']}"
    httpx.post(f"{root}/reward", json={"reward": 0.0}, headers=key).raise_for_status()
    httpx.post(f"{root}/finish", headers=key).raise_for_status()
    return s["session_id"], other["session_id"]


def screenshot(driver: WebDriver, name: str, folder: Path) -> Path:
    """The whole page (the window stretched to its height, at most 2400 px) as a PNG."""
    height = min(2400, int(driver.execute_script("return document.body.scrollHeight")) + 40)
    driver.set_window_size(1400, max(900, height))
    target = Path(os.environ.get("PROXIMA_SCREENSHOTS_DIR") or folder) / f"inspector-{name}.png"
    assert driver.save_screenshot(str(target))
    driver.set_window_size(1400, 1000)
    return target


def rows(driver: WebDriver) -> list[str]:
    return [
        tr.get_attribute("data-id") or ""
        for tr in driver.find_elements(By.CSS_SELECTOR, "#sessions tbody tr[data-id]")
    ]


def test_list_session_and_run_pages_in_chromium(
    live_proxy: LiveProxy, browser: WebDriver, tmp_path: Path
) -> None:
    rewarded, other = record_sessions(live_proxy)
    wait = WebDriverWait(browser, WAIT_S)

    # Sign in with ?token=: the page comes back without it, and scripts cannot read the cookie.
    browser.get(f"{live_proxy.url}/ui/sessions?token={live_proxy.admin_token}")
    assert browser.current_url == f"{live_proxy.url}/ui/sessions"
    assert live_proxy.admin_token not in browser.current_url
    assert browser.execute_script("return document.cookie") == ""
    assert rows(browser)[:2] == [other, rewarded]  # newest first
    screenshot(browser, "sessions", tmp_path)

    # A filter through the form: rewarded sessions only.
    browser.find_element(By.NAME, "reward_min").send_keys("1")
    browser.find_element(By.ID, "apply").click()
    wait.until(lambda d: "reward_min=1" in d.current_url)
    assert rows(browser) == [rewarded]

    # The session: its chains, and a generated token's hover box.
    browser.find_element(By.LINK_TEXT, rewarded).click()
    wait.until(lambda d: d.find_elements(By.ID, "tree"))
    relations = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#tree .rel")]
    assert relations == ["ROOT", "EXTENDS", "EXTENDS", "ROOT"], relations
    tree = browser.find_element(By.ID, "tree").text
    assert "first turn of the session" in tree and "depart from" in tree and "message 2" in tree
    assert "get_weather" in browser.find_element(By.CSS_SELECTOR, "section.turn .reply").text
    token = browser.find_element(By.CSS_SELECTOR, "section.turn .tokens.output .t.o")
    ActionChains(browser).move_to_element(token).perform()
    tip = browser.find_element(By.ID, "tip")
    wait.until(lambda d: tip.is_displayed())
    shown = tip.text
    assert f"token id {token.get_attribute('data-i')}" in shown
    assert "logprob" in shown and "version  0" in shown and token.text.strip() in shown
    screenshot(browser, "session", tmp_path)
    browser.find_element(By.ID, "by-version").click()
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-colour") == "version"

    # Its run: the curves, versions and production state.
    browser.find_element(By.ID, "run-link").click()
    wait.until(lambda d: d.find_elements(By.ID, "run-name"))
    assert browser.find_element(By.ID, "run-name").text == RUN
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.chart")) >= 2
    versions = browser.find_element(By.ID, "versions").text
    assert versions.split("\n")[1].startswith("1 ")  # the push, newest first
    production = browser.find_element(By.ID, "production").text
    assert "base" in production and "follows_training" in production
    assert "sessions\n2" in browser.find_element(By.ID, "summary").text
    screenshot(browser, "run", tmp_path)
