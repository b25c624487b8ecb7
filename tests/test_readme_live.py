"""Every command of the README's Quick start and Harnesses sections, as written, on the demo model.

The snippets are read from README.md itself (its fenced blocks), so the README and this test
cannot drift: a block this test does not know how to run fails it. Each block runs as
written, in a scratch directory that links the checkout's ``Makefile``, ``pyproject.toml``,
``.venv``, ``.cache/models`` and ``.cache/harnesses`` (so a harness's shell tool works on
scratch files, never on the checkout). What the test changes around them, never in them:

- the port: ``proxima serve`` gets ``PROXIMA_PORT`` (a free port) and ``PROXIMA_DB`` (a
  scratch store) from the environment, and ``127.0.0.1:8000`` in the snippets is that port;
- ``make`` runs with ``MAKEFLAGS=-o .venv/.installed-demo`` (the test's own venv is never
  reinstalled);
- ``HOME`` is a scratch directory (Codex CLI's ``~/.codex/config.toml`` is the README's TOML
  block) and every proxy variable points at a closed loopback port: nothing leaves the
  machine;
- after a harness block, one line prints the session it used, to find it in the store.

Quick start: the server starts, the Python block prints the completion's versions. Harnesses:
the server starts with the README's flags, then Codex CLI, Claude Code, the Agents SDK and
mini-swe-agent run side by side, each in its own session. The demo model cannot do their
task; what is checked is that each harness is served and ends promptly: every request it
made was answered (no 4xx or 5xx in the request log), each of its turns is recorded with one
logprob and one version per token and at most the README's output cap, a turn that extends
another does so token-exactly, and the harness exits 0 or with its own words for a reply cut
at the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.auth import hash_key
from proxima.proxy.serving import free_port
from proxima.proxy.store import Store

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
CAP = 128  # the README's --default-max-tokens and --max-tokens-limit for harnesses
RUN_S = 420  # at most this long per harness run (a stalled one fails the test)
OFFLINE_ENV = {
    **{k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
    **{k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "all_proxy")},
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
# What a harness says when the model's reply was cut at the output cap: its run ends there.
CUT_AT_CAP = {
    "codex": "Incomplete response returned, reason: max_output_tokens",
    "claude": "output token maximum",
    "agents-sdk": "incomplete_details=IncompleteDetails(reason='max_output_tokens')",
}


@dataclass
class Block:
    lang: str
    code: str


def section_blocks(heading: str) -> list[Block]:
    """The fenced blocks of the README section whose heading starts with ``heading``."""
    text = README.read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return [Block(m[1], m[2]) for m in re.finditer(r"```(\w*)\n(.*?)```", body, re.S)]


def test_the_readme_sections_hold_the_blocks_this_test_runs() -> None:
    quick = [b.lang for b in section_blocks("Quick start")]
    harnesses = [b.lang for b in section_blocks("Harnesses")]
    assert quick == ["bash", "python"]
    assert harnesses == ["bash", "bash", "toml", "bash", "bash", "python", "bash"]
    # The model name the snippets ask for is the one the server serves: the directory's.
    for block in section_blocks("Quick start") + section_blocks("Harnesses"):
        for name in re.findall(r'model[ =]+"([^"]+)"', block.code):
            assert name == MODEL.name, block.code


# ------------------------------------------------------------------------------ running


class Scratch:
    """A scratch directory that looks like the checkout to the snippets, and their env."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True)
        for name in ("Makefile", "pyproject.toml", ".venv"):
            (root / name).symlink_to(REPO / name)
        (root / ".cache").mkdir()
        for name in ("models", "harnesses"):
            (REPO / ".cache" / name).mkdir(parents=True, exist_ok=True)  # make fills them
            (root / ".cache" / name).symlink_to(REPO / ".cache" / name)
        self.port = free_port()
        self.db = f"sqlite:///{root / 'store.db'}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "MAKEFLAGS": "-o .venv/.installed-demo",
            "PROXIMA_PORT": str(self.port),
            "PROXIMA_DB": self.db,
            **OFFLINE_ENV,
        }

    def ported(self, code: str) -> str:
        return code.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")

    def run(self, code: str, lang: str, timeout: float = RUN_S) -> subprocess.CompletedProcess[str]:
        """Runs ``code`` (bash or Python) here; a run past ``timeout`` is killed with
        everything it started, and fails the test."""
        argv = ["bash", "-c", self.ported(code)]
        if lang == "python":
            argv = [str(REPO / ".venv" / "bin" / "python"), "-c", self.ported(code)]
        proc = subprocess.Popen(
            argv,
            cwd=self.root,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"ran past {timeout:.0f}s (stalled):\n{code}\n{out[-2000:]}{err[-2000:]}")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    log: Path
    url: str


