"""Which tenant a request comes from (its API key), and the priority and SLO it runs with.

    no --tenants, no --api-key   every caller is tenant "default"; the priority names the class
    no --tenants, --api-key K    K is tenant "default" (as above); no key or another key: 401
    --tenants F                  every key of F is its tenant; any other key: 401
    --tenants F and --api-key K  as F, plus K as tenant "default" of class interactive

Keys are compared as sha256 digests, each known digest with `hmac.compare_digest` and no early
exit, so the time taken says nothing about how close a guess was or which tenant it hit.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import replace

from servelm.datatypes import RequestSlo
from servelm.schemas.slo_class import priority_class
from servelm.tenancy.config import DEFAULT_TENANT, SloClass, Tenant, TenantsConfig, TenantsConfigError, key_digest

_BEARER = b"Bearer "


class TenantRegistry:
    """Immutable after construction: safe to share between concurrent requests."""

    def __init__(self, tenants: Sequence[Tenant], open_to: Tenant | None = None) -> None:
        """`open_to`: the tenant of every caller, key or none (no key is configured at all)."""
        self.tenants = tuple(tenants)
        self.open_to = open_to
        self._digests = [(digest, tenant) for tenant in self.tenants for digest in tenant.key_digests]

    @classmethod
    def build(cls, config: TenantsConfig | None, api_key: str | None) -> TenantRegistry:
        """The registry for `--tenants` (loaded: `config`) and `--api-key` (see the module docstring)."""
        if config is None:
            default = Tenant(DEFAULT_TENANT, slo_class=None, key_digests=(key_digest(api_key),) if api_key else ())
            return cls([default], open_to=None if api_key else default)
        tenants = list(config.tenants)
        if api_key:
            if any(t.name == DEFAULT_TENANT for t in tenants):
                raise TenantsConfigError(f"--api-key is tenant {DEFAULT_TENANT!r}, which the tenants file defines "
                                         "too: drop one of them")  # fmt: skip
            if any(key_digest(api_key) in t.key_digests for t in tenants):
                raise TenantsConfigError("--api-key is also a key in the tenants file: a key must name one tenant")
            tenants.append(Tenant(DEFAULT_TENANT, config.classes["interactive"], (key_digest(api_key),)))
        return cls(tenants)

    def in_class(self, name: str, slo_class: SloClass) -> Tenant:
        """Tenant `name` (as its requests are limited) with every request in `slo_class` at its
        priority: how a batch's lines run, whatever class the tenant's own requests are."""
        tenant = next((t for t in self.tenants if t.name == name), None) or Tenant(name, slo_class=None)
        return replace(tenant, slo_class=slo_class, priority_range=None)

    def authenticate(self, authorization: bytes) -> Tenant | None:
        """The tenant an `Authorization` header value names (`Bearer KEY`), or None: answer 401."""
        if self.open_to is not None:
            return self.open_to
        if not authorization.startswith(_BEARER):
            return None
        given = hashlib.sha256(authorization[len(_BEARER) :]).digest()  # key_digest's, over the header's bytes
        found = None
        for digest, tenant in self._digests:  # all of them, whatever matched: constant time
            if hmac.compare_digest(given, digest):
                found = tenant
        return found


def request_slo(tenant: Tenant, priority: int) -> tuple[int, RequestSlo]:
    """The priority a request of `tenant` runs at (the client's, clamped into the tenant's range;
    by default exactly its class's) and the SLO stamped on its engine requests."""
    slo_class = tenant.slo_class
    if slo_class is None:  # no tenants file: today's behaviour, the priority is the client's
        return priority, RequestSlo(tenant=tenant.name, slo_class=priority_class(priority))
    allowed = tenant.priority_range
    clamped = allowed.clamp(priority) if allowed is not None else slo_class.priority
    slo = RequestSlo(tenant=tenant.name, slo_class=slo_class.name, ttft_target_s=slo_class.ttft_s,
                     tbt_target_s=slo_class.tbt_s, weight=tenant.weight, kv_retention=slo_class.kv_retention,
                     ages=slo_class.ages)  # fmt: skip
    return clamped, slo
