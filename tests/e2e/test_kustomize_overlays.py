"""deploy/kubernetes as kustomize renders it: the base and every overlay start.

Rendered by `kubectl kustomize` when it is on PATH, else by tests/helpers/kustomize_lite.py
(checked against kubectl when both are there). In every rendering each setting
that names a file has a volume that provides that file (and not an optional
one: a named file that is missing stops the proxy, exit status 2), the probes
and the PodMonitor use declared ports, and the dashboard and the alert rules
query only metrics a running proxy exports, read from its live /metrics.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT, chat, config_for, eventually, free_port, running_proxy
from helpers.kustomize_lite import by_identity, render_kubectl, render_lite
from lowproxy.config import SETTINGS, load_config
from lowproxy.demo import start_pair
from lowproxy.routes import HEALTH_PATHS

KUBERNETES = Path(ROOT) / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAYS = sorted(path.parent for path in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
RENDERINGS = [BASE, *OVERLAYS]
KUBECTL = shutil.which("kubectl")
FILE_SETTINGS = {s.env for s in SETTINGS if s.env.endswith("_FILE")}
# Labels Prometheus puts on every series of a PodMonitor target.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance"}


def render(directory: Path) -> list[dict[str, Any]]:
    return render_kubectl(KUBECTL, directory) if KUBECTL else render_lite(directory)


def the(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


def pod_and_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = the(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "lowproxy"]
    return pod, container


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"] if "value" in item}


def test_there_are_the_overlays_the_readme_names() -> None:
    names = {path.name for path in OVERLAYS}
    assert {"https-backends", "prometheus-operator"} <= names
    readme = (KUBERNETES / "README.md").read_text()
    for directory in RENDERINGS:
        assert f"kubectl apply -k {directory.relative_to(ROOT)}" in readme, directory


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH")
@pytest.mark.parametrize("directory", RENDERINGS, ids=lambda p: p.name)
def test_the_lite_renderer_agrees_with_kubectl(directory: Path) -> None:
    assert KUBECTL is not None
    assert by_identity(render_lite(directory)) == by_identity(render_kubectl(KUBECTL,
                                                                              directory))


@pytest.mark.parametrize("directory", RENDERINGS, ids=lambda p: p.name)
def test_every_file_a_setting_names_is_mounted(directory: Path) -> None:
    pod, container = pod_and_container(render(directory))
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    env = literal_env(container)
    load_config([], environ=env)  # every value parses
    named = {name: path for name, path in env.items() if name in FILE_SETTINGS and path}
    for name, path in named.items():
        mounts = [m for m in container["volumeMounts"]
                  if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1, f"{name}={path}: no single volume mount holds it"
        (mount,) = mounts
        source = volumes[mount["name"]]
        kind = "secret" if "secret" in source else "configMap"
        assert kind in source, f"{name}: {mount['name']} is not a Secret or ConfigMap"
        assert source[kind].get("optional") is not True, \
            f"{name}: an optional volume leaves the file missing and the proxy exits 2"
        relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
        assert relative in [item["path"] for item in source[kind]["items"]], (name, path)
    # No volume is mounted that nothing reads, and https backends come with a CA.
    urls = env["PD_PROXY_PREFILL_URL"] + env["PD_PROXY_DECODE_URL"]
    assert ("https://" in urls) == ("PD_PROXY_CA_FILE" in named), directory.name


def test_the_base_talks_plain_http_and_names_no_file() -> None:
    _, container = pod_and_container(render(BASE))
    env = literal_env(container)
    assert env["PD_PROXY_PREFILL_URL"].startswith("dns+http://")
    assert not {name for name in env if name in FILE_SETTINGS}


@pytest.mark.parametrize("directory", RENDERINGS, ids=lambda p: p.name)
def test_probes_and_scrapes_use_the_declared_metrics_port(directory: Path) -> None:
    objects = render(directory)
    pod, container = pod_and_container(objects)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    metrics_port = int(literal_env(container)["PD_PROXY_METRICS_PORT"])
    assert ports["metrics"] == metrics_port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and (path in HEALTH_PATHS or path == "/readyz")
        # The metrics port stays plain HTTP when the main port turns HTTPS.
        assert get["port"] in ("metrics", metrics_port), probe
        assert get.get("scheme", "HTTP") == "HTTP"
    annotations = the(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    for monitor in [obj for obj in objects if obj["kind"] == "PodMonitor"]:
        labels = the(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports and ports[endpoint["port"]] == metrics_port
            assert endpoint["path"] == "/metrics"
            assert endpoint["honorLabels"] is True  # lowproxy's own "endpoint" label
    assert pod["terminationGracePeriodSeconds"] > 0


# -- the queries against a live /metrics


def prometheus_objects() -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / "prometheus-operator")


def dashboard() -> dict[str, Any]:
    objects = prometheus_objects()
    (config_map,) = [obj for obj in objects if obj["kind"] == "ConfigMap"
                     and obj["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    (text,) = config_map["data"].values()
    return json.loads(text)


def dashboard_queries() -> list[str]:
    board = dashboard()
    queries = [target["expr"] for panel in board["panels"]
               for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def alert_queries() -> dict[str, str]:
    rule = the(prometheus_objects(), "PrometheusRule")
    return {r["alert"]: r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]}


GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?")
KEYWORDS = {"and", "or", "unless", "bool", "offset"}


def selectors(query: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The metric names a PromQL query (or label_values()) reads, each with the
    labels its matchers name; and the labels its by/on clauses name."""
    grouped = {label.strip() for labels in GROUPING.findall(query)
               for label in labels.split(",") if label.strip()}
    text = GROUPING.sub(" ", query)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges: [5m], [$__rate_interval]
    text = re.sub(r"(?<![A-Za-z0-9_])[0-9][0-9.e]*", " ", text)  # numbers
    if text.strip().startswith("label_values("):
        name, label = text.strip()[len("label_values("):-1].split(",")
        return [(name.strip(), {label.strip()})], set()
    found = []
    for match in SELECTOR.finditer(text):
        name, matchers, call = match.groups()
        if call or name in KEYWORDS:
            continue
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""))
        found.append((name, labels))
    return found, grouped


