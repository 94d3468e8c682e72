"""deploy/kubernetes against real processes: a replica started with the StatefulSet's serving
command line and the router with the Deployment's, each with the environment its pod would have
(the Secret's key, the ConfigMap's model name, the downward API's pod name) and its volumes as
local directories (the tiny model where the init container would have pulled it).

Only what a cluster provides is stood in for: --host and --port become 127.0.0.1 and free ports
(the probes' named ports mapped onto them), and the router's --replica names resolve as cluster
DNS would: pod 0 to the replica, the other pods to ports where nothing listens (not scaled out).
Then every probe and scrape path the manifests name must answer 200 on the port they name, and
every metric the autoscaling rules query must be in the replica's /metrics as Prometheus stores it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from k8s_manifests import (
    KUBERNETES_DIR,
    VARIANTS,
    Pod,
    command_line,
    container,
    container_env,
    find,
    load_documents,
    localize,
    mounts,
    named_port,
    option,
    render,
    secret_volume_dirs,
    without_options,
)
from promql_refs import Exposition, parse_exposition, parse_refs, problems

from servelm.ports import free_port
from servelm.server.launcher import ServerProcess, launch_server, wait_until_ready
from servelm.testing.tiny_model import write_tiny_checkpoint

KEY = "sk-from-the-secret"
TENANT_KEY = "sk-voice-REPLACE-ME"  # deploy/tenants.example.yaml's
SECRETS = {
    "servelm-api-key": {"api-key": KEY},
    "servelm-tenants": {"tenants.yaml": (KUBERNETES_DIR.parent / "tenants.example.yaml").read_text()},
}
REPLICAS, ROUTER = "servelm-replica", "servelm-router"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
NAMESPACE = "servelm"


@dataclass
class Replica:
    server: ServerProcess
    spec: dict  # the serving container, as rendered
    container_port: int  # what the manifest's --port says; the server listens on server.port instead

    def url(self, port: int | str, path: str) -> str:
        assert named_port(self.spec, port) == self.container_port
        return f"{self.server.base_url}{path}"


def start_replica(variant: str, pod: Pod, root: Path, port: int | None = None) -> Replica:
    """`servelm serve` as the variant's StatefulSet starts it in `pod`; returns once /ready (or
    raises with its log). The model volume at root/models must hold the model already."""
    resources = render(VARIANTS[variant])
    pod_spec = find(resources, "StatefulSet", REPLICAS)["spec"]["template"]["spec"]
    spec = container(pod_spec, "servelm")
    volumes = {"models": root / "models", "dshm": root / "dshm", **secret_volume_dirs(pod_spec, SECRETS, root)}
    mounted = mounts(spec, volumes)
    env = {name: localize(value, mounted) for name, value in container_env(spec, pod, resources, SECRETS).items()}
    argv = [localize(arg, mounted) for arg in command_line(spec, env)]
    assert argv[:2] == ["servelm", "serve"], argv
    [container_port] = option(argv, "--port")
    # The launcher puts --host 127.0.0.1 --port P first; the manifest's own would override them.
    server = launch_server(None, without_options(argv[2:], {"--host", "--port"}), port=port, env=env)
    return Replica(server, spec, int(container_port))


@dataclass
class RouterProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    spec: dict

    def url(self, port: int | str, path: str) -> str:
        assert named_port(self.spec, port) == int(option(command_line(self.spec, {}), "--port")[0])
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


def start_router(resources: list[dict], root: Path, addresses: dict[str, str]) -> RouterProcess:
    """`servelm router` as the Deployment starts it; `addresses`: pod host name -> 127.0.0.1:PORT."""
    pod_spec = find(resources, "Deployment", ROUTER)["spec"]["template"]["spec"]
    spec = container(pod_spec, "router")
    mounted = mounts(spec, {"tokenizer": root / "models"})
    env = container_env(spec, Pod(f"{ROUTER}-5d9c7b8f6-x2x7q"), resources, SECRETS)
    argv = [localize(arg, mounted) for arg in command_line(spec, env)]
    assert argv[:2] == ["servelm", "router"], argv
    argv = [_resolve(arg, addresses) if argv[i - 1] == "--replica" else arg for i, arg in enumerate(argv)]
    port = free_port()
    command = [sys.executable, "-m", "servelm.cli", *without_options(argv[1:], {"--host", "--port"})]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log_path = root / "router.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    router = RouterProcess(process, port, log_path, spec)
    try:
        startup = spec["startupProbe"]["httpGet"]
        wait_until_ready(process, router.url(startup["port"], startup["path"]), 120)
    except RuntimeError as error:
        router.stop()
        raise RuntimeError(f"servelm router {error}:\n{log_path.read_text()[-4000:]}") from None
    return router


def _resolve(url: str, addresses: dict[str, str]) -> str:
    parts = urlsplit(url)
    assert parts.hostname in addresses, f"{url} names no pod of the StatefulSet"
    return f"{parts.scheme}://{addresses[parts.hostname]}"


@dataclass
class Cluster:
    resources: list[dict]
    replica: Replica
    router: RouterProcess
    router_ready_before_the_replica: int  # the router's /ready status while no replica served


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("k8s")
    resources = render(VARIANTS["cpu"])
    write_tiny_checkpoint(root / "models" / find(resources, "ConfigMap", "servelm-model")["data"]["MODEL_NAME"], seed=3)
    statefulset = find(resources, "StatefulSet", REPLICAS)
    maximum = find(resources, "HorizontalPodAutoscaler", REPLICAS)["spec"]["maxReplicas"]
    replica_port = free_port()
    addresses = {
        f"{REPLICAS}-{i}.{statefulset['spec']['serviceName']}": f"127.0.0.1:{replica_port if i == 0 else free_port()}"
        for i in range(maximum)
    }  # fmt: skip
    router = start_router(resources, root, addresses)
    try:
        ready_before = httpx.get(router.url("http", "/ready"), timeout=10).status_code
        replica = start_replica("cpu", Pod(f"{REPLICAS}-0"), root, port=replica_port)
        try:
            _wait_for(lambda: httpx.get(router.url("http", "/ready"), timeout=10).status_code == 200, 30)
            yield Cluster(resources, replica, router, ready_before)
        finally:
            code = replica.server.stop()
            assert code == 0, replica.server.log_tail()
    finally:
        router.stop()


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true after {timeout_s} s"
        time.sleep(0.2)


def test_the_replica_answers_every_probe_and_the_scrape_on_the_ports_they_name(cluster):
    [monitor] = load_documents(KUBERNETES_DIR / "monitoring" / "podmonitor.yaml")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    checks = [(probe, cluster.replica.spec[probe]["httpGet"]) for probe in PROBES]
    checks.append(("PodMonitor", {"port": endpoint["port"], "path": endpoint["path"]}))
    for name, target in checks:
        response = httpx.get(cluster.replica.url(target["port"], target["path"]), timeout=10)
        assert response.status_code == 200, f"{name} {target}: {response.status_code} {response.text}"


def test_the_router_is_live_at_once_and_ready_once_a_replica_serves(cluster):
    assert cluster.router_ready_before_the_replica == 503, "no replica yet: the Service must send the router nothing"
    for probe in PROBES:
        target = cluster.router.spec[probe]["httpGet"]
        response = httpx.get(cluster.router.url(target["port"], target["path"]), timeout=10)
        assert response.status_code == 200, f"{probe} {target}: {response.status_code} {response.text}"


def test_a_request_through_the_router_needs_the_secret_s_key_and_reaches_the_replica(cluster):
    url = cluster.router.url("http", "/v1/completions")
    body = {"prompt": "Kubernetes says hello", "max_tokens": 4}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    response = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def _as_scraped(exposition: Exposition, pod: str) -> Exposition:
    """The samples as Prometheus stores them: each with its target's namespace and pod labels."""
    return {
        name: [{**labels, "namespace": NAMESPACE, "pod": pod} for labels in sets] for name, sets in exposition.items()
    }


