"""`servelm pull SOURCE --to DIR --peers URL,URL,... [--node-index I]`: the swarm's flags and handler.

`add_swarm_arguments` extends `servelm pull` (delivery/commands.py); `pull_command` hands a
pull with --peers to `swarm_pull_command`. SOURCE is the origin (any source `open_source`
knows); `--connections` is the node's concurrent reads from its peers, `--origin-connections`
its concurrent reads from the origin.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from servelm.delivery.swarm_config import SwarmConfig


def _urls(text: str) -> tuple[str, ...]:
    return tuple(url.strip() for url in text.split(",") if url.strip())


def add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SwarmConfig(peers=("http://unused/",))
    group = parser.add_argument_group(
        "cluster distribution",
        "N nodes each fetch a share from SOURCE and exchange the rest (delivery/swarm.py); each node serves what it "
        "holds on its peer URL. With --peers, --connections is the concurrent reads from peers",
    )  # fmt: skip
    group.add_argument("--peers", type=_urls, default=None, metavar="URL,URL,...",
                       help="every initial node's peer-server URL, in node order, this node's included")  # fmt: skip
    group.add_argument("--node-index", type=int, default=None, metavar="I",
                       help="this node's position in --peers (omit on a node joining later: it owns no share)")  # fmt: skip
    group.add_argument("--peer-host", default=None, help="address the peer server binds (default: the host of this node's --peers URL; 127.0.0.1 for a late joiner, whose URL it also names)")  # fmt: skip
    group.add_argument("--peer-port", type=int, default=None, help="peer server port (default: the port of this node's --peers URL; any free one for a late joiner)")  # fmt: skip
    group.add_argument("--seed-s", type=float, default=defaults.seed_s, help="after completing, serve peers until all live ones are complete, at most this long (default %(default)s)")  # fmt: skip
    group.add_argument("--seed-min-s", type=float, default=defaults.seed_min_s, help="after completing, serve at least this long (for nodes that may join later; default %(default)s)")  # fmt: skip
    group.add_argument("--peer-grace-s", type=float, default=defaults.grace_s, help="a peer not answering this long is gone and its share reassigned (default %(default)s)")  # fmt: skip
    group.add_argument("--origin-connections", type=int, default=defaults.origin_connections, help="concurrent reads from SOURCE (default %(default)s)")  # fmt: skip
    group.add_argument("--stats-json", type=Path, default=None, metavar="PATH", help="write this node's bytes from the origin and from peers, and its timings, as JSON")  # fmt: skip


def swarm_config_from_args(args: argparse.Namespace) -> SwarmConfig:
    return SwarmConfig(
        peers=args.peers, node_index=args.node_index, peer_host=args.peer_host, peer_port=args.peer_port,
        seed_s=args.seed_s, seed_min_s=args.seed_min_s, grace_s=args.peer_grace_s,
        origin_connections=args.origin_connections, peer_connections=args.connections,
    )  # fmt: skip


def swarm_pull_command(args: argparse.Namespace) -> int:
    from servelm.delivery.manifest import ManifestError
    from servelm.delivery.pull import PullError
    from servelm.delivery.sources import open_source
    from servelm.delivery.swarm import SwarmNode

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per chunk and poll otherwise
    try:
        config = swarm_config_from_args(args)
        origin = open_source(args.source, config.origin_connections)
    except ValueError as error:
        print(f"servelm pull: {error}", file=sys.stderr)
        return 2
    try:
        node = SwarmNode(origin, args.to, config)
        print(f"swarm node serving {args.to} at {node.url}", flush=True)
        stats = node.run(args.max_attempts, progress=not args.no_progress, stats_path=args.stats_json)
    except (PullError, ManifestError, OSError, ValueError) as error:
        print(f"servelm pull: {error}", file=sys.stderr)
        return 1
    finally:
        origin.close()
    print(stats.summary(), flush=True)
    return 0
