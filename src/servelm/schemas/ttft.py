"""The vocabulary of where a request's time to first token went, shared by the server that
measures it (obs/attribution.py: the x-servelm-ttft-breakdown header, the request log), the
benchmark that reads it from outside (bench/) and the diagnosis that explains it (diagnose/):
the components' names, the client-side "network" remainder, and the percentile all three report."""

from __future__ import annotations

import math
from collections.abc import Iterable

# In the order a request meets them; they sum to the server's TTFT (obs/attribution.py says each).
TTFT_COMPONENTS = ("ingress", "grammar", "queue", "kv_load", "kv_transfer", "prefill", "preemption", "output")
# Client-measured TTFT less the server's: the request's trip in and the first chunk's out.
NETWORK = "network"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's
    default), None for no values."""
    data = sorted(values)
    if not data:
        return None
    position = (len(data) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return float(data[low] + (data[high] - data[low]) * (position - low))
