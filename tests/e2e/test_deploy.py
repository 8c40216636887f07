"""deploy/: the Kubernetes manifests and the Dockerfile name only what exists.

Every variable is a lowproxy setting whose value parses, every port and probe
path is one the proxy serves, the .pyz is mounted where the command runs it,
and the grace period outlasts the drain. These read the kustomize base as
written; tests/test_kustomize_overlays.py renders the base and its overlays.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from helpers import ROOT
from lowproxy.config import SETTINGS, load_config, parse_endpoint
from lowproxy.pack import DEFAULT_OUTPUT
from lowproxy.routes import HEALTH_PATHS

DEPLOY = Path(ROOT) / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
SETTING_ENV = {setting.env for setting in SETTINGS}
DEFAULTS = {setting.env: setting.default for setting in SETTINGS}
IMAGE = "python:3.12-slim"
PYZ_PATH = "/opt/lowproxy/lowproxy.pyz"
COMMAND = ["python3", "-I", "-S", PYZ_PATH]


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(BASE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        with open(path) as handle:
            found += [doc for doc in yaml.safe_load_all(handle) if doc]
    return found


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


def deployment() -> dict[str, Any]:
    (found,) = of_kind("Deployment")
    return found


def container() -> dict[str, Any]:
    (found,) = deployment()["spec"]["template"]["spec"]["containers"]
    return found


def env_values() -> dict[str, str]:
    """The container's variables; a value from a Secret stands in as a placeholder."""
    values = {}
    for item in container()["env"]:
        values[item["name"]] = item["value"] if "value" in item else "from-secret"
    return values


def setting(env: dict[str, str], name: str) -> str:
    return env.get(name, DEFAULTS[name])


def test_manifests_parse_and_are_known_kinds() -> None:
    docs = documents()
    assert len(docs) >= 5
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"]
    assert sorted({doc["kind"] for doc in docs}) == ["Deployment", "PodDisruptionBudget",
                                                      "Service"]


def test_every_variable_is_a_setting_and_its_value_parses() -> None:
    env = env_values()
    unknown = set(env) - SETTING_ENV - {"ADMIN_API_KEY"}
    assert not unknown, f"not lowproxy settings: {sorted(unknown)}"
    assert len({item["name"] for item in container()["env"]}) == len(container()["env"])
    config, _ = load_config([], environ=env)  # raises ConfigError on a bad value
    assert config.host == "0.0.0.0"
    assert all(endpoint.discover for endpoint in config.prefill + config.decode)
    assert not config.ca_file  # plain-http backends as shipped (overlays/https-backends)


def test_image_command_and_pyz_mount_agree() -> None:
    spec = container()
    assert spec["image"] == IMAGE
    assert spec["command"] == COMMAND
    assert "args" not in spec
    (mount,) = [m for m in spec["volumeMounts"] if m["mountPath"] == PYZ_PATH]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in deployment()["spec"]["template"]["spec"]["volumes"]}
    config_map = volumes[mount["name"]]["configMap"]
    # kubectl create configmap lowproxy-pyz --from-file=lowproxy.pyz=dist/lowproxy.pyz
    assert config_map["name"] == "lowproxy-pyz"
    (item,) = config_map["items"]
    assert item["key"] == "lowproxy.pyz"
    # subPath: the archive a process runs never changes under it.
    assert mount["subPath"] == item["path"]


