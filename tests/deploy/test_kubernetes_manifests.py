"""deploy/kubernetes: every manifest and every rendered variant (cpu, gpu, tenants) validates against
the Kubernetes API's JSON schemas (kubernetes-validate, strict: an unknown field is an error), and
the pieces agree with each other and with servelm's own command line: each container's command
parses with servelm's parser, the swarm pull of every pod the autoscaler may create gets a valid
--node-index and peer list, the router names exactly those pods, the autoscaler asks for the
metrics the adapter rules serve. The probes against a real server: test_kubernetes_live.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
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
    named_port,
    option,
    render,
    shell_exec_argv,
)

from servelm.cli import build_parser, engine_config_from_args
from servelm.delivery.swarm_cli import swarm_config_from_args
from servelm.router.replicas import ReplicaSpec

# The oldest Kubernetes the manifests are for (startupProbe, autoscaling/v2 and the rest are older)
# and the newest the validator knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
# Custom resources whose schemas the validator does not ship (Prometheus Operator's); checked below
# by what they select instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
SECRETS = {"servelm-api-key": {"api-key": "sk-test"}}
REPLICAS, ROUTER = "servelm-replica", "servelm-router"


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBERNETES_DIR.rglob("*.yaml") if p.name != "kustomization.yaml")


def _schema_problems(resource: dict, version: str) -> str | None:
    """None when it validates; the validator's message otherwise."""
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{'.'.join(map(str, error.path))}: {error.message}"
    except kubernetes_validate.SchemaNotFoundError as error:
        if (resource["apiVersion"], resource["kind"]) in CUSTOM_KINDS:
            return None
        return error.message
    return None


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render(directory) for name, directory in VARIANTS.items()}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_and_variant_validates_against_the_kubernetes_schemas(variants, version):
    documents = [(str(path.relative_to(KUBERNETES_DIR)), d) for path in _manifest_files() for d in load_documents(path)]
    documents += [(f"variant {name}", d) for name, rendered in variants.items() for d in rendered]
    found = {f"{where}: {d['kind']} {d['metadata']['name']}": _schema_problems(d, version) for where, d in documents}
    assert not {where: problem for where, problem in found.items() if problem}
    kinds = {d["kind"] for _, d in documents}
    assert {"StatefulSet", "Service", "Deployment", "HorizontalPodAutoscaler", "ConfigMap", "PodMonitor"} <= kinds


def test_the_validation_catches_a_misspelled_field_and_a_wrong_type(variants):
    statefulset = find(variants["cpu"], "StatefulSet", REPLICAS)
    misspelled = copy.deepcopy(statefulset)
    serving = container(misspelled["spec"]["template"]["spec"], "servelm")
    serving["readinessProbe"]["httpGet"]["paht"] = serving["readinessProbe"]["httpGet"].pop("path")
    assert "paht" in (_schema_problems(misspelled, VERSIONS[-1]) or "")
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["replicas"] = "two"
    assert "'two' is not of type 'integer'" in (_schema_problems(wrong_type, VERSIONS[-1]) or "")


