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
    for flag, value in (("--num-threads", "2"), ("--model", "/models/m"), ("--api-key", "k1"), ("--kv-events-port", "9102")):
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
        ({"replicas": {"cuont": 2}}, "unknown key.*cuont.*valid: args, base_port, count"),
        ({"routers": {}}, "unknown key.*routers"),
        ({"replicas": {"count": 0}}, "count and replicas.num_threads must be >= 1"),
    ],
)
def test_bad_configs_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)
