"""`servelm router` flags → RouterOptions / RouterServerOptions. Imports nothing heavy until run."""

from __future__ import annotations

import argparse

from servelm import envs
from servelm.batch.arguments import BatchOptions, add_batch_arguments
from servelm.config import CacheConfig
from servelm.openai_api.overload import OverloadOptions, add_overload_arguments
from servelm.router.disagg import DisaggSettings
from servelm.router.policies import LOAD_METRICS, POLICIES, PolicySettings


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    router = sub.add_parser("router", help="cache-aware OpenAI-compatible router over replicas")
    router.add_argument(
        "--replica", action="append", default=[], metavar="URL[,kv=tcp://HOST:PORT][,role=ROLE]",
        help="a replica's base URL, with its --kv-events-port address for the kv policy and the --kv-role it "
        "should report (a cross-check: the replica's own answer wins); repeat per replica",
    )  # fmt: skip
    router.add_argument("--policy", default="kv", choices=sorted(POLICIES))
    router.add_argument("--model", default=None, help="the replicas' model (its tokenizer hashes prompts)")
    router.add_argument(
        "--block-size", type=int, default=CacheConfig.block_size, help="the replicas' --block-size (the same default)"
    )
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--api-key", default=None, help=f"require this bearer token (or env {envs.API_KEY})")
    router.add_argument("--load-metric", default="requests", choices=LOAD_METRICS)
    router.add_argument("--load-weight", type=float, default=1.0, help="load penalty per replica capacity of load")
    router.add_argument("--capacity", type=float, default=8.0, help="load (requests or tokens) counted as full")
    router.add_argument(
        "--kv-host-hit-weight",
        type=float,
        default=PolicySettings.host_hit_weight,
        help="kv policy: worth of a prompt block in a replica's host-memory KV tier, vs 1.0 in its pool",
    )
    router.add_argument(
        "--kv-disk-hit-weight",
        type=float,
        default=PolicySettings.disk_hit_weight,
        help="kv policy: worth of a prompt block in a replica's disk KV tier, vs 1.0 in its pool",
    )
    router.add_argument("--session-affinity", action="store_true", help="keep x-session-id / user on one replica")
    router.add_argument(
        "--no-disagg", action="store_false", dest="disagg",
        help="never split a request onto a prefill worker (prefill-only replicas then get no requests)",
    )  # fmt: skip
    router.add_argument(
        "--disagg-min-uncached-tokens", type=int, default=DisaggSettings.min_uncached_tokens,
        help="split a request only when the decode worker would compute at least this many prompt tokens",
    )  # fmt: skip
    router.add_argument(
        "--disagg-max-prefill-load", type=int, default=DisaggSettings.max_prefill_load,
        help="prefill calls in flight per prefill worker before it counts as saturated (then no split)",
    )  # fmt: skip
    router.add_argument(
        "--max-migrations", type=int, default=2,
        help="times a stream may be continued on another replica when its replica fails mid-stream (0: never)",
    )  # fmt: skip
    router.add_argument(
        "--upstream-stall-timeout", type=float, default=60.0, dest="upstream_stall_timeout_s",
        help="seconds without a byte from a stream's replica after which it counts as lost and the stream "
        "migrates (0: never)",
    )  # fmt: skip
    router.add_argument("--health-interval", type=float, default=2.0, dest="health_interval_s")
    router.add_argument("--health-timeout", type=float, default=2.0, dest="health_timeout_s")
    router.add_argument("--prefix-index-blocks", type=int, default=65536, help="per replica (prefix policy)")
    router.add_argument("--prefix-index-ttl", type=float, default=600.0, dest="prefix_index_ttl_s")
    router.add_argument("--kv-index-blocks", type=int, default=1 << 20, help="per replica and medium (kv policy)")
    router.add_argument(
        "--max-request-body-mb", type=float, default=32.0, dest="max_request_body_mb",
        help="larger generation request bodies get 413 before they are read",
    )  # fmt: skip
    add_overload_arguments(router)
    add_batch_arguments(router)
    router.set_defaults(handler=run_from_args)
    return router


def run_from_args(args: argparse.Namespace) -> int:
    from servelm.router.app import RouterServerOptions, run_router
    from servelm.router.replicas import ReplicaSpec
    from servelm.router.state import RouterOptions

    try:
        router_options = RouterOptions(
            policy=args.policy, block_size=args.block_size, load_metric=args.load_metric, load_weight=args.load_weight,
            capacity=args.capacity, host_hit_weight=args.kv_host_hit_weight, disk_hit_weight=args.kv_disk_hit_weight,
            session_affinity=args.session_affinity, prefix_index_blocks=args.prefix_index_blocks,
            prefix_index_ttl_s=args.prefix_index_ttl_s, kv_index_blocks=args.kv_index_blocks,
            health_interval_s=args.health_interval_s, health_timeout_s=args.health_timeout_s, disagg=args.disagg,
            disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
            disagg_max_prefill_load=args.disagg_max_prefill_load, max_migrations=args.max_migrations,
            upstream_stall_timeout_s=args.upstream_stall_timeout_s or None,
        )  # fmt: skip
        replicas = [ReplicaSpec.parse(text) for text in args.replica]
        overload = OverloadOptions.from_args(args)
    except ValueError as error:
        raise SystemExit(f"servelm router: {error}") from None
    options = RouterServerOptions(
        host=args.host, port=args.port, api_key=args.api_key or envs.api_key(), model=args.model, replicas=replicas,
        max_request_body_mb=args.max_request_body_mb, overload=overload, batch=BatchOptions.from_args(args),
    )  # fmt: skip
    return run_router(router_options, options)
