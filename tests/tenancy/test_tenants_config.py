"""The tenants file: built-in classes, the example in deploy/, and an error naming the file and
field for each kind of mistake (never echoing a key); key lookup and the priority clamp."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.tenancy.config import BUILTIN_CLASSES, PriorityRange, TenantsConfigError, load_tenants
from servelm.tenancy.limits import LimitExceeded, TenantLimits
from servelm.tenancy.registry import TenantRegistry, request_slo

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "tenants.example.yaml"


def _load(tmp_path: Path, text: str):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return load_tenants(path)


def test_the_example_file_loads_with_builtin_and_own_classes():
    config = load_tenants(EXAMPLE)
    assert set(config.classes) == {"realtime", "interactive", "batch", "bulk"}
    assert config.classes["interactive"] == BUILTIN_CLASSES["interactive"]
    assert config.classes["bulk"].tbt_s is None and config.classes["bulk"].priority == 2
    tenants = {t.name: t for t in config.tenants}
    assert tenants["voice"].slo_class is not None and tenants["voice"].slo_class.name == "realtime"
    assert tenants["voice"].weight == 2.0 and tenants["voice"].tokens_per_minute is None
    assert tenants["code"].priority_range == PriorityRange(0, 1) and len(tenants["code"].key_digests) == 2
    assert "REPLACE" not in repr(config)  # keys are kept as digests only


@pytest.mark.parametrize(
    "text, message",
    [
        ("tenants: {a: {api_keys: [k], class: gold}}", r"tenants\.a\.class: 'gold'; expected one of \['batch'"),
        ("tenants: {a: {api_keys: [k1], class: batch}, b: {api_keys: [k1], class: batch}}",
         r"tenants\.b\.api_keys\[0\]: the same key is already a key of tenant 'a'"),
        ("tenants: {a: {api_keys: [k], class: batch, max_concurrent_requests: -1}}",
         r"tenants\.a\.max_concurrent_requests: must be at least 1, got -1"),
        ("tenants: {a: {api_keys: [k], class: batch, tokens_per_minte: 5}}", r"tenants\.a: unknown field\(s\) \['tokens_per_minte'\]"),
        ("tenants: {a: {api_keys: [k], class: batch, priority: {min: 2, max: 1}}}", r"tenants\.a\.priority: min 2 is above max 1"),
        ("classes: {gold: {ttft_s: -1, priority: 0}}\ntenants: {a: {api_keys: [k], class: gold}}",
         r"classes\.gold\.ttft_s: expected a positive number of seconds, got -1"),
        ("tenants: {a: {api_keys: [], class: batch}}", r"tenants\.a\.api_keys: expected a non-empty list"),
        ("classes: {gold: {priority: 0, kv_retention: forever}}\ntenants: {a: {api_keys: [k], class: gold}}",
         r"classes\.gold\.kv_retention: 'forever'; expected one of \['low', 'normal', 'high'\]"),
        ("classes: {gold: {priority: 0, ages: 'no'}}\ntenants: {a: {api_keys: [k], class: gold}}",
         r"classes\.gold\.ages: expected true or false, got 'no'"),
        ("tenants: {a: {api_keys: [k], class: batch, models: []}}", r"tenants\.a\.models: expected a non-empty list of model names"),
        ("tenants: {a: {api_keys: [k], class: batch, models: sql}}", r"tenants\.a\.models: expected a non-empty list"),
        ("tenant: {}", r"the file: unknown field\(s\) \['tenant'\]"),
        ("tenants: [", "cannot read the tenants file"),
    ],
)  # fmt: skip
def test_mistakes_name_the_file_and_the_field(tmp_path, text, message):
    with pytest.raises(TenantsConfigError, match=message) as error:
        _load(tmp_path, text)
    assert str(tmp_path / "tenants.yaml") in str(error.value)
    assert "k1" not in str(error.value)  # a duplicate key is named by position, never shown


def test_a_tenant_may_be_limited_to_named_models(tmp_path):
    config = _load(tmp_path, "tenants: {fin: {api_keys: [k1], class: interactive, models: [base, fin-sql]}, "
                             "open: {api_keys: [k2], class: interactive}}")  # fmt: skip
    tenants = {t.name: t for t in config.tenants}
    assert tenants["fin"].may_use("fin-sql") and tenants["fin"].may_use("base")
    assert not tenants["fin"].may_use("legal")
    assert tenants["open"].models is None and tenants["open"].may_use("legal")


def test_a_class_kv_retention_reaches_its_requests_slo(tmp_path):
    config = _load(tmp_path, "classes: {docs: {priority: 1, kv_retention: low}}\n"
                             "tenants: {a: {api_keys: [k], class: docs}, b: {api_keys: [k2], class: batch}}")  # fmt: skip
    tenants = {t.name: t for t in config.tenants}
    assert request_slo(tenants["a"], 0)[1].kv_retention == "low"
    assert request_slo(tenants["b"], 0)[1].kv_retention == "normal"


def test_the_batch_class_does_not_age_unless_a_file_says_so(tmp_path):
    """Batch lines fill idle capacity: aging must not lift them past interactive traffic. A file
    overriding `batch` keeps that unless it sets `ages`; its own classes age by default."""
    config = _load(tmp_path, "classes: {docs: {priority: 1}, batch: {priority: 2, ttft_s: 60}, slow: {priority: 3, ages: false}}\n"
                             "tenants: {a: {api_keys: [k], class: docs}, b: {api_keys: [k2], class: batch},"
                             " c: {api_keys: [k3], class: interactive}, d: {api_keys: [k4], class: slow}}")  # fmt: skip
    tenants = {t.name: t for t in config.tenants}
    assert [request_slo(tenants[n], 0)[1].ages for n in "abcd"] == [True, False, True, False]
    assert BUILTIN_CLASSES["batch"].ages is False
    again = _load(tmp_path, "classes: {batch: {priority: 1, ages: true}}\ntenants: {b: {api_keys: [k], class: batch}}")
    assert request_slo(again.tenants[0], 0)[1].ages is True


def test_keys_name_their_tenant_and_the_priority_is_clamped(tmp_path):
    config = _load(tmp_path, "tenants: {voice: {api_keys: [kv], class: realtime},\n"
                             "          code: {api_keys: [kc], class: batch, priority: {min: 1, max: 3}, weight: 2}}")  # fmt: skip
    registry = TenantRegistry.build(config, api_key="ka")
    voice, code, default = (registry.authenticate(b"Bearer " + k) for k in (b"kv", b"kc", b"ka"))
    assert (voice.name, code.name, default.name) == ("voice", "code", "default")
    assert registry.authenticate(b"Bearer nope") is None and registry.authenticate(b"") is None
    assert registry.authenticate(b"kv") is None  # not a bearer header
    priority, slo = request_slo(code, 7)
    assert priority == 3 and (slo.tenant, slo.slo_class, slo.ttft_target_s, slo.tbt_target_s) == ("code", "batch", 30.0, 1.0)
    assert slo.weight == 2.0 and request_slo(voice, 0)[1].weight == 1.0  # the fair share weight reaches the scheduler
    assert request_slo(code, -5)[0] == 1 and request_slo(voice, 9)[0] == 0  # no range: the class's priority
    assert request_slo(default, 4) == (0, request_slo(default, 0)[1])  # --api-key with a file: interactive
    with pytest.raises(TenantsConfigError, match="also a key in the tenants file"):
        TenantRegistry.build(config, api_key="kv")


def test_without_a_file_everyone_is_default_and_the_priority_names_the_class():
    registry = TenantRegistry.build(None, api_key=None)
    tenant = registry.authenticate(b"")
    assert tenant is not None and request_slo(tenant, 5) == (5, request_slo(tenant, 5)[1])
    assert request_slo(tenant, 5)[1].slo_class == "batch" and request_slo(tenant, 0)[1].slo_class == "interactive"
    assert request_slo(tenant, 0)[1].ttft_target_s is None
    keyed = TenantRegistry.build(None, api_key="secret")
    assert keyed.authenticate(b"Bearer secret") is not None and keyed.authenticate(b"Bearer other") is None


def test_token_bucket_retry_after_and_refund(tmp_path):
    """600 tokens a minute = 10 per second: Retry-After is when the bucket will hold the request."""
    config = _load(tmp_path, "tenants: {a: {api_keys: [k], class: batch, tokens_per_minute: 600, max_concurrent_requests: 2}}")
    now = [0.0]
    limits = TenantLimits(config.tenants, clock=lambda: now[0])
    [tenant] = config.tenants
    first = limits.enter(tenant)
    first.reserve(100, 400)  # 100 left
    second = limits.enter(tenant)
    with pytest.raises(LimitExceeded) as refused:
        second.reserve(50, 100)  # needs 150: 50 short = 5 s
    assert refused.value.retry_after_s == 5 and refused.value.limit == "tokens_per_minute"
    with pytest.raises(LimitExceeded, match="max_concurrent_requests"):
        limits.enter(tenant)
    first.count_generated(lambda: 150)
    first.release()  # 250 of its 400 max-new tokens were not generated: back in the bucket
    first.release()  # idempotent
    second.reserve(50, 100)
    assert limits.num_in_flight(tenant) == 1
    with pytest.raises(LimitExceeded) as too_large:
        limits.enter(tenant).reserve(100, 501)
    assert too_large.value.retry_after_s is None  # larger than the whole minute: never fits
