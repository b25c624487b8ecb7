"""``docker-compose.yml`` holds together: services, wiring, volumes, and real CLI flags.

Docker is not needed: the file is parsed with PyYAML, variables are resolved
with their defaults the way Compose interpolates them, and every command
that starts with ``proxima`` is parsed by the real ``proxima`` argument
parser, so a renamed flag breaks this test, not a deployment. The load
balancer's configuration is checked by the real haproxy (``haproxy -c``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from proxima.proxy.config import ENV_PREFIX, Settings
from proxima.trainer.config import load_config

from proxima.cli import build_parser, trainer_db_from_env

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"postgres", "sglang", "proxy", "lb", "trainer"}
HAPROXY_CFG = ROOT / "docker" / "haproxy.cfg"
# An exact release: name:MAJOR.MINOR[.PATCH][-variant] or name:vX.Y.Z (never a bare major, never latest).
PINNED_IMAGE = re.compile(r"^[a-z0-9./-]+:v?\d+\.\d+(\.\d+)?(-[a-z0-9.-]+)?$")
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR:?error}`` with nothing set in the environment."""

    def one(m: re.Match[str]) -> str:
        op = m.group("op")
        if op in (":-", "-"):
            return m.group("arg")
        assert op in (":?", "?"), (
            f"${{{m.group('name')}}} has no default and is not marked required"
        )
        return (
            f"<{m.group('name')}>"  # the operator must set it; compose refuses to start otherwise
        )

    return _VAR.sub(one, value)


def _resolve(node: Any) -> Any:
    if isinstance(node, str):
        return _interpolate(node)
    if isinstance(node, list):
        return [_resolve(v) for v in node]
    if isinstance(node, dict):
        return {k: _resolve(v) for k, v in node.items()}
    return node


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _resolve(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "use the exec (list) form: no shell re-splitting of arguments"
    return [str(c) for c in command]


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} must appear once in {argv}"
    return argv[argv.index(name) + 1]


def _proxima_subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _parse_proxima(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "proxima"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse exits on an unknown subcommand or flag
        raise AssertionError(f"`{' '.join(argv)}` is not a valid proxima command line") from exc


def test_services_and_dependencies(services: dict[str, Any]) -> None:
    assert set(services) == SERVICES
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services and dep != name, f"{name} depends on unknown {dep}"
            assert spec["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            ), (name, dep)
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep}'s health, which has no check"
                )
    assert set(services["proxy"]["depends_on"]) == {"postgres", "sglang"}
    assert set(services["lb"]["depends_on"]) == {"proxy"}
    assert set(services["trainer"]["depends_on"]) >= {"proxy", "postgres", "lb"}


def test_images_are_pinned(services: dict[str, Any]) -> None:
    for name, service in services.items():
        if "build" in service:
            continue  # our own image, built from docker/Dockerfile
        assert PINNED_IMAGE.match(service["image"]), f"{name}: {service['image']} is not pinned"
    # The Postgres major the tests run against (Debian's postgresql-15).
    assert services["postgres"]["image"].startswith("postgres:15.")
    base = (ROOT / "docker" / "Dockerfile").read_text().split("FROM ", 1)[1].split()[0]
    assert PINNED_IMAGE.match(base) and base.startswith("python:3.11."), base


