"""The SLO class label of a request, shared by tenancy (which assigns it) and the metrics (which
label by it): a module of its own so that tenancy needs no Prometheus."""

from __future__ import annotations


def priority_class(priority: int) -> str:
    """A bounded label for a free-form integer priority (lower runs first; 0 is interactive):
    the SLO class of a request when no tenants file names one."""
    return "interactive" if priority <= 0 else "batch"