def _adapter_queries(rule: dict, pods: list[str]) -> list[str]:
    """The rule's discovery query and its metrics query as prometheus-adapter renders it for pods."""
    series = rule["name"]["matches"].removeprefix("^").removesuffix("$")
    matchers = f'namespace="{NAMESPACE}",pod=~"{"|".join(pods)}"'
    query = rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
    return [rule["seriesQuery"], query.replace("<<.GroupBy>>", "pod")]


def test_the_autoscaling_rules_query_metrics_the_replica_exports(cluster):
    # A request first, so the TTFT histogram has samples (it has no series before one).
    body = {"prompt": "one more", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(cluster.router.url("http", "/v1/completions"), json=body, headers=headers, timeout=60).is_success
    text = httpx.get(cluster.replica.url("http", "/metrics"), timeout=10).text
    exposition = _as_scraped(parse_exposition(text), f"{REPLICAS}-0")
    [config_map] = load_documents(KUBERNETES_DIR / "monitoring" / "prometheus-adapter-config.yaml")
    selected = set()
    for rule in yaml.safe_load(config_map["data"]["config.yaml"])["rules"]:
        for query in _adapter_queries(rule, [f"{REPLICAS}-0", f"{REPLICAS}-1"]):
            refs = parse_refs(query)
            assert problems(refs, exposition) == [], f"{rule['name']['as']}: {query}"
            selected |= {selector.metric for selector in refs.selectors}
    assert {"servelm:num_requests_waiting", "servelm:time_to_first_token_seconds_bucket"} <= selected
    # And the check is not blind: a metric the server lacks, a label it lacks, are found.
    assert problems(parse_refs('servelm:num_requests_queued{pod="p"}'), exposition)
    assert problems(parse_refs('servelm:num_requests_waiting{tenant="voice"}'), exposition)


def test_the_tenants_variant_serves_with_the_tenants_file_from_its_secret(tmp_path):
    """Its own replica: --tenants reads the Secret's file at the path the volume mounts it; probes stay open."""
    model_name = find(render(VARIANTS["tenants"]), "ConfigMap", "servelm-model")["data"]["MODEL_NAME"]
    write_tiny_checkpoint(tmp_path / "models" / model_name, seed=3)
    replica = start_replica("tenants", Pod(f"{REPLICAS}-1"), tmp_path)
    try:
        for probe in PROBES:
            target = replica.spec[probe]["httpGet"]
            assert httpx.get(replica.url(target["port"], target["path"]), timeout=10).status_code == 200, probe
        url = replica.url("http", "/v1/completions")
        body = {"prompt": "a tenant asks", "max_tokens": 2}
        assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 401
        response = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=60)
        assert response.status_code == 200, response.text
    finally:
        assert replica.server.stop() == 0, replica.server.log_tail()
