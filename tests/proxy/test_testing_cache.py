"""``built_once``: the test-model cache that parallel test workers share."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from proxima.proxy.testing.cache import built_once


def _build(staging: Path, log: Path) -> None:
    with open(log, "a") as f:
        f.write("built\n")
    staging.mkdir()
    time.sleep(0.5)  # long enough for the other process to arrive while this one builds
    (staging / "weights").write_text("w")
    (staging / "done").write_text("")


def _want(final: str, log: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    path = built_once(Path(final), lambda s: _build(s, Path(log)), "done")
    out.put((str(path), (path / "weights").read_text()))


def test_two_processes_wanting_one_entry_build_it_once(tmp_path: Path) -> None:
    final, log = tmp_path / "cache" / "model", tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_want, args=(str(final), str(log), out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == [(str(final), "w")] * 2
    assert log.read_text() == "built\n"
    # Only the entry and its lock file are left: no staging directory.
    assert sorted(p.name for p in final.parent.iterdir()) == [".model.lock", "model"]


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path: Path) -> None:
    final = tmp_path / "model"

    def broken(staging: Path) -> None:
        staging.mkdir()
        (staging / "weights").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        built_once(final, broken, "done")
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".model.lock"]

    with pytest.raises(RuntimeError, match="left no done"):
        built_once(final, lambda s: s.mkdir(), "done")
    assert not final.exists()

    # An entry without its marker (say, a copy cut short) is built again, not used.
    final.mkdir()
    (final / "weights").write_text("stale")
    built_once(final, lambda s: _build(s, tmp_path / "log"), "done")
    assert (final / "weights").read_text() == "w"
    assert built_once(final, lambda s: pytest.fail("built twice"), "done") == final
