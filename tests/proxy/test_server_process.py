"""``ProxyProcess`` (the ``proxima serve`` child of ``proxima train``, tests and benchmarks)
hands its admin token over in the environment, not on the command line.

``proxima train`` generates a random token (``secrets.token_urlsafe``), which starts with
"-" about one time in 64; passed as ``--admin-token <token>``, argparse took it for a flag
and ``proxima serve`` refused to start. Here a token that starts with "-" starts the proxy,
is the one its admin routes accept, and appears nowhere in its command line.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

TOKEN = "-Xq2-dash-first-token_urlsafe"


def test_a_token_that_starts_with_a_dash_starts_the_proxy_and_stays_off_its_argv(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with ThreadedServer(create_fake_app(FakeBackend())) as backend:
        proxy = LiveProxy(
            tiny_model_dir,
            db_url=f"sqlite:///{tmp_path / 'store.db'}",
            admin_token=TOKEN,
            extra_args=["--backend", backend.url],
            log_path=tmp_path / "serve.log",
        )
        proxy.start(timeout=120)
        try:
            assert proxy.proc is not None
            argv = Path(f"/proc/{proxy.proc.pid}/cmdline").read_bytes().split(b"\0")
            assert not any(TOKEN.encode() in arg for arg in argv), argv
            config = httpx.get(proxy.url + "/admin/config", headers=proxy.admin_headers())
            assert config.status_code == 200, config.text
            wrong = httpx.get(
                proxy.url + "/admin/config", headers={"Authorization": "Bearer wrong"}
            )
            assert wrong.status_code == 401, wrong.text
        finally:
            proxy.stop()
