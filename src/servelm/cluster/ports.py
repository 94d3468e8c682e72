"""Finding free local ports for a cluster whose config numbers its ports consecutively (servelm.ports)."""

from __future__ import annotations

from servelm.ports import free_port_range, ports_free

__all__ = ["free_port_range", "ports_free"]
