"""`servelm cluster CONFIG`: start replicas + router, print URLs, tear all down on Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

LAUNCHERS = ("local",)  # Ray / Kubernetes launchers would consume the same ProcessSpecs


def add_cluster_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    cluster = sub.add_parser("cluster", help="N replicas and a router from one YAML/TOML config, as local processes")
    cluster.add_argument("config", help="cluster config (.yaml or .toml); see servelm.cluster.spec")
    cluster.add_argument("--log-dir", default=None, help="one log file per process (default: a temp dir)")
    cluster.add_argument("--startup-timeout", type=float, default=300.0, dest="startup_timeout_s")
    cluster.set_defaults(handler=run_cluster)
    return cluster


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def run_cluster(args: argparse.Namespace) -> int:
    from servelm.cluster.local import LocalCluster
    from servelm.cluster.spec import load_cluster_config

    config = load_cluster_config(args.config)
    if config.placement not in LAUNCHERS:
        raise SystemExit(f"unknown placement {config.placement!r}; valid: {', '.join(LAUNCHERS)}")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="servelm-cluster-"))
    cluster = LocalCluster(config, log_dir, args.startup_timeout_s)
    # Both explicitly: a process started in the background inherits SIGINT *ignored*, and
    # Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    try:
        cluster.start()
        for name, url in cluster.urls().items():
            print(f"{name:>12}  {url}", flush=True)
        print(f"logs in {log_dir}; Ctrl-C stops everything", flush=True)
        while (exited := cluster.first_exited()) is None:
            time.sleep(0.5)
        print(f"{exited.spec.name} exited with {exited.process.returncode}; stopping the cluster", flush=True)
        return 1
    except _Stop:
        return 0
    finally:
        cluster.stop()
