"""`servelm simulate calibrate | roofline | run`.

    servelm simulate calibrate --out cpu.json [engine flags, as servelm serve takes them]
    servelm simulate roofline --device h200 --model-config llama-8b/config.json --out h200.json
    servelm simulate run --cost-profile cpu.json --profile voice --rate 2 --num-requests 500 --out sim/
    servelm simulate run --cost-profile cpu.json --replicas 4 --policy kv --profile mixed --rate 8 ...

`run` takes `servelm bench run`'s workload flags and writes what it writes (run.json, summary.md,
plots), headed as simulated. Only argparse is imported here; handlers import what they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_simulate_parser(subparsers: argparse._SubParsersAction,
                        add_engine_arguments: Callable[[argparse.ArgumentParser], None],
                        engine_settings: Callable[[argparse.Namespace], dict[str, Any]]) -> None:  # fmt: skip
    """`add_engine_arguments` and `engine_settings` are servelm.cli's: calibrate takes the engine
    flags `servelm serve` takes, and builds the engine they describe."""
    from servelm.bench.cli import NO_SERVER_DEFAULTS, add_workload_arguments
    from servelm.router.policies import POLICIES

    simulate = subparsers.add_parser(
        "simulate", help="servelm's own scheduler and router on a virtual clock, from a measured cost profile")
    sub = simulate.add_subparsers(dest="simulate_command", required=True)

    calibrate = sub.add_parser("calibrate", help="time a real server on this host (its every step traced); "
                                                 "write its cost profile")  # fmt: skip
    add_engine_arguments(calibrate)
    calibrate.add_argument("--out", type=Path, default=Path("cost-profile.json"), help="where the profile goes")
    calibrate.add_argument("--quick", action="store_true", help="a short profiling plan (tiny models, CI)")
    calibrate.set_defaults(handler=_calibrate, engine_settings=engine_settings)

    roofline = sub.add_parser("roofline", help="an estimated profile for a device not at hand, from its published peaks")
    roofline.add_argument("--device", required=True, help="h100 | h200")
    roofline.add_argument("--model-config", type=Path, required=True, help="the model's config.json (or its directory)")
    roofline.add_argument("--out", type=Path, default=Path("roofline-profile.json"))
    roofline.set_defaults(handler=_roofline)

    run = sub.add_parser("run", help="a bench workload through simulated replicas: bench's reports, labelled simulated")
    run.add_argument("--cost-profile", type=Path, required=True, help="from `servelm simulate calibrate`")
    run.add_argument("--replicas", type=int, default=1, help="replicas (more than one: behind the router)")
    run.add_argument("--policy", default="kv", choices=sorted(POLICIES), help="the router's policy")
    run.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                     help="the replicas' tenants file: each class runs as the tenant its --api-keys key names, at "
                          "that tenant's class and priority (the batch class does not age)")  # fmt: skip
    run.add_argument("--api-keys", default=None, metavar="PROFILE=KEY,...", help="a key per traffic class (with --tenants)")
    run.add_argument("--api-key", default=None, help="the key of classes without one of their own (with --tenants)")
    run.add_argument("--price-per-device-hour", type=float, default=None,
                     help="a replica's device an hour: the report then says what a million tokens cost")  # fmt: skip
    add_workload_arguments(run)
    load = run.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open loop: requests/s (default 1)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    load.add_argument("--trace", type=Path, default=None, help="replay a Mooncake-format JSONL trace")
    run.add_argument("--time-scale", type=float, default=1.0)
    run.add_argument("--trace-time-unit-s", type=float, default=0.001)
    run.add_argument("--trace-block-size", type=int, default=512)
    run.set_defaults(handler=_run, **NO_SERVER_DEFAULTS)


def _calibrate(args: argparse.Namespace) -> int:
    from servelm.simulate.calibrate import calibrate_profile
    from servelm.simulate.plan_driver import QUICK_PLAN, CalibrationPlan

    profile = calibrate_profile(args.engine_settings(args), QUICK_PLAN if args.quick else CalibrationPlan())
    profile.save(args.out)
    print(f"{profile.label}: {profile.notes}\nwritten to {args.out}")
    return 0


def _roofline(args: argparse.Namespace) -> int:
    from servelm.models.plan import load_config
    from servelm.simulate.roofline import roofline_profile

    try:
        profile = roofline_profile(args.device, load_config(args.model_config), args.model_config.name)
    except (ValueError, OSError) as exc:
        print(f"servelm simulate: error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(f"{profile.label}: {profile.notes}\nwritten to {args.out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from servelm.bench.cli import bench_config
    from servelm.bench.execute import load_of
    from servelm.simulate.fleet import FleetConfig
    from servelm.simulate.profile import CostProfile
    from servelm.simulate.run import Pricing, simulate_once
    from servelm.tenancy.config import TenantsConfigError, load_tenants
    from servelm.tenancy.registry import TenantRegistry

    try:
        profile = CostProfile.load(args.cost_profile)
        config = bench_config(args)
        pricing = Pricing(args.price_per_device_hour) if args.price_per_device_hour is not None else None
        tenants = TenantRegistry.build(load_tenants(args.tenants), None) if args.tenants is not None else None
        fleet = FleetConfig(args.replicas, args.policy, tenants=tenants, class_keys=config.api_keys,
                            default_key=config.api_key)  # fmt: skip
        simulate_once(profile, config, load_of(args), fleet, config.out_dir, pricing=pricing)
    except (ValueError, OSError, TenantsConfigError) as exc:
        print(f"servelm simulate: error: {exc}", file=sys.stderr)
        return 2
    print((config.out_dir / "summary.md").read_text())
    return 0
