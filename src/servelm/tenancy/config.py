"""The tenants file (`servelm serve --tenants FILE`): who may call, in which SLO class, within which limits.

    classes:                      # optional: built-in realtime / interactive / batch, overridable
      voice-bot: {ttft_s: 0.3, tbt_s: 0.1, priority: 0}
      batch: {ttft_s: 60, priority: 2}   # optional `ages` (true; false for the built-in batch class)
    tenants:
      voice:
        api_keys: [sk-voice-1]    # secrets: kept here only as sha256 digests, never logged
        class: voice-bot
        max_concurrent_requests: 8            # optional: HTTP requests in flight (n choices count once)
        tokens_per_minute: 200000             # optional: prompt + max_tokens, refunded when unused
        priority: {min: 0, max: 1}            # optional: the client's `priority` is clamped into it
        weight: 2                             # optional (1): the tenant's fair share, for the scheduler
        models: [voice-ft]                    # optional: the models (served name, LoRA adapters) it may
                                              # use; others answer 404 model_not_found (default: all)

A class's `priority` is what its requests run at unless the tenant allows a range; lower runs
first (vLLM's convention). Its targets (seconds) are what `servelm:request_slo_met` judges and
what the scheduler orders by. Every mistake is a TenantsConfigError naming the file and the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from servelm.datatypes import KV_RETENTIONS

DEFAULT_TENANT = "default"


class TenantsConfigError(ValueError):
    """A tenants file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class SloClass:
    name: str
    priority: int  # what the class's requests run at; lower runs first
    ttft_s: float | None = None  # time-to-first-token target; None: no promise
    tbt_s: float | None = None  # time-between-tokens target; None: no promise
    kv_retention: str = "normal"  # its requests' KV in the host/disk tiers (datatypes.KV_RETENTIONS)
    ages: bool = True  # waiting lifts its requests a priority per --aging-s (datatypes.RequestSlo.ages)


BUILTIN_CLASSES: Mapping[str, SloClass] = {
    "realtime": SloClass("realtime", priority=0, ttft_s=0.3, tbt_s=0.1),
    "interactive": SloClass("interactive", priority=0, ttft_s=1.0, tbt_s=0.2),
    # Batch lines fill idle capacity: they never age past interactive traffic.
    "batch": SloClass("batch", priority=1, ttft_s=30.0, tbt_s=1.0, ages=False),
}


@dataclass(frozen=True)
class PriorityRange:
    min: int
    max: int

    def clamp(self, priority: int) -> int:
        return min(max(priority, self.min), self.max)


@dataclass(frozen=True)
class Tenant:
    name: str
    slo_class: SloClass | None  # None: no tenants file; the request's priority names its class (registry.request_slo)
    key_digests: tuple[bytes, ...] = field(default=(), repr=False)  # sha256 of each API key
    max_concurrent_requests: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None  # None: unlimited
    priority_range: PriorityRange | None = None  # None: exactly the class's priority
    weight: float = 1.0
    models: frozenset[str] | None = None  # the model names it may use (the base's, adapters'); None: all

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class TenantsConfig:
    classes: Mapping[str, SloClass]
    tenants: tuple[Tenant, ...]


def key_digest(api_key: str) -> bytes:
    """What a key is kept as: never the key itself (it would reach reprs, logs and core dumps)."""
    return hashlib.sha256(api_key.encode()).digest()