def test_the_base_kustomization_lists_every_manifest_but_the_monitoring_ones():
    listed = yaml.safe_load((KUBERNETES_DIR / "kustomization.yaml").read_text())["resources"]
    at_top = sorted(p.name for p in KUBERNETES_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == at_top


def test_the_variants_differ_only_where_they_say(variants):
    base_replica = find(variants["cpu"], "StatefulSet", REPLICAS)["spec"]["template"]["spec"]
    gpu_replica = find(variants["gpu"], "StatefulSet", REPLICAS)["spec"]["template"]["spec"]
    assert container(gpu_replica, "servelm")["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in container(base_replica, "servelm")["resources"]["limits"]
    assert container(gpu_replica, "servelm")["args"] == container(base_replica, "servelm")["args"]
    tenants = variants["tenants"]
    for kind, name, spec_name in (("StatefulSet", REPLICAS, "servelm"), ("Deployment", ROUTER, "router")):
        env = container(find(tenants, kind, name)["spec"]["template"]["spec"], spec_name).get("env", [])
        assert "SERVELM_API_KEY" not in {variable["name"] for variable in env}, f"{name} still takes the single key"
    tenants_args = container(find(tenants, "StatefulSet", REPLICAS)["spec"]["template"]["spec"], "servelm")["args"]
    assert option(tenants_args, "--tenants") == ["/etc/servelm/tenants.yaml"]


def _argv(resources: list[dict], kind: str, name: str, container_name: str, pod: Pod) -> list[str]:
    spec = container(find(resources, kind, name)["spec"]["template"]["spec"], container_name)
    secrets = {**SECRETS, "servelm-tenants": {"tenants.yaml": "tenants: {}"}}
    return command_line(spec, container_env(spec, pod, resources, secrets))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_servelm_command_parses_with_servelm_s_own_parser(variants, variant):
    resources = variants[variant]
    commands = {
        "replica": _argv(resources, "StatefulSet", REPLICAS, "servelm", Pod(f"{REPLICAS}-0")),
        "router": _argv(resources, "Deployment", ROUTER, "router", Pod(f"{ROUTER}-abc12-xyz34")),
        "router's pull": _argv(resources, "Deployment", ROUTER, "pull-tokenizer", Pod(f"{ROUTER}-abc12-xyz34")),
    }
    parsed = {}
    for what, argv in commands.items():
        assert argv[0] == "servelm", what
        assert "$(" not in " ".join(argv), f"{what}: a variable the pod does not define: {argv}"
        parsed[what] = build_parser().parse_args(argv[1:])
    model_dir = f"/models/{find(resources, 'ConfigMap', 'servelm-model')['data']['MODEL_NAME']}"
    assert parsed["replica"].model == parsed["router"].model == str(parsed["router's pull"].to) == model_dir
    # The replica's effective block size: a flag left unset passes None and CacheConfig's default holds.
    replica_block_size = engine_config_from_args(parsed["replica"]).cache.block_size
    assert parsed["router"].block_size == replica_block_size, "the router must hash blocks as the replicas"
    for text in parsed["router"].replica:
        ReplicaSpec.parse(text)


def _replica_pod_spec(resources: list[dict]) -> dict:
    return find(resources, "StatefulSet", REPLICAS)["spec"]["template"]["spec"]


def test_the_swarm_pull_of_every_pod_the_autoscaler_may_create_is_valid(variants, tmp_path):
    """The init container's shell script, run by a real shell with the pod's environment, for every
    ordinal up to maxReplicas: the initial pods get their own index, later ones join late."""
    resources = variants["cpu"]
    statefulset = find(resources, "StatefulSet", REPLICAS)
    autoscaler = find(resources, "HorizontalPodAutoscaler", REPLICAS)
    spec = container(statefulset["spec"]["template"]["spec"], "pull-model")
    service = find(resources, "Service", statefulset["spec"]["serviceName"])
    peer_port = named_port(spec, "peer")
    initial = statefulset["spec"]["replicas"]
    expected_peers = tuple(
        f"http://{REPLICAS}-{i}.{service['metadata']['name']}:{peer_port}/" for i in range(initial)
    )  # fmt: skip
    model_dir = Path("/models") / find(resources, "ConfigMap", "servelm-model")["data"]["MODEL_NAME"]
    for ordinal in range(autoscaler["spec"]["maxReplicas"]):
        pod = Pod(f"{REPLICAS}-{ordinal}", ip=f"127.0.0.{ordinal + 1}")
        env = container_env(spec, pod, resources, SECRETS)
        argv = shell_exec_argv(command_line(spec, env), env, "servelm", tmp_path / str(ordinal))
        args = build_parser().parse_args(argv)
        config = swarm_config_from_args(args)
        assert args.command == "pull" and args.to == model_dir
        assert tuple(peer if peer.endswith("/") else peer + "/" for peer in config.peers) == expected_peers
        assert config.bind_address() == (pod.ip, peer_port)
        if ordinal < initial:
            assert config.node_index == ordinal
        else:
            assert config.node_index is None, "a pod scaled out later owns no share: it joins late"
            assert config.own_url(peer_port) == f"http://{pod.ip}:{peer_port}/"


def test_the_headless_service_gives_each_replica_pod_its_name(variants):
    resources = variants["cpu"]
    statefulset = find(resources, "StatefulSet", REPLICAS)
    service = find(resources, "Service", statefulset["spec"]["serviceName"])
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"], "peers must resolve while they pull, before any is ready"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel", "the swarm's pods must pull together"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    pod_spec = statefulset["spec"]["template"]["spec"]
    for name, spec_name in (("http", "servelm"), ("peer", "pull-model")):
        assert ports[name]["port"] == named_port(container(pod_spec, spec_name), ports[name]["targetPort"])


def test_the_router_names_exactly_the_pods_the_autoscaler_may_create(variants):
    resources = variants["cpu"]
    statefulset = find(resources, "StatefulSet", REPLICAS)
    service = statefulset["spec"]["serviceName"]
    port = named_port(container(statefulset["spec"]["template"]["spec"], "servelm"), "http")
    argv = _argv(resources, "Deployment", ROUTER, "router", Pod(f"{ROUTER}-abc12-xyz34"))
    maximum = find(resources, "HorizontalPodAutoscaler", REPLICAS)["spec"]["maxReplicas"]
    expected = [f"http://{REPLICAS}-{i}.{service}:{port}" for i in range(maximum)]
    assert [ReplicaSpec.parse(text).url for text in option(argv, "--replica")] == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_counts_ports_and_timeouts_agree(variants, variant):
    resources = variants[variant]
    statefulset = find(resources, "StatefulSet", REPLICAS)
    autoscaler = find(resources, "HorizontalPodAutoscaler", REPLICAS)
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", REPLICAS)
    pull_env = container_env(
        container(_replica_pod_spec(resources), "pull-model"), Pod(f"{REPLICAS}-0"), resources, SECRETS
    )
    assert statefulset["spec"]["replicas"] == autoscaler["spec"]["minReplicas"] == int(pull_env["SWARM_NODES"])
    assert autoscaler["spec"]["maxReplicas"] >= autoscaler["spec"]["minReplicas"]
    serving = container(_replica_pod_spec(resources), "servelm")
    argv = _argv(resources, "StatefulSet", REPLICAS, "servelm", Pod(f"{REPLICAS}-0"))
    args = build_parser().parse_args(argv[1:])
    assert args.port == named_port(serving, "http")
    assert args.num_threads <= int(serving["resources"]["limits"]["cpu"]), "more torch threads than CPUs"
    # A drain stops accepting at once: liveness must not kill the pod before in-flight requests end.
    liveness = serving["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= args.shutdown_timeout_s
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout_s
    for spec in (serving, container(find(resources, "Deployment", ROUTER)["spec"]["template"]["spec"], "router")):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            named_port(spec, spec[probe]["httpGet"]["port"])  # a port the container declares


def _adapter_rules() -> list[dict]:
    [config_map] = load_documents(KUBERNETES_DIR / "monitoring" / "prometheus-adapter-config.yaml")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def test_the_autoscaler_asks_for_the_metrics_the_adapter_serves_per_pod(variants):
    autoscaler = find(variants["cpu"], "HorizontalPodAutoscaler", REPLICAS)
    served = {}
    for rule in _adapter_rules():
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        served[rule["name"]["as"]] = rule
    asked = [metric["pods"]["metric"]["name"] for metric in autoscaler["spec"]["metrics"]]
    assert all(metric["type"] == "Pods" for metric in autoscaler["spec"]["metrics"])
    assert sorted(asked) == sorted(served), "every HPA metric needs an adapter rule, and every rule a use"


def test_the_pod_monitor_scrapes_the_replicas_and_the_router(variants):
    [monitor] = load_documents(KUBERNETES_DIR / "monitoring" / "podmonitor.yaml")
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for kind, name, spec_name in (("StatefulSet", REPLICAS, "servelm"), ("Deployment", ROUTER, "router")):
        template = find(variants["cpu"], kind, name)["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name} is not scraped"
        named_port(container(template["spec"], spec_name), endpoint["port"])
