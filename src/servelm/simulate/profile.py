"""What a step costs on one machine: the cost profile a simulated replica runs on.

A step of the real engine takes

    forward(shape)  = coefficients . (1, StepShape counts)    scheduler/step_cost.py's linear model
    + step_overhead_s + row_overhead_s x rows                 scheduling, update, outputs out of the core

and a request spends `request_overhead_s` outside the engine (HTTP, tokenization, the trip into
the core and its first token's trip out). `calibrate.py` measures all of them on the host it runs
on; the profile also keeps the start-up calibration the real engine seeded its scheduler's
step-cost model with, so a simulated scheduler sizes its chunks exactly as the real one did
from its first step, and then learns the profile's costs step by step as the real one learns
the machine's.

A profile says what it is (`kind`, `name`): "calibrated" on a named host, or "roofline": derived
from a device's published bandwidth and FLOPs, never measured, and every output says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelm.scheduler.step_cost import FEATURES, StepShape

PROFILE_SCHEMA = "servelm-cost-profile/1"
CALIBRATED, ROOFLINE = "calibrated", "roofline"


@dataclass(frozen=True)
class EngineShape:
    """The engine the profile is of, as its start-up resolved it: what a simulated replica copies."""

    model: str  # the model's name (the default model: its id)
    num_blocks: int  # the KV pool's blocks
    block_size: int
    max_model_len: int
    layered_prefill_layers: int  # Scheduler(num_layers=...): 0 when chunks are token chunks only
    # `servelm serve` flags (EngineConfig.from_flat keywords) the engine was built with beyond its
    # defaults; a simulated replica's SchedulerConfig comes from the same.
    engine_flags: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CostProfile:
    name: str  # the host or device: "AMD EPYC family 25 model 17, 2 CPUs" | "NVIDIA H200 (roofline)"
    kind: str  # CALIBRATED | ROOFLINE
    created: str  # ISO date and time
    coefficients: tuple[float, ...]  # seconds per unit of each step_cost.FEATURES
    step_overhead_s: float  # every step beyond its forward
    row_overhead_s: float  # ... per request in the step
    request_overhead_s: float  # a request's time outside the engine (into the core, its first token out)
    calibration: tuple[tuple[StepShape, float], ...]  # the engine's start-up calibration: its scheduler's prior
    engine: EngineShape
    notes: str = ""  # how it was made: the command, the fit's error

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a profile has {len(FEATURES)} coefficients ({', '.join(FEATURES)}), got {len(self.coefficients)}")
        if self.kind not in (CALIBRATED, ROOFLINE):
            raise ValueError(f"profile kind must be {CALIBRATED} or {ROOFLINE}, got {self.kind!r}")
        if min(self.coefficients) < 0 or min(self.step_overhead_s, self.row_overhead_s, self.request_overhead_s) < 0:
            raise ValueError("a profile's costs are never negative")

    @property
    def label(self) -> str:
        """What every simulated output is headed with."""
        how = "calibrated on" if self.kind == CALIBRATED else "roofline estimate for"
        return f"simulated ({how} {self.name}, {self.engine.model})"

    def forward_s(self, shape: StepShape) -> float:
        """The forward of a step of `shape`: what the runner's timing (execute_seconds) would say."""
        return sum(c * x for c, x in zip(self.coefficients, shape.features()))

    def step_s(self, shape: StepShape, num_rows: int) -> float:
        """A step's whole period: its forward and what the engine loop does around it."""
        return self.forward_s(shape) + self.step_overhead_s + self.row_overhead_s * num_rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = PROFILE_SCHEMA
        out["coefficients"] = dict(zip(FEATURES, self.coefficients))
        out["calibration"] = [{"shape": asdict(shape), "seconds": seconds} for shape, seconds in self.calibration]
        return out

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CostProfile:
        if raw.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"not a cost profile ({PROFILE_SCHEMA}): schema {raw.get('schema')!r}")
        coefficients = raw["coefficients"]
        missing = [name for name in FEATURES if name not in coefficients]
        if missing:
            raise ValueError(f"cost profile lacks coefficients {missing}")
        return cls(
            name=raw["name"], kind=raw["kind"], created=raw["created"],
            coefficients=tuple(float(coefficients[name]) for name in FEATURES),
            step_overhead_s=float(raw["step_overhead_s"]), row_overhead_s=float(raw["row_overhead_s"]),
            request_overhead_s=float(raw["request_overhead_s"]),
            calibration=tuple((StepShape(**step["shape"]), float(step["seconds"])) for step in raw["calibration"]),
            engine=EngineShape(**raw["engine"]), notes=raw.get("notes", ""),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a cost profile: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a complete cost profile: {exc!r}") from exc
