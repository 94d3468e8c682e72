"""Issue 44's fidelity target on this host: the simulator's predictions against measured runs.

    1. `servelm simulate calibrate` on the default model at `make serve` defaults (a real server's
       every step traced under the profiling plan): the cost profile
    2. a real `servelm serve` at the same defaults; its capacity C for the workload profile =
       requests/s of a closed loop at 16 in flight (as benchmarks/batch.py defines it)
    3. at 30%, 60% and 85% of C (Poisson, the same seed for both): `servelm bench run` against
       the server, and `servelm simulate run` of the same requests on the profile
    4. predicted / measured for TTFT p50 and p90 and TBT p50 and p99 (target: each within ±15%);
       the closed loop's throughput predicted as well (capacity itself)

    PYTHONPATH=src .venv/bin/python benchmarks/simulate_fidelity.py [--profile voice] [--num-requests 120]
        [--fractions 0.3,0.6,0.85] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from servelm.bench.execute import BenchConfig, Load, prepare, run_once
from servelm.server.launcher import launch_server
from servelm.simulate.calibrate import calibrate_profile
from servelm.simulate.fleet import FleetConfig
from servelm.simulate.plan_driver import CalibrationPlan
from servelm.simulate.profile import CostProfile
from servelm.simulate.run import simulate_once

METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tbt_s", "p50"), ("tbt_s", "p99"))
TOLERANCE = 0.15


def _figures(report: dict[str, Any]) -> dict[str, float | None]:
    overall = report["summary"]["overall"]
    out: dict[str, float | None] = {f"{m}_{q}": overall[m][q] for m, q in METRICS}
    out["req_s"] = overall["request_throughput"]
    return out


def _ratios(predicted: dict[str, float | None], measured: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (predicted[k] / measured[k]) if predicted.get(k) and measured.get(k) else None for k in measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="voice")
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--fractions", default="0.3,0.6,0.85")
    parser.add_argument("--cost-profile", type=Path, default=None, help="reuse a calibrated profile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="simulate-fidelity-"))
    started = time.time()
    if args.cost_profile is not None:
        profile = CostProfile.load(args.cost_profile)
    else:
        profile = calibrate_profile({}, CalibrationPlan())
        profile.save(out / "profile.json")
    print(f"profile: {profile.label}: {profile.notes}", flush=True)
    results: dict[str, Any] = {"profile": profile.to_dict() | {"calibration": len(profile.calibration)}, "runs": {}}
    server = launch_server(None, [])
    try:
        config = BenchConfig(base_url=server.base_url, out_dir=out, profile=args.profile, num_requests=args.num_requests,
                             seed=7, duration_s=1800, progress=False, plots=False)  # fmt: skip
        target = prepare(config)
        # Each run its own salt (bench's, as a sweep's steps): the same lengths and sharing, other
        # tokens, so no run finds the one before it in the server's prefix cache; the simulation
        # replays the same salted requests on an empty cache, as the server has for them.
        capacity = run_once(target, config, Load("concurrency", 16.0), out / "capacity" / "measured", salt=1)
        measured_capacity = capacity["summary"]["overall"]["request_throughput"]
        runs: list[tuple[str, Load, dict[str, Any] | None]] = [("capacity", Load("concurrency", 16.0), capacity)]
        runs += [(f"{float(f):.0%}", Load("rate", float(f) * measured_capacity), None) for f in args.fractions.split(",")]
        for salt, (name, load, measured_report) in enumerate(runs, start=1):
            if measured_report is None:
                measured_report = run_once(target, config, load, out / name / "measured", salt=salt)
            simulated_report = simulate_once(profile, config, load, FleetConfig(), out / name / "simulated",
                                             tokens=target.tokens, salt=salt)  # fmt: skip
            measured, predicted = _figures(measured_report), _figures(simulated_report)
            ratios = _ratios(predicted, measured)
            within = all(ratios[f"{m}_{q}"] is not None and abs(ratios[f"{m}_{q}"] - 1) <= TOLERANCE for m, q in METRICS)
            results["runs"][name] = {"load": load.describe(config), "measured": measured, "predicted": predicted,
                                     "ratio": ratios, "within_15pct": within}  # fmt: skip
            print(name, json.dumps(results["runs"][name], default=lambda x: round(x, 4)), flush=True)
    finally:
        server.stop()
    results["seconds"] = round(time.time() - started, 1)
    (out / "fidelity.json").write_text(json.dumps(results, indent=1))
    print(f"written to {out}/fidelity.json")


if __name__ == "__main__":
    main()
