"""`servelm simulate run`: a bench workload through a simulated fleet, reported as `servelm bench run` reports.

    BenchConfig + Load ──▶ the same requests bench would send (bench.execute.workload_requests:
    its profiles, arrival processes and traces) ──▶ Fleet ──▶ records ──▶ run.json, summary.md,
    plots; headed "simulated (calibrated on HOST | roofline estimate for DEVICE, MODEL)"

Beyond bench's numbers the report's `server` section holds what only a simulation sees: each
replica's utilization (virtual seconds in steps over the run), the prefix hit rate, the fullest
each KV pool got, and, given a price per device-hour, what a million tokens cost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from servelm.bench.execute import BenchConfig, Load, workload_requests, write_run
from servelm.bench.report import run_markdown, run_report
from servelm.bench.stats import summarize
from servelm.bench.tokens import TokenSource, load_token_source
from servelm.bench.workload import LengthLimits
from servelm.simulate.fleet import Fleet, FleetConfig, FleetResult
from servelm.simulate.profile import CostProfile


@dataclass(frozen=True)
class Pricing:
    device_hour: float  # what one replica's device costs an hour (any currency)
    devices_per_replica: int = 1

    def per_million_tokens(self, result: FleetResult, num_replicas: int, tokens: int) -> float | None:
        """The fleet's cost over the run per million of `tokens` (None when none was served)."""
        if tokens <= 0:
            return None
        hours = result.duration_s / 3600.0
        return self.device_hour * self.devices_per_replica * num_replicas * hours / (tokens / 1e6)


def simulate_once(profile: CostProfile, config: BenchConfig, load: Load, fleet: FleetConfig, out_dir: Path,
                  tokens: TokenSource | None = None, pricing: Pricing | None = None, salt: int = 0) -> dict[str, Any]:  # fmt: skip
    """Build the workload, run it through the fleet, write run.json / summary.md (/ plots); the report.
    `salt`: bench's (the same lengths and sharing with other tokens), to replay a measured run's requests."""
    tokens = tokens or load_token_source(config.tokenizer)
    limits = LengthLimits(config.max_context or profile.engine.max_model_len, config.prompt_scale, config.max_output_tokens)
    requests = workload_requests(tokens, limits, config, load, salt)
    concurrency = int(load.value or 1) if load.kind == "concurrency" else None
    fleet = replace(fleet, concurrency=concurrency, duration_s=config.duration_s)
    result = Fleet(profile, fleet).run(requests)
    summary = summarize(result.records, config.slos, result.duration_s)
    overall = summary.overall
    server = {
        "simulated": True, "label": profile.label, "model_id": profile.label, "base_url": "simulated",
        "is_servelm": True, "profile": {"name": profile.name, "kind": profile.kind, "created": profile.created,
                                        "notes": profile.notes},
        "replicas": fleet.num_replicas, "policy": fleet.policy if fleet.num_replicas > 1 else None,
        "utilization": [round(u, 4) for u in result.utilization()], "prefix_hit_rate": result.prefix_hit_rate,
        "peak_kv_usage": [round(u, 4) for u in result.peak_kv_usage], "num_steps": result.num_steps,
    }  # fmt: skip
    if pricing is not None:
        server["cost_per_million_output_tokens"] = pricing.per_million_tokens(result, fleet.num_replicas,
                                                                              overall.num_output_tokens)  # fmt: skip
        server["cost_per_million_tokens"] = pricing.per_million_tokens(
            result, fleet.num_replicas, overall.num_prompt_tokens + overall.num_output_tokens)
    outcome = {"duration_s": result.duration_s, "started_unix": 0.0, "interrupted": False,
               "hit_time_limit": any(r.status == "cancelled" for r in result.records),
               "num_not_sent": result.num_not_sent}  # fmt: skip
    described = {"load": load.describe(config), "load_kind": load.kind, "load_value": load.value, "salt": salt}
    report = run_report(config={**config.to_dict(), **described}, server=server, slos=config.slos, result=outcome,
                        summary=summary, records=result.records)  # fmt: skip
    write_run(report, result.records, out_dir, config.plots, simulated_markdown)
    return report


def simulated_markdown(report: dict[str, Any], plots: list[Path]) -> str:
    """bench's summary, headed as simulated, with what only the simulation measures."""
    server = report["server"]
    lines = [f"> **{server['label']}**: not measured. Replicas {server['replicas']}"
             + (f" behind the `{server['policy']}` router" if server.get("policy") else "")
             + f"; utilization {', '.join(f'{u:.0%}' for u in server['utilization'])}"
             + (f"; prefix hit rate {server['prefix_hit_rate']:.0%}" if server.get("prefix_hit_rate") is not None else "")
             + f"; peak KV usage {', '.join(f'{u:.0%}' for u in server['peak_kv_usage'])}"]  # fmt: skip
    cost = server.get("cost_per_million_output_tokens")
    if cost is not None:
        lines[0] += f"; {cost:.4g} per million output tokens ({server['cost_per_million_tokens']:.4g} per million tokens)"
    return "\n".join(lines) + "\n\n" + run_markdown(report, plots)