def load_tenants(path: Path) -> TenantsConfig:
    """Parse and check a tenants file; TenantsConfigError (naming `path` and the field) if anything is wrong."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TenantsConfigError(f"{path}: cannot read the tenants file: {exc}") from exc
    return parse_tenants(raw, str(path))


def parse_tenants(raw: Any, source: str) -> TenantsConfig:
    """The checked config of an already parsed YAML document (`source` names it in errors)."""
    top = _mapping(raw, source, "the file", {"classes", "tenants"})
    classes = dict(BUILTIN_CLASSES)
    for name, spec in _mapping(top.get("classes", {}), source, "classes").items():
        classes[_name(name, source, "classes")] = _slo_class(name, spec, source)
    tenants_raw = _mapping(top.get("tenants"), source, "tenants")
    if not tenants_raw:
        raise TenantsConfigError(f"{source}: tenants: at least one tenant is needed")
    owners: dict[bytes, str] = {}
    tenants = []
    for name, spec in tenants_raw.items():
        tenant = _tenant(_name(name, source, "tenants"), spec, classes, source)
        for index, digest in enumerate(tenant.key_digests):
            if digest in owners:  # the key itself is a secret: name where it is, never what it is
                raise TenantsConfigError(f"{source}: tenants.{name}.api_keys[{index}]: the same key is already a key of "
                                         f"tenant {owners[digest]!r}; a key must name one tenant")  # fmt: skip
            owners[digest] = tenant.name
        tenants.append(tenant)
    return TenantsConfig(classes, tuple(tenants))


def _slo_class(name: str, spec: Any, source: str) -> SloClass:
    where = f"classes.{name}"
    fields = _mapping(spec, source, where, {"ttft_s", "tbt_s", "priority", "kv_retention", "ages"})
    if "priority" not in fields:
        raise TenantsConfigError(f"{source}: {where}.priority: missing (an integer, lower runs first)")
    kv_retention = fields.get("kv_retention", "normal")
    if kv_retention not in KV_RETENTIONS:
        raise TenantsConfigError(f"{source}: {where}.kv_retention: {kv_retention!r}; expected one of {list(KV_RETENTIONS)}")
    # A class overriding a built-in one keeps its aging unless it says otherwise (batch: none).
    builtin = BUILTIN_CLASSES.get(name)
    ages = fields.get("ages", builtin.ages if builtin is not None else True)
    if not isinstance(ages, bool):
        raise TenantsConfigError(f"{source}: {where}.ages: expected true or false, got {ages!r}")
    return SloClass(
        name,
        priority=_int(fields["priority"], source, f"{where}.priority", minimum=None),
        ttft_s=_seconds(fields.get("ttft_s"), source, f"{where}.ttft_s"),
        tbt_s=_seconds(fields.get("tbt_s"), source, f"{where}.tbt_s"),
        kv_retention=kv_retention,
        ages=ages,
    )


_TENANT_FIELDS = {"api_keys", "class", "max_concurrent_requests", "tokens_per_minute", "priority", "weight", "models"}


def _tenant(name: str, spec: Any, classes: Mapping[str, SloClass], source: str) -> Tenant:
    where = f"tenants.{name}"
    fields = _mapping(spec, source, where, _TENANT_FIELDS)
    class_name = fields.get("class")
    slo_class = classes.get(class_name) if isinstance(class_name, str) else None
    if slo_class is None:
        raise TenantsConfigError(f"{source}: {where}.class: {'missing' if class_name is None else repr(class_name)}; "
                                 f"expected one of {sorted(classes)}")  # fmt: skip
    keys = fields.get("api_keys")
    if not isinstance(keys, list) or not keys:
        raise TenantsConfigError(f"{source}: {where}.api_keys: expected a non-empty list of keys")
    digests = []
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not key.strip():
            raise TenantsConfigError(f"{source}: {where}.api_keys[{index}]: expected a non-empty string")
        digest = key_digest(key)
        if digest in digests:
            raise TenantsConfigError(f"{source}: {where}.api_keys[{index}]: the same key twice")
        digests.append(digest)
    weight = fields.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise TenantsConfigError(f"{source}: {where}.weight: expected a positive number, got {weight!r}")
    return Tenant(
        name,
        slo_class,
        tuple(digests),
        max_concurrent_requests=_optional_int(fields, "max_concurrent_requests", source, where),
        tokens_per_minute=_optional_int(fields, "tokens_per_minute", source, where),
        priority_range=_priority_range(fields.get("priority"), source, f"{where}.priority"),
        weight=float(weight),
        models=_models(fields.get("models"), source, f"{where}.models"),
    )


def _models(spec: Any, source: str, where: str) -> frozenset[str] | None:
    if spec is None:
        return None
    if not isinstance(spec, list) or not spec or not all(isinstance(m, str) and m.strip() for m in spec):
        raise TenantsConfigError(f"{source}: {where}: expected a non-empty list of model names, got {spec!r}")
    return frozenset(spec)


def _priority_range(spec: Any, source: str, where: str) -> PriorityRange | None:
    if spec is None:
        return None
    fields = _mapping(spec, source, where, {"min", "max"})
    if set(fields) != {"min", "max"}:
        raise TenantsConfigError(f"{source}: {where}: expected both min and max, got {sorted(fields)}")
    low = _int(fields["min"], source, f"{where}.min", minimum=None)
    high = _int(fields["max"], source, f"{where}.max", minimum=None)
    if low > high:
        raise TenantsConfigError(f"{source}: {where}: min {low} is above max {high}")
    return PriorityRange(low, high)


def _mapping(value: Any, source: str, where: str, allowed: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TenantsConfigError(f"{source}: {where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if allowed is not None and k not in allowed)
    if unknown:
        raise TenantsConfigError(f"{source}: {where}: unknown field(s) {unknown}; expected some of {sorted(allowed or ())}")
    return value


def _name(value: Any, source: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise TenantsConfigError(f"{source}: {where}: names must be non-empty strings, got {value!r}")
    return value


def _int(value: Any, source: str, where: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TenantsConfigError(f"{source}: {where}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise TenantsConfigError(f"{source}: {where}: must be at least {minimum}, got {value}")
    return value


def _optional_int(fields: dict[str, Any], name: str, source: str, where: str) -> int | None:
    value = fields.get(name)
    return None if value is None else _int(value, source, f"{where}.{name}", minimum=1)


def _seconds(value: Any, source: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise TenantsConfigError(f"{source}: {where}: expected a positive number of seconds, got {value!r}")
    return float(value)
