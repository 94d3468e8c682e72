"""The process's limits on requests in flight, in all and per client address, alone and under a
tenant's own limit: what is refused, what is counted, and that every slot comes back."""

from __future__ import annotations

import pytest

from servelm.tenancy.config import Tenant
from servelm.tenancy.limits import InFlightLimits, LimitExceeded, TenantLimits


def test_in_all_and_per_client():
    limits = InFlightLimits(max_total=3, max_per_client=2)
    a1, a2 = limits.enter("10.0.0.1"), limits.enter("10.0.0.1")
    with pytest.raises(LimitExceeded) as refused:
        limits.enter("10.0.0.1")
    assert refused.value.limit == "--max-concurrent-requests-per-client" and refused.value.retry_after_s == 1
    assert "(10.0.0.1) has 2 requests in flight" in refused.value.message
    b1 = limits.enter("10.0.0.2")
    with pytest.raises(LimitExceeded) as refused:
        limits.enter("10.0.0.3")  # a new client, but the process is full
    assert refused.value.limit == "--max-concurrent-requests"
    a1.release()
    a1.release()  # idempotent: the count is not released twice
    assert limits.num_total == 2 and limits.num_in_flight("10.0.0.1") == 1
    limits.enter("10.0.0.3").release()
    for slot in (a2, b1):
        slot.release()
    assert limits.num_total == 0 and limits._per_client == {}, "no entry is kept for a client with nothing in flight"


def test_no_limits_by_default_and_bad_limits_refused():
    limits = InFlightLimits()
    slots = [limits.enter("x") for _ in range(1000)]
    assert limits.num_in_flight("x") == 1000
    for slot in slots:
        slot.release()
    with pytest.raises(ValueError, match="max_per_client"):
        InFlightLimits(max_per_client=0)


def test_a_tenant_at_its_limit_gives_the_process_slot_back():
    tenant = Tenant("t", slo_class=None, max_concurrent_requests=1)
    limits = TenantLimits([tenant], in_flight=InFlightLimits(max_total=5, max_per_client=5))
    lease = limits.enter(tenant, "10.0.0.1")
    with pytest.raises(LimitExceeded, match="max_concurrent_requests"):
        limits.enter(tenant, "10.0.0.1")
    assert limits.in_flight.num_total == 1, "the refused request holds no process slot"
    lease.release()
    assert limits.in_flight.num_total == 0 and limits.num_in_flight(tenant) == 0