def test_healthchecks(services: dict[str, Any]) -> None:
    for name in ("postgres", "sglang", "proxy"):
        check = services[name]["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert check.get("retries", 0) >= 3, name
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert "http://127.0.0.1:30000/health" in " ".join(services["sglang"]["healthcheck"]["test"])
    # The proxy is healthy when ready (its store and a backend answer): the load balancer and
    # the trainer start after that.
    assert "http://127.0.0.1:8000/health/ready" in " ".join(
        services["proxy"]["healthcheck"]["test"]
    )


def test_volumes_declared_and_weights_shared(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    declared = set(compose.get("volumes") or {})
    mounts: dict[str, dict[str, str]] = {}  # service -> {container path: source}
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            source, target, *_ = volume.split(":")
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
            else:
                assert source.startswith("/") or (ROOT / source).resolve().is_relative_to(ROOT), (
                    volume
                )
            mounts.setdefault(name, {})[target] = source
    # Weights: the trainer writes where SGLang reads, at the same path in both containers.
    output_dir = _flag(_command(services["trainer"]), "--output-dir")
    assert mounts["trainer"][output_dir] == mounts["sglang"][output_dir] == "weights"
    assert any(v.endswith(f"{output_dir}:ro") for v in services["sglang"]["volumes"])
    # The model directory is the same path for SGLang, the proxy and the trainer.
    model = _flag(_command(services["sglang"]), "--model-path")
    for name in ("proxy", "trainer"):
        assert _flag(_command(services[name]), "--model") == model
    for name in ("sglang", "proxy", "trainer"):
        assert model.startswith(next(t for t in mounts[name] if t == "/models") + "/"), name
    assert "pgdata" in declared and "/var/lib/postgresql/data" in mounts["postgres"]


def test_sglang_service(services: dict[str, Any]) -> None:
    sglang = services["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang")
    argv = _command(sglang)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert _flag(argv, "--port") == "30000" and _flag(argv, "--host") == "0.0.0.0"
    # The version the proxy was verified against, pinned (not :latest).
    assert sglang["image"] == "lmsysorg/sglang:v0.5.23"
    assert _flag(argv, "--weight-version") == "0"
    assert "--incremental-streaming-output" in argv
    (device,) = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_proxima_commands_are_real(services: dict[str, Any]) -> None:
    commands = {
        name: _command(s)
        for name, s in services.items()
        if "command" in s and _command(s)[0] == "proxima"
    }
    assert set(commands) == {"proxy", "trainer"}
    assert "trainer" in _proxima_subcommands(), "proxima trainer is part of the CLI contract"
    for argv in commands.values():
        _parse_proxima(argv)


def test_proxy_wiring(services: dict[str, Any]) -> None:
    args = _parse_proxima(_command(services["proxy"]))
    assert args.command == "serve" and args.host == "0.0.0.0"
    (backend,) = args.backend
    url = urlsplit(backend)
    assert url.hostname == "sglang" and str(url.port) == _flag(
        _command(services["sglang"]), "--port"
    )
    # The store's URL comes from the environment (PROXIMA_DB: the `db` setting), not --db.
    assert args.db is None and "db" in Settings.model_fields
    db = urlsplit(services["proxy"]["environment"][ENV_PREFIX + "DB"])
    assert db.scheme.startswith("postgresql") and db.hostname == "postgres" and db.port == 5432
    assert db.path == "/" + services["postgres"]["environment"]["POSTGRES_DB"]
    assert db.username == services["postgres"]["environment"]["POSTGRES_USER"]
    assert db.password == services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    # No default password: the operator must set one (Compose refuses to start otherwise).
    assert db.password == "<POSTGRES_PASSWORD>"
    # Replicas: no host port and no container name, either of which stops `--scale proxy=N`.
    proxy = services["proxy"]
    assert "ports" not in proxy and "container_name" not in proxy
    assert proxy["expose"] == [str(args.port)] and proxy["deploy"]["replicas"] >= 2
    # The load balancer publishes the port agents use, and forwards to every replica's.
    published = services["lb"]["ports"][0].rsplit(":", 1)[1]
    lb = _haproxy_config()
    assert lb["bind"] == f":{published}"
    # The balancer routes to ready replicas only.
    assert lb["server"] == f"proxy:{args.port}" and lb["health"] == "/health/ready"
    env = proxy["environment"]
    # The admin token is required, never a default baked into the file.
    assert env["PROXIMA_ADMIN_TOKEN"] == "<PROXIMA_ADMIN_TOKEN>"
    assert env["PROXIMA_PUBLIC_BASE_URL"] == f"http://localhost:{published}/v1"
    # Agents reach the proxy: /metrics and /health's details need the admin token.
    assert env[ENV_PREFIX + "PRIVATE_OBSERVABILITY"] == "true"


def test_no_default_password_and_no_secret_on_a_command_line(services: dict[str, Any]) -> None:
    """``ps`` shows command lines to every user of the host: the database URL and the admin
    token reach the processes through the environment, and both must be set."""
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "<POSTGRES_PASSWORD>"
    for name, service in services.items():
        if "command" not in service:
            continue
        argv = _command(service)
        assert not {"--db", "--admin-token"} & set(argv), name
        assert not any("postgresql://" in arg or "<" in arg for arg in argv), (name, argv)
    for name in ("proxy", "trainer"):
        env = services[name]["environment"]
        assert env[ENV_PREFIX + "DB"] == services["proxy"]["environment"][ENV_PREFIX + "DB"]
        assert env["PROXIMA_ADMIN_TOKEN"] == "<PROXIMA_ADMIN_TOKEN>"


def test_resource_limits_and_unprivileged_containers(services: dict[str, Any]) -> None:
    for name in ("proxy", "trainer", "postgres", "lb"):
        limits = services[name]["deploy"]["resources"]["limits"]
        assert _bytes(limits["memory"]) >= 2**30, name
    for name in ("proxy", "postgres", "lb"):
        assert float(services[name]["deploy"]["resources"]["limits"]["cpus"]) >= 1, name
    for name in ("proxy", "trainer"):  # our image: its own unprivileged user, nothing more
        service = services[name]
        assert service.get("user") in (None, "10001", "10001:10001"), name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name


def _bytes(size: str) -> int:
    """A Compose byte value (``512M``, ``8G``)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    unit = size[-1].lower()
    return int(float(size[:-1]) * units[unit]) if unit in units else int(size)


def test_the_trainer_takes_the_store_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``proxima trainer``: --db, else the config file's ``db_url``, else PROXIMA_DB."""
    monkeypatch.setenv(ENV_PREFIX + "DB", "postgresql://from-env/db")
    bare = _parse_proxima(["proxima", "trainer", "--proxy", "http://lb:8000"])
    trainer_db_from_env(bare)
    assert bare.db == "postgresql://from-env/db"
    flag = _parse_proxima(["proxima", "trainer", "--db", "sqlite:///flag.db"])
    trainer_db_from_env(flag)
    assert flag.db == "sqlite:///flag.db"
    config = tmp_path / "trainer.toml"
    config.write_text('[connection]\ndb_url = "sqlite:///file.db"\n')
    from_file = _parse_proxima(["proxima", "trainer", "--config", str(config)])
    trainer_db_from_env(from_file)
    assert from_file.db is None  # the trainer reads the file's
    monkeypatch.delenv(ENV_PREFIX + "DB")
    unset = _parse_proxima(["proxima", "trainer"])
    trainer_db_from_env(unset)
    assert unset.db is None


def _haproxy_config() -> dict[str, str]:
    """The facts the compose file relies on, read from docker/haproxy.cfg."""
    facts: dict[str, str] = {}
    for raw in HAPROXY_CFG.read_text().splitlines():
        words = raw.split("#", 1)[0].split()
        if words[:1] == ["bind"]:
            facts["bind"] = words[1]
        elif words[:1] == ["server-template"]:
            facts["server"] = words[3]
            assert int(words[2]) >= 8, "room for --scale proxy=N"
            assert "check" in words and "resolvers" in words, "replicas found in Docker's DNS"
        elif words[:2] == ["option", "httpchk"]:
            facts["health"] = words[-1]
        elif words[:1] == ["balance"]:
            facts["balance"] = words[1]
    return facts


def test_haproxy_config_is_valid_for_haproxy(services: dict[str, Any]) -> None:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(haproxy).exists(), "haproxy (Debian package) is installed by `make test`"
    check = subprocess.run(
        [haproxy, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Affinity by session (X-Session-Id, else the key): consistent hashing keeps most sessions
    # on their replica when one is added or removed.
    assert _haproxy_config()["balance"] == "hdr(X-Proxima-Affinity)"
    assert "hash-type consistent" in HAPROXY_CFG.read_text()
    mount = next(v for v in services["lb"]["volumes"] if "haproxy.cfg" in v)
    assert mount.startswith("./docker/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg")


def test_trainer_wiring(services: dict[str, Any]) -> None:
    proxy_args = _parse_proxima(_command(services["proxy"]))
    args = _parse_proxima(_command(services["trainer"]))
    assert args.command == "trainer"
    url = urlsplit(args.proxy)
    # Through the load balancer: a weight push through any replica reaches them all.
    assert url.hostname == "lb" and f":{url.port}" == _haproxy_config()["bind"]
    assert args.db is None  # PROXIMA_DB, the proxy's (test_no_default_password_...)
    assert services["trainer"]["environment"]["PROXIMA_ADMIN_TOKEN"] == "<PROXIMA_ADMIN_TOKEN>"
    # The mounted config file is a valid trainer config that leaves the staleness rule's
    # settings to the proxy, which declares both (the trainer reads them from it at start).
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["trainer"]["volumes"]}
    config = load_config(ROOT / mounted[str(args.config)])
    assert config.device.startswith("cuda")
    assert not {"batch_size", "max_staleness"} & config.model_fields_set
    assert proxy_args.train_batch_size is not None and proxy_args.max_staleness is not None
    (device,) = services["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"


def test_dockerfile() -> None:
    lines = [ln.strip() for ln in (ROOT / "docker" / "Dockerfile").read_text().splitlines()]
    steps = [ln for ln in lines if ln and not ln.startswith("#")]
    assert steps[0].startswith("FROM python:3.11.") and steps[0].endswith("-slim-bookworm")
    torch_at = next(i for i, s in enumerate(steps) if s.startswith("RUN pip install torch==2.13.0"))
    project_at = next(i for i, s in enumerate(steps) if s.startswith('RUN pip install ".'))
    assert torch_at < project_at
    # Tensor-parallel training (torchrun + megatron-core), LoRA adapters (peft) and Ray agent
    # workers run from the image.
    assert steps[project_at].startswith('RUN pip install ".[megatron,ray,trainer]"')
    # Not root: a numeric USER (Kubernetes' runAsNonRoot can check it) after the installs,
    # created with that uid, owning what it writes.
    users = [s.split()[1] for s in steps if s.startswith("USER ")]
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and uid != "0"
    assert steps.index(f"USER {users[-1]}") > project_at
    text = "\n".join(steps)
    assert f"--uid {uid}" in text and "chown proxima:proxima /weights /data" in text
    copied = {s.split()[1] for s in steps if s.startswith("COPY")}
    for package in (
        "proxima",
        "proxy",
        "trainer",
        "migrations",
        "agents_examples",
        "pyproject.toml",
    ):
        assert package in copied, package