def serve(scratch: Scratch, block: Block, name: str) -> Iterator[Server]:
    """Runs ``block`` (its set-up lines, then ``exec proxima serve``) in the background until
    the generator is closed; yields once the server is ready."""
    lines = block.code.replace("\\\n", " ").splitlines()
    (at,) = [i for i, line in enumerate(lines) if "proxima serve" in line]
    script = "\n".join([*lines[:at], f"exec {lines[at]}"])
    log = scratch.root / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", scratch.ported(script)],
            cwd=scratch.root,
            env=scratch.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{scratch.port}"
    deadline = time.monotonic() + 600  # make demo-model converts the model once (~90 s)
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "proxima serve did not become healthy"
            try:
                if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield Server(proc, log, url)
    finally:  # also when it never became ready
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    server_block, client = section_blocks("Quick start")
    scratch = Scratch(tmp_path)
    server = serve(scratch, server_block, "quick-start")
    next(server)
    try:
        done = scratch.run(client.code, "python", timeout=300)
    finally:
        server.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    versions = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 (a printed list of ints)
    assert versions and set(versions) == {0}


# ------------------------------------------------------------------------------ harnesses


def session_of(done: subprocess.CompletedProcess[str]) -> str:
    found = re.findall(r"^README_TEST_(KEY|SESSION)=(\S+)$", done.stdout, re.M)
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    return found[-1][1]


async def session_turns(db: str, marker: str) -> list[Any]:
    store = await Store.open(db)
    try:
        if marker.startswith("sk-"):
            session = await store.get_session_by_key_hash(api_key_hash=hash_key(marker))
            assert session is not None
            marker = session.id
        return await store.list_completions(session_id=marker)
    finally:
        await store.close()


def check_turns(turns: list[Any], name: str) -> None:
    assert turns, f"{name}: no turn recorded"
    by_id = {t.id: t for t in turns}
    for t in turns:
        n = len(t.output_ids)
        assert 0 < n <= CAP, f"{name}: {n} tokens"
        assert len(t.output_logprobs) == len(t.output_versions) == n
        assert t.sampling["max_tokens"] <= CAP
        assert len(t.prompt_ids) + n <= 8192
        parent = by_id.get(t.parent_id) if t.parent_id else None
        if parent is not None:  # a turn that extends another does so token-exactly
            prefix = parent.prompt_ids + parent.output_ids
            assert t.prompt_ids[: len(prefix)] == prefix, f"{name}: turn {t.id}"


def rejected_requests(log: Path) -> list[str]:
    """Request-log lines with a 4xx or 5xx status (the log is JSON lines by default)."""
    return [
        line
        for line in log.read_text().splitlines()
        if "proxima.access" in line and re.search(r'"status": ?[45]\d\d\b', line)
    ]


def harness_runs(blocks: list[Block]) -> dict[str, tuple[str, str]]:
    """Each harness's snippet (with the session block before a bash one), by harness."""
    session, toml, codex, claude, agents, mini = blocks
    assert "/rl/sessions" in session.code and toml.lang == "toml"
    marker = '\necho "README_TEST_KEY=$KEY"\n'
    runs = {
        "codex": ("bash", session.code + codex.code + marker),
        "claude": ("bash", session.code + claude.code + marker),
        "agents-sdk": (  # the session is printed at exit: also when the run raises
            "python",
            "import atexit\n"
            'atexit.register(lambda: print("README_TEST_SESSION=" + globals()["s"]["session_id"]))\n'
            + agents.code,
        ),
        "mini-swe-agent": ("bash", session.code + mini.code + marker),
    }
    assert "codex exec" in codex.code and "claude -p" in claude.code
    assert "Runner.run" in agents.code and "mini " in mini.code
    return runs


def test_harnesses_run_as_written_on_the_demo_model(tmp_path: Path) -> None:
    server_block, *rest = section_blocks("Harnesses")
    scratch = Scratch(tmp_path)
    (scratch.home / ".codex").mkdir()
    (scratch.home / ".codex" / "config.toml").write_text(scratch.ported(rest[1].code))
    runs = harness_runs(rest)
    # The serve block's exports (PATH to the harnesses) hold in the shell that runs them.
    lines = server_block.code.splitlines()
    exports = "".join(line + "\n" for line in lines if line.startswith("export "))
    server = serve(scratch, server_block, "harnesses")
    started = next(server)
    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            futures = {
                name: pool.submit(scratch.run, exports + code if lang == "bash" else code, lang)
                for name, (lang, code) in runs.items()
            }
            results = {name: f.result() for name, f in futures.items()}
    finally:
        server.close()
    failures = []
    for name, done in results.items():
        turns = asyncio.run(session_turns(scratch.db, session_of(done)))
        check_turns(turns, name)
        said = done.stdout + done.stderr
        # A non-zero exit only in the harness's own words for a reply cut at the cap, and
        # only when its last turn was cut there.
        cut = CUT_AT_CAP.get(name)
        last = max(turns, key=lambda t: t.created_at)
        cut_there = cut is not None and cut in said and len(last.output_ids) == CAP
        if done.returncode != 0 and not cut_there:
            failures.append(f"{name} exited {done.returncode}: {said[-3000:]}")
    assert not failures, "\n\n".join(failures)
    assert not rejected_requests(started.log), rejected_requests(started.log)[:5]