def test_the_query_parser_reads_names_labels_and_groupings() -> None:
    found, grouped = selectors('histogram_quantile(0.99, sum by (namespace, le) '
                               '(rate(a_seconds_bucket{x="1", y=~"[45].."}[5m]))) > 5 '
                               'or b_total * 0')
    assert found == [("a_seconds_bucket", {"x", "y"}), ("b_total", set())]
    assert grouped == {"namespace", "le"}


def live_families(text: str) -> dict[str, set[str]]:
    """Every sample name in a /metrics text, with the label names it carries."""
    families: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', line.split(" ")[0]))
            families.setdefault(name, set()).update(labels)
    return families


async def live_metrics() -> dict[str, set[str]]:
    """A proxy over demo backends after traffic that fills every family the
    dashboard reads: Mooncake (bootstrap queries), a dead second prefill
    (failures), active health checks, a short prompt skipped, cached tokens."""
    prefill, decode = await start_pair(prompt_tokens_details=True)
    dead = f"http://127.0.0.1:{free_port()}"
    prefills = [f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}", dead]
    config = config_for(prefills, decode.url, kv_protocol="mooncake", health_interval=0.2,
                        mooncake_bootstrap_port=prefill.bootstrap_port,
                        min_prefill_prompt_bytes=20)
    long_prompt = [{"role": "user", "content": "tell me a long story " * 8}]
    try:
        async with running_proxy(config) as running:
            for _ in range(4):
                reply = await running.request("POST", "/v1/chat/completions",
                                              chat(messages=long_prompt))
                assert reply.status == 200
            assert (await running.request("POST", "/v1/chat/completions", chat())).status == 200
            assert (await running.request("POST", "/v1/nothing", raw_body=b"[")).status == 400
            failures = running.proxy.metrics.endpoint_failures

            async def dead_one_counted() -> bool:  # a request's or a health check's
                return bool(failures.values)

            await eventually(dead_one_counted, what="a failure of the dead prefill")
            reply = await running.request("GET", "/metrics")
            assert reply.status == 200
            return live_families(reply.body.decode())
    finally:
        await prefill.close()
        await decode.close()


async def test_dashboard_and_alerts_query_only_exported_metrics() -> None:
    live = await live_metrics()
    queries = dashboard_queries() + list(alert_queries().values())
    read: set[str] = set()
    for query in queries:
        found, grouped = selectors(query)
        assert found, f"no metric in {query!r}"
        labels_here: set[str] = set()
        for name, labels in found:
            assert name in live, f"{name} (in {query!r}) is not in a live /metrics"
            unknown = labels - live[name] - TARGET_LABELS
            assert not unknown, f"{name} has no label {sorted(unknown)} ({query!r})"
            labels_here |= live[name]
            read.add(name)
        unknown = grouped - labels_here - TARGET_LABELS - {"le"}
        assert not unknown, f"grouping by {sorted(unknown)}: no such label in {query!r}"
    # What the issue asks the dashboard to show is there.
    for wanted in ("lowproxy_requests_total", "lowproxy_endpoint_requests_total",
                   "lowproxy_endpoint_failures_total", "lowproxy_decode_first_byte_seconds_bucket",
                   "lowproxy_prefill_duration_seconds_bucket", "lowproxy_prefill_legs_total",
                   "lowproxy_endpoint_health", "lowproxy_requests_in_flight",
                   "lowproxy_prefill_cached_tokens_total", "lowproxy_prefill_prompt_tokens_total"):
        assert wanted in read, wanted
    assert set(alert_queries()) == {"LowproxyNoHealthyDecode", "LowproxyPrefillFailureRate",
                                    "LowproxyTTFTP99High"}


def test_dashboard_panels_are_well_formed() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in board["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for panel in board["panels"]:
        position = panel["gridPos"]
        assert 0 <= position["x"] and position["x"] + position["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]


def test_the_peers_overlay_names_a_headless_service_over_the_proxy_pods() -> None:
    """PD_PROXY_PEERS reaches every ready proxy pod on the port its path is on."""
    objects = render(KUBERNETES / "overlays" / "peers")
    pod, container = pod_and_container(objects)
    config, _ = load_config([], environ=literal_env(container))
    (peer,) = config.peers
    assert peer.discover and peer.scheme == "http"
    (service,) = [obj for obj in objects if obj["kind"] == "Service"
                  and obj["metadata"]["name"] == peer.host]
    assert service["spec"]["clusterIP"] == "None"  # headless: every pod's address
    labels = the(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == peer.port == int(literal_env(container)["PD_PROXY_PORT"])
    assert config.prefill_policy == "cache-aware"  # peers need it (checked at start)