def test_container_port_is_the_configured_port_and_services_target_it() -> None:
    env = env_values()
    port = int(setting(env, "PD_PROXY_PORT"))
    ports = {p["name"]: p for p in container()["ports"]}
    assert set(ports) == {"http", "metrics"}
    http = ports["http"]
    assert http["containerPort"] == port
    assert ports["metrics"]["containerPort"] == int(setting(env, "PD_PROXY_METRICS_PORT"))
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment()["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Clients only: /metrics labels name backends, so the metrics port stays off it.
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in (http["name"], port)


def test_backend_urls_name_the_headless_services() -> None:
    env = env_values()
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    for variable in ("PD_PROXY_PREFILL_URL", "PD_PROXY_DECODE_URL"):
        (endpoint,) = [parse_endpoint(u) for u in env[variable].split(",")]
        assert endpoint.discover, f"{variable} should use dns+http:// for a headless Service"
        service = services[endpoint.host]
        assert service["spec"]["clusterIP"] == "None"
        assert endpoint.port in [p["port"] for p in service["spec"]["ports"]]


def test_probes_use_paths_the_proxy_serves() -> None:
    spec = container()
    names = {p["name"]: p["containerPort"] for p in spec["ports"]}
    liveness, readiness = spec["livenessProbe"]["httpGet"], spec["readinessProbe"]["httpGet"]
    assert liveness["path"] == "/healthz" and liveness["path"] in HEALTH_PATHS
    assert readiness["path"] == "/readyz"
    for probe in (liveness, readiness):
        assert probe["port"] in names or probe["port"] in names.values()


def test_grace_period_outlasts_prestop_and_drain() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    drain = float(setting(env_values(), "PD_PROXY_DRAIN_SECONDS"))
    pre_stop = container().get("lifecycle", {}).get("preStop", {}).get("exec", {})
    command = pre_stop.get("command", [])
    sleep = float(command[1]) if command[:1] == ["sleep"] else 0.0
    assert pod["terminationGracePeriodSeconds"] > drain + sleep


def test_pod_is_non_root_read_only_and_bounded() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    spec = container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["enableServiceLinks"] is False  # no injected *_PORT variables
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(spec["resources"][bound])


def test_admin_key_comes_from_a_secret_not_a_literal() -> None:
    (admin,) = [item for item in container()["env"] if item["name"] == "ADMIN_API_KEY"]
    assert "value" not in admin
    assert admin["valueFrom"]["secretKeyRef"]["name"]


# -- the Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def test_dockerfile_copies_what_pack_writes_and_runs_it_the_same_way() -> None:
    pairs = dockerfile()
    assert pairs[0] == ("FROM", IMAGE)
    (copy,) = [args for instruction, args in pairs if instruction == "COPY"]
    source, destination = shlex.split(copy)
    assert source == DEFAULT_OUTPUT
    assert destination == PYZ_PATH
    (entrypoint,) = [args for instruction, args in pairs if instruction == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == COMMAND  # JSON exec form
    (user,) = [args for instruction, args in pairs if instruction == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    (expose,) = [args for instruction, args in pairs if instruction == "EXPOSE"]
    env_args = " ".join(args for instruction, args in pairs if instruction == "ENV")
    env = dict(item.split("=", 1) for item in shlex.split(env_args))
    assert set(env) <= SETTING_ENV
    assert int(expose) == int(setting(env, "PD_PROXY_PORT"))
    load_config([], environ=env)


def test_readme_commands_match_the_manifests() -> None:
    readme = (KUBERNETES / "README.md").read_text()
    assert ("kubectl create configmap lowproxy-pyz "
            f"--from-file=lowproxy.pyz={DEFAULT_OUTPUT}") in readme
    assert f"python -m lowproxy.pack -o {DEFAULT_OUTPUT}" in readme
    assert "kubectl create secret generic lowproxy-upstream-ca --from-file=ca.crt=" in readme
    assert "kubectl apply -k deploy/kubernetes/base" in readme
    assert "kubectl apply -f deploy/kubernetes/" not in readme


def test_readme_mentions_only_real_settings() -> None:
    readme = (KUBERNETES / "README.md").read_text()
    mentioned = set(re.findall(r"\bPD_PROXY_[A-Z_]+", readme))
    assert {"PD_PROXY_WORKERS", "PD_PROXY_DRAIN_SECONDS"} <= mentioned
    assert mentioned <= SETTING_ENV, sorted(mentioned - SETTING_ENV)
