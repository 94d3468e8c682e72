"""`servelm cluster CONFIG [--backend local|ray]`: start replicas + router, print URLs, keep them
running (the launcher's `check()`), tear all down on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import tempfile
import time
from pathlib import Path
from typing import Any


def add_cluster_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    cluster = sub.add_parser(
        "cluster", help="N replicas and a router from one YAML/TOML config, as local processes or Ray actors"
    )
    cluster.add_argument("config", help="cluster config (.yaml or .toml); see servelm.cluster.spec")
    cluster.add_argument(
        "--backend", default=None, help="local | ray: who places the processes (default: the config's placement)"
    )
    cluster.add_argument(
        "--address", default=None, help="ray: an existing Ray cluster (HOST:PORT or auto; default: start a local one)"
    )
    cluster.add_argument("--log-dir", default=None, help="one log file per process (default: a temp dir)")
    cluster.add_argument("--startup-timeout", type=float, default=300.0, dest="startup_timeout_s")
    cluster.set_defaults(handler=run_cluster)
    return cluster


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def run_cluster(args: argparse.Namespace) -> int:
    from servelm.cluster.launcher import LaunchOptions, make_launcher
    from servelm.cluster.spec import load_cluster_config

    config = load_cluster_config(args.config)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="servelm-cluster-"))
    try:
        options = LaunchOptions(log_dir, args.startup_timeout_s, args.address)
        cluster = make_launcher(args.backend or config.placement, config, options)
    except (ValueError, ImportError) as error:
        raise SystemExit(str(error)) from None
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
        while (reason := cluster.check()) is None:
            time.sleep(0.5)
        print(f"{reason}; stopping the cluster", flush=True)
        return 1
    except _Stop:
        return 0
    finally:
        # A second Ctrl-C (a terminal sends one per key press) must not cut the teardown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
