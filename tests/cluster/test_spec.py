"""Cluster config parsing and the process specs it resolves to (no processes started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.cluster.spec import ClusterConfig, load_cluster_config

YAML = """
model: /models/m
api_key: k1
replicas:
  count: 3
  num_threads: 2
  base_port: 8100
  kv_events_base_port: 9100
  args: ["--max-num-seqs", "64"]
router:
  port: 8000
  policy: prefix
  args: ["--load-weight", "0.5"]
"""

TOML = """
model = "/models/m"
api_key = "k1"
[replicas]
count = 3
num_threads = 2
base_port = 8100
kv_events_base_port = 9100
args = ["--max-num-seqs", "64"]
[router]
port = 8000
policy = "prefix"
args = ["--load-weight", "0.5"]
"""


def test_yaml_and_toml_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(YAML)
    (tmp_path / "c.toml").write_text(TOML)
    assert load_cluster_config(tmp_path / "c.yaml") == load_cluster_config(tmp_path / "c.toml")


def test_process_specs(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(YAML)
    config = load_cluster_config(tmp_path / "c.yaml")
    replicas = config.replica_processes()
    assert [r.url for r in replicas] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert [r.kv_events for r in replicas] == ["tcp://127.0.0.1:9100", "tcp://127.0.0.1:9102", "tcp://127.0.0.1:9104"]
    argv = replicas[1].argv
    assert argv[:5] == ("serve", "--host", "127.0.0.1", "--port", "8101")
    for flag, value in (
        ("--num-threads", "2"),
        ("--model", "/models/m"),
        ("--api-key", "k1"),
        ("--kv-events-port", "9102"),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert argv[-2:] == ("--max-num-seqs", "64")
    router = config.router_process(replicas)
    assert router.url == "http://127.0.0.1:8000"
    assert "--policy" in router.argv and router.argv[router.argv.index("--policy") + 1] == "prefix"
    assert router.argv.count("--replica") == 3
    assert "http://127.0.0.1:8102,kv=tcp://127.0.0.1:9104" in router.argv


def test_no_kv_events_means_plain_replica_urls() -> None:
    config = ClusterConfig.from_dict({"replicas": {"count": 1, "kv_events_base_port": None}})
    [replica] = config.replica_processes()
    assert replica.kv_events is None and "--kv-events-port" not in replica.argv
    assert config.router_process([replica]).argv[-1] == "http://127.0.0.1:8100"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"replicas": {"cuont": 2}}, "unknown key.*cuont.*valid: args, base_port, context_parallel_size, count"),
        ({"routers": {}}, "unknown key.*routers"),
        ({"replicas": {"count": 0}}, "count and replicas.num_threads must be >= 1"),
    ],
)
def test_bad_configs_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


PD_YAML = """
model: /models/m
block_size: 32
prefill: {count: 2, num_threads: 2, base_port: 8200, transfer_base_port: 9300, args: ["--max-num-seqs", "8"]}
decode: {count: 1, base_port: 8300}
router: {port: 8000}
"""


def test_prefill_and_decode_pools_resolve_to_roles_ports_and_peers(tmp_path: Path) -> None:
    (tmp_path / "pd.yaml").write_text(PD_YAML)
    config = load_cluster_config(tmp_path / "pd.yaml")
    assert config.replicas is None  # pools given: no default aggregated replicas
    processes = config.replica_processes()
    assert [(p.name, p.kv_role, p.url) for p in processes] == [
        ("prefill-0", "prefill", "http://127.0.0.1:8200"),
        ("prefill-1", "prefill", "http://127.0.0.1:8201"),
        ("decode-0", "decode", "http://127.0.0.1:8300"),
    ]
    prefill1, decode0 = processes[1].argv, processes[2].argv
    for argv, flag, value in (
        (prefill1, "--kv-role", "prefill"), (prefill1, "--kv-transfer-port", "9301"),
        (prefill1, "--kv-transfer-host", "127.0.0.1"), (prefill1, "--kv-events-port", "9202"),
        (prefill1, "--num-threads", "2"), (prefill1, "--block-size", "32"), (prefill1, "--model", "/models/m"),
        (decode0, "--kv-role", "decode"), (decode0, "--kv-transfer-peers", "tcp://127.0.0.1:9300,tcp://127.0.0.1:9301"),
        (decode0, "--kv-events-port", "9400"), (decode0, "--block-size", "32"),
    ):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert prefill1[-2:] == ("--max-num-seqs", "8") and "--max-num-seqs" not in decode0
    assert "--kv-transfer-port" not in decode0 and "--kv-transfer-peers" not in prefill1
    router = config.router_process(processes).argv
    assert router[router.index("--block-size") + 1] == "32"
    assert "http://127.0.0.1:8201,kv=tcp://127.0.0.1:9202,role=prefill" in router
    assert "http://127.0.0.1:8300,kv=tcp://127.0.0.1:9400,role=decode" in router


def test_pools_and_aggregated_replicas_together_with_defaults() -> None:
    config = ClusterConfig.from_dict({"replicas": {"count": 1}, "prefill": {}, "decode": {}})
    names = [(p.name, p.url, p.kv_events) for p in config.replica_processes()]
    assert names == [
        ("replica-0", "http://127.0.0.1:8100", "tcp://127.0.0.1:9100"),
        ("prefill-0", "http://127.0.0.1:8200", "tcp://127.0.0.1:9200"),
        ("decode-0", "http://127.0.0.1:8300", "tcp://127.0.0.1:9400"),
    ]
    assert config.transfer_addresses() == ["tcp://127.0.0.1:9300"]
    assert "--kv-role" not in config.replica_processes()[0].argv
    assert "--block-size" not in config.replica_processes()[0].argv  # no block_size: the replicas' default


@pytest.mark.parametrize(
    "data, message",
    [
        ({"prefill": {"count": 1}}, "a prefill pool needs a decode pool"),
        ({"prefill": {}, "replicas": {}}, "a prefill pool needs a decode pool"),
        ({"decode": {"transfer_base_port": 9500}}, "unknown key.*transfer_base_port"),
        ({"prefill": {"transfer_base_port": None}, "decode": {}}, "prefill.transfer_base_port is required"),
        ({"prefill": {"count": 0}, "decode": {}}, "prefill.count and prefill.num_threads must be >= 1"),
        ({"decode": {"args": ["--kv-role", "both"]}}, "decode.args sets --kv-role"),
        ({"replicas": {"args": ["--block-size=32"]}}, "replicas.args sets --block-size.*top-level block_size"),
        ({"router": {"args": ["--block-size", "32"]}}, "router.args sets --block-size"),
        ({"prefill": {"base_port": 8300}, "decode": {}}, r"ports used twice.*\[8300\]"),
        ({"prefill": {"transfer_base_port": 8300}, "decode": {}}, r"ports used twice.*\[8300\]"),
        ({"replicas": {"count": 2, "kv_events_base_port": 9199}, "prefill": {}, "decode": {}}, r"\[9200, 9201\]"),
        ({"block_size": 0}, "block_size must be >= 1"),
    ],
)
def test_bad_pool_configs_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


def test_multi_rank_replicas_and_resource_requests() -> None:
    config = ClusterConfig.from_dict({
        "replicas": {"count": 1, "num_threads": 2, "tensor_parallel_size": 2, "context_parallel_size": 2, "num_gpus": 1},
        "router": {"num_cpus": 0.5},
    })  # fmt: skip
    [replica] = config.replica_processes()
    argv = replica.argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--context-parallel-size") + 1] == "2"
    # Four ranks, each with what the pool asks per rank (CPUs default to its threads).
    assert (replica.num_ranks, replica.cpus_per_rank, replica.gpus_per_rank) == (4, 2.0, 1)
    router = config.router_process([replica])
    assert (router.num_ranks, router.cpus_per_rank, router.gpus_per_rank) == (1, 0.5, 0.0)
    single = ClusterConfig.from_dict({"replicas": {"count": 1, "num_cpus": 3}}).replica_processes()[0]
    assert "--tensor-parallel-size" not in single.argv and (single.num_ranks, single.cpus_per_rank) == (1, 3)


def test_a_wildcard_host_is_reached_at_each_process_machine() -> None:
    """A launcher that places processes on other machines passes where each landed: with host
    0.0.0.0 every process binds all interfaces and is advertised at its machine's address."""
    data = {"host": "0.0.0.0", "prefill": {}, "decode": {}}
    addresses = {"prefill-0": "10.0.0.1", "decode-0": "10.0.0.2", "router": "10.0.0.3"}
    prefill, decode = ClusterConfig.from_dict(data).replica_processes(addresses)
    assert prefill.argv[prefill.argv.index("--host") + 1] == "0.0.0.0"
    assert (prefill.url, prefill.kv_events) == ("http://10.0.0.1:8200", "tcp://10.0.0.1:9200")
    assert prefill.argv[prefill.argv.index("--kv-transfer-host") + 1] == "10.0.0.1"
    assert decode.argv[decode.argv.index("--kv-transfer-peers") + 1] == "tcp://10.0.0.1:9300"
    router = ClusterConfig.from_dict(data).router_process([prefill, decode], addresses["router"])
    assert router.url == "http://10.0.0.3:8000" and "http://10.0.0.2:8300,kv=tcp://10.0.0.2:9400,role=decode" in router.argv
    # A fixed host wins over where a process landed: the user said where it is reached.
    [fixed] = ClusterConfig.from_dict({"replicas": {"count": 1}}).replica_processes({"replica-0": "10.0.0.1"})
    assert fixed.url == "http://127.0.0.1:8100"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"replicas": {"args": ["-tp", "2"]}}, "replicas.args sets -tp"),
        ({"replicas": {"tensor_parallel_size": 0}}, "tensor_parallel_size and context_parallel_size must be >= 1"),
        ({"replicas": {"num_cpus": 0}}, "num_cpus must be > 0 and num_gpus >= 0"),
        ({"decode": {"num_gpus": -1}}, "decode.num_cpus must be > 0 and num_gpus >= 0"),
        ({"router": {"num_cpus": 0}}, "router.num_cpus must be > 0"),
    ],
)
def test_bad_placement_configs_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)
