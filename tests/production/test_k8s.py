"""``deploy/k8s`` holds together, checked offline against Kubernetes' own schemas.

Every manifest is validated in strict mode (unknown fields are errors) by
``kubernetes-validate``, which bundles the OpenAPI schemas of each Kubernetes
release; the KubeRay ``RayCluster`` (a custom resource, no schema there) has
its pod templates validated as core ``PodTemplate``s and its own fields
checked here. Commands that start with ``proxima`` are parsed by the real
argument parser (``$(VAR)`` expanded the way the kubelet does), and the
wiring (Services to pods and ports, backends to the SGLang StatefulSet,
volumes, the trainer's config) is followed name by name.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from fastapi.routing import APIRoute
from proxima.proxy.api import health
from proxima.proxy.config import ENV_PREFIX, Settings
from proxima.trainer.config import load_config

from proxima.cli import build_parser, trainer_db_from_env

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest minor still in common managed offerings, and the newest the package knows.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.latest_version())
PINNED_IMAGE = re.compile(r"^[a-z0-9./-]+:v?\d+\.\d+(\.\d+)?(-[a-z0-9.-]+)?$")
WORKLOADS = {"Deployment", "StatefulSet"}
# What the documented Secret holds (kustomization.yaml's header); URLs stand in for the values.
SECRET = {
    "admin-token": "admin-token-value",
    "postgres-password": "pw",
    "database-url": "postgresql://proxima:pw@postgres:5432/proxima",
}


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


DOCS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(owner, pod template) of every workload and of the RayCluster's groups."""
    out = [(d["metadata"]["name"], d["spec"]["template"]) for d in DOCS if d["kind"] in WORKLOADS]
    for ray in (d for d in DOCS if d["kind"] == "RayCluster"):
        out.append((f"{ray['metadata']['name']}/head", ray["spec"]["headGroupSpec"]["template"]))
        for group in ray["spec"]["workerGroupSpecs"]:
            out.append((f"{ray['metadata']['name']}/{group['groupName']}", group["template"]))
    return out


def _containers() -> list[tuple[str, dict[str, Any]]]:
    return [(owner, c) for owner, t in _pod_templates() for c in t["spec"]["containers"]]


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment, Secret references resolved from :data:`SECRET`."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "proxima", f"{var['name']}: unknown Secret {ref['name']}"
            env[var["name"]] = SECRET[ref["key"]]
    return env


