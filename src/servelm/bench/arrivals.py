"""When requests are sent: open-loop arrival processes, or a closed loop at a concurrency.

    poisson   exponential gaps with mean 1/rate
    gamma     gamma gaps with mean 1/rate and shape = burstiness (vLLM's convention):
              burstiness 1 is Poisson, < 1 burstier (clumps and lulls), > 1 more even
    daily     Poisson whose rate follows a day: rate x (1 - DAILY_SWING cos(2 pi t / 1 day)), so
              `rate` on average, its trough at t = 0 (midnight) and its peak at noon (1M requests
              a day: --rate 11.57); drawn by thinning a Poisson process at the peak rate
    closed    no times: `concurrency` requests in flight, the next sent when one finishes
    trace     the trace's own timestamps, scaled (see bench.trace)

Open-loop times are fixed before the run from the seed: the load does not slow down when
the server does, which is the point of measuring at a rate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from servelm.bench.workload import WorkloadRequest

ARRIVALS = ("poisson", "gamma", "daily")
DAY_S = 86400.0
DAILY_SWING = 0.6  # the peak is 1.6x the day's mean rate, the trough 0.4x


@dataclass(frozen=True)
class ArrivalConfig:
    kind: str = "poisson"  # poisson | gamma | daily
    rate: float = 1.0  # requests per second
    burstiness: float = 1.0  # gamma shape

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.kind!r}: expected one of {list(ARRIVALS)}")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def arrival_times(config: ArrivalConfig, num_requests: int, seed: int = 0) -> list[float]:
    """Seconds after the start; the first request goes at 0."""
    rng = random.Random(f"{seed}:arrivals")
    if config.kind == "daily":
        return _daily_times(rng, config.rate, num_requests)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += _gap(rng, config)
        times.append(now)
    return times


def daily_rate(mean_rate: float, t: float) -> float:
    """The daily curve's rate at `t` seconds after midnight."""
    return mean_rate * (1.0 - DAILY_SWING * math.cos(2.0 * math.pi * t / DAY_S))


def _daily_times(rng: random.Random, mean_rate: float, num_requests: int) -> list[float]:
    peak = mean_rate * (1.0 + DAILY_SWING)
    times, now = [0.0], 0.0
    while len(times) < num_requests:
        now += rng.expovariate(peak)
        if rng.random() * peak <= daily_rate(mean_rate, now):
            times.append(now)
    return times[:num_requests]


def _gap(rng: random.Random, config: ArrivalConfig) -> float:
    if config.kind == "poisson":
        return rng.expovariate(config.rate)
    # Gamma with shape k and scale 1/(rate k): mean 1/rate, coefficient of variation 1/sqrt(k).
    return rng.gammavariate(config.burstiness, 1.0 / (config.rate * config.burstiness))


def assign_arrivals(requests: list[WorkloadRequest], times: list[float] | None) -> list[WorkloadRequest]:
    """Set each request's arrival time (None: closed loop); returns the same list."""
    if times is not None and len(times) != len(requests):
        raise ValueError(f"{len(times)} arrival times for {len(requests)} requests")
    for i, request in enumerate(requests):
        request.arrival_s = None if times is None else times[i]
    return requests
