"""A real fleet for the router's end-to-end tests: 2 `servelm serve` replicas of a tiny model
(each with KV events) and a `servelm router` in front, started by the cluster launcher once
per module. Nothing is mocked: HTTP and ZMQ between real processes on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from router_helpers import ROUTER_KEY
from servelm.cluster.local import LocalCluster
from servelm.cluster.spec import ClusterConfig, ReplicasConfig, RouterConfig
from servelm.ports import free_port_range
from servelm.testing.tiny_model import write_tiny_checkpoint

NUM_REPLICAS = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fleet")
    model = write_tiny_checkpoint(root / "model", seed=0)
    base = free_port_range(1 + NUM_REPLICAS * 3)
    config = ClusterConfig(
        model=str(model),
        api_key=None,  # replicas open; the router alone checks its key (tested below)
        replicas=ReplicasConfig(
            count=NUM_REPLICAS, num_threads=1, base_port=base + 1, kv_events_base_port=base + 1 + NUM_REPLICAS,
            args=("--num-blocks", "1024", "--max-num-seqs", "32"),
        ),
        router=RouterConfig(port=base, policy="kv", args=("--health-interval", "0.5", "--api-key", ROUTER_KEY)),
    )  # fmt: skip
    cluster = LocalCluster(config, Path(root / "logs"), startup_timeout_s=240)
    cluster.start()
    yield cluster
    cluster.stop()