def _argv(container: dict[str, Any]) -> list[str]:
    """command + args with ``$(VAR)`` expanded from the container's env, as the kubelet does."""
    env = _env(container)
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]

    def expand(arg: str) -> str:
        def one(m: re.Match[str]) -> str:
            assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
            return env[m.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    return [expand(a) for a in argv]


def _parse_proxima(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "proxima"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{' '.join(argv)}` is not a valid proxima command line") from exc


def _container(workload: str) -> dict[str, Any]:
    doc = next(d for d in DOCS if d["kind"] in WORKLOADS and d["metadata"]["name"] == workload)
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version: str) -> None:
    kinds = set()
    for doc in DOCS:
        kinds.add(doc["kind"])
        if doc["kind"] == "RayCluster":
            continue  # a custom resource: below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc}") from exc
    assert {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "ConfigMap"} <= kinds
    assert "RayCluster" in kinds
    for owner, template in _pod_templates():
        pod = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": owner.replace("/", "-")},
            "template": template,
        }
        try:
            kubernetes_validate.validate(pod, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{owner}: {exc}") from exc


def test_a_broken_manifest_is_caught() -> None:
    """The validator is not a no-op: a misspelled field and a wrong type are errors."""
    proxy = _one("Deployment", "proxima-proxy")
    bad = yaml.safe_load(yaml.safe_dump(proxy))
    bad["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(proxy))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (image,) = kustomization["images"]
    assert image["name"] == "proxima" and image["newTag"] == version


# --------------------------------------------------------------------------- images


def test_images_are_pinned_and_match_compose() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for owner, container in _containers():
        image = container["image"]
        assert PINNED_IMAGE.match(image), f"{owner}: {image} is not pinned"
        if image.startswith("proxima:"):
            assert image == f"proxima:{version}", owner
    for name in ("postgres", "sglang"):
        # Compose's ${VAR:-default} resolved to its default.
        compose_image = re.sub(r"\$\{[A-Za-z_]+:-([^}]*)\}", r"\1", compose[name]["image"])
        assert _container(name)["image"] == compose_image, name


# --------------------------------------------------------------------------- wiring


def test_services_reach_their_pods_and_ports() -> None:
    services = [d for d in DOCS if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"postgres", "sglang", "proxima"}
    for service in services:
        selector = service["spec"]["selector"]
        matches = [
            t for _, t in _pod_templates() if selector.items() <= t["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, f"Service {service['metadata']['name']} selects {len(matches)}"
        ports = {
            p["name"]: p["containerPort"]
            for c in matches[0]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, service["metadata"]["name"]
            assert ports[port["targetPort"]] == port["port"], service["metadata"]["name"]
    for doc in DOCS:
        if doc["kind"] in WORKLOADS:
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if doc["kind"] == "StatefulSet":
            governing = _one("Service", doc["spec"]["serviceName"])
            assert governing["spec"]["clusterIP"] == "None"  # per-pod DNS names


def test_proxy_replicas_talk_to_every_sglang_server_and_one_store() -> None:
    args = _parse_proxima(_argv(_container("proxima-proxy")))
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000
    sglang = _one("StatefulSet", "sglang")
    port = int(_argv(_container("sglang"))[_argv(_container("sglang")).index("--port") + 1])
    expected = [f"http://sglang-{i}.sglang:{port}" for i in range(sglang["spec"]["replicas"])]
    assert args.backend == expected
    assert _one("Deployment", "proxima-proxy")["spec"]["replicas"] >= 2
    # The store's URL (its password in it) is the environment's, which `proxima serve` reads
    # as the `db` setting: never on the command line.
    env = _env(_container("proxima-proxy"))
    assert args.db is None and "db" in Settings.model_fields
    db = urlsplit(env[ENV_PREFIX + "DB"])
    assert db.scheme.startswith("postgresql") and db.hostname == "postgres" and db.port == 5432
    postgres_env = _env(_container("postgres"))
    assert (
        db.path == "/" + postgres_env["POSTGRES_DB"]
        and db.username == postgres_env["POSTGRES_USER"]
    )
    assert env["PROXIMA_ADMIN_TOKEN"] == SECRET["admin-token"]
    service = _one("Service", "proxima")
    assert (
        env["PROXIMA_PUBLIC_BASE_URL"] == f"http://proxima:{service['spec']['ports'][0]['port']}/v1"
    )
    # Agents and sandboxes reach the Service: /metrics and /health's details need the token.
    assert env[ENV_PREFIX + "PRIVATE_OBSERVABILITY"] == "true"


def test_proxy_liveness_is_the_process_and_readiness_the_store_and_backends() -> None:
    """A Postgres or SGLang outage takes replicas out of the Service, never restarts them."""
    proxy = _container("proxima-proxy")
    routes = {route.path for route in health.router.routes if isinstance(route, APIRoute)}
    assert {"/health/live", "/health/ready"} <= routes
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert proxy["startupProbe"]["httpGet"]["path"] == "/health/live"
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    for probe in ("livenessProbe", "startupProbe", "readinessProbe"):
        assert proxy[probe]["httpGet"]["port"] == "http", probe
    # Started, a proxy that stops answering is restarted within a minute, not at once.
    live = proxy["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30


def test_no_secret_on_a_command_line() -> None:
    """Command lines are readable by every process on a node (``ps``): the database URL and
    the admin token reach the processes through the environment (from the Secret)."""
    secrets = set(SECRET.values())
    for owner, container in _containers():
        argv = _argv(container)
        assert not {"--db", "--admin-token"} & set(argv), owner
        for arg in argv:
            assert not any(secret in arg for secret in secrets), (owner, arg)
    for name in ("proxima-proxy", "proxima-trainer"):
        assert _env(_container(name))[ENV_PREFIX + "DB"] == SECRET["database-url"], name


def _dockerfile_user() -> int:
    """The uid of docker/Dockerfile's last USER (numeric: runAsNonRoot checks it)."""
    lines = (ROOT / "docker" / "Dockerfile").read_text().splitlines()
    (user, *_) = [ln.split()[1] for ln in lines if ln.startswith("USER ")][-1:]
    return int(user.split(":")[0])


def test_proxima_pods_run_unprivileged_with_cpu_and_memory_limits() -> None:
    uid = _dockerfile_user()
    assert uid != 0
    proxima_pods = [
        (owner, template)
        for owner, template in _pod_templates()
        if any(c["image"].startswith("proxima:") for c in template["spec"]["containers"])
    ]
    assert {owner for owner, _ in proxima_pods} >= {"proxima-proxy", "proxima-trainer"}
    for owner, template in proxima_pods:
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid, owner
        assert pod["fsGroup"] == uid, owner  # volumes it writes (/weights) are its group's
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", owner
        for container in template["spec"]["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, owner
            assert context["capabilities"]["drop"] == ["ALL"], owner
            limits = container["resources"]["limits"]
            assert {"cpu", "memory"} <= set(limits), owner
            requests = container["resources"].get("requests", {})
            for key in ("cpu", "memory"):  # a request above its limit is refused
                if key in requests:
                    assert _quantity(requests[key]) <= _quantity(limits[key]), (owner, key)
    postgres = _container("postgres")["resources"]["limits"]
    assert {"cpu", "memory"} <= set(postgres)


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity (``2``, ``500m``, ``8Gi``) as a number."""
    text = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_trainer_wiring_volumes_and_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _container("proxima-trainer")
    args = _parse_proxima(_argv(trainer))
    proxy_args = _parse_proxima(_argv(_container("proxima-proxy")))
    assert args.command == "trainer" and args.db is None
    url = urlsplit(args.proxy)
    assert url.hostname == "proxima" and url.port == proxy_args.port
    assert _env(trainer)["PROXIMA_ADMIN_TOKEN"] == SECRET["admin-token"]
    assert _one("Deployment", "proxima-trainer")["spec"]["strategy"]["type"] == "Recreate"
    # The trainer writes the weights where every SGLang server reads them, at the same path.
    claims = {d["metadata"]["name"] for d in DOCS if d["kind"] == "PersistentVolumeClaim"}
    mounts: dict[str, dict[str, tuple[str, bool]]] = {}
    for owner, template in _pod_templates():
        volumes = template["spec"].get("volumes", [])
        for v in volumes:
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (owner, v)
            if "configMap" in v:
                _one("ConfigMap", v["configMap"]["name"])
        by_name = {v["name"]: v for v in volumes}
        for doc in DOCS:  # a StatefulSet's per-pod claims
            if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == owner:
                for claim in doc["spec"].get("volumeClaimTemplates", []):
                    name = claim["metadata"]["name"]
                    by_name[name] = {"persistentVolumeClaim": {"claimName": f"{name} (per pod)"}}
        for c in template["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                source = by_name[m["name"]]
                claim = source.get("persistentVolumeClaim", {}).get("claimName")
                mounts.setdefault(owner, {})[m["mountPath"]] = (
                    claim or m["name"],
                    m.get("readOnly", False),
                )
    output_dir = str(args.output_dir)
    assert mounts["proxima-trainer"][output_dir] == ("proxima-weights", False)
    assert mounts["sglang"][output_dir] == ("proxima-weights", True)
    model = _argv(_container("sglang"))[_argv(_container("sglang")).index("--model-path") + 1]
    assert str(args.model) == str(proxy_args.model) == model
    for owner in ("sglang", "proxima-proxy", "proxima-trainer"):
        assert mounts[owner]["/models"] == ("proxima-models", True), owner
    # The mounted config is a valid trainer config that leaves B and eta to the proxy.
    config_map = _one("ConfigMap", "proxima-trainer")
    mount_dir = next(m["mountPath"] for m in trainer["volumeMounts"] if m["name"] == "config")
    (name,) = config_map["data"]
    assert str(args.config) == f"{mount_dir}/{name}"
    (tmp_path / name).write_text(config_map["data"][name])
    config = load_config(tmp_path / name)
    # No --db, none in the config: `proxima trainer` takes PROXIMA_DB, the proxy's store.
    assert config.connection.db_url is None
    monkeypatch.setenv(ENV_PREFIX + "DB", _env(trainer)[ENV_PREFIX + "DB"])
    args.config = tmp_path / name
    trainer_db_from_env(args)
    assert args.db == _env(_container("proxima-proxy"))[ENV_PREFIX + "DB"]
    assert config.device.startswith("cuda")
    assert not {"batch_size", "max_staleness"} & config.model_fields_set
    for owner in ("sglang", "proxima-trainer"):
        limits = _container(owner)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1, owner


def test_ray_cluster_runs_the_proxima_image_at_the_pinned_ray_version() -> None:
    ray = _one("RayCluster", "proxima-agents")
    assert ray["apiVersion"] == "ray.io/v1"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (pin,) = extras["ray"]
    assert pin == f"ray=={ray['spec']['rayVersion']}"
    head = ray["spec"]["headGroupSpec"]
    # KubeRay passes rayStartParams to `ray start` as --key=value strings.
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head["rayStartParams"]["num-cpus"] == "0"  # agents run on the workers only
    (group,) = ray["spec"]["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for _, container in _containers():
        if container["name"].startswith("ray-"):
            assert container["image"] == f"proxima:{version}"
    # The controller on the head opens sessions with the admin token.
    head_container = head["template"]["spec"]["containers"][0]
    assert _env(head_container)["PROXIMA_ADMIN_TOKEN"] == SECRET["admin-token"]
    assert {p["containerPort"] for p in head_container["ports"]} >= {6379, 8265, 10001}
