"""A diagnosis as text (top cause first, its evidence, the knob) and as JSON with stable field names:

{"top_cause", "latency" ("ttft", or "tbt" when only the time between tokens grew), "causes": [{"name", "explains_s", "components", "evidence": [{"signal", "baseline",
 "current", "ratio"}], "knob"}], "ttft": {"baseline", "current", "growth_s", "grew"},
 "components": {name: {"baseline", "current", "delta"}}, "signals": {name: {"baseline", "current", "ratio"}},
 "classes": {class: {"baseline", "current"}}, "prefix_evictions_by_tenant": {"baseline", "current"},
 "windows": {"baseline", "current"}, "notes": [...]}
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from servelm.diagnose.causes import Diagnosis, Evidence
from servelm.diagnose.signals import COMPONENTS, SIGNAL_DOCS, Signals


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def to_json(diagnosis: Diagnosis) -> dict[str, Any]:
    base, cur = diagnosis.baseline, diagnosis.current
    return {
        "top_cause": diagnosis.top_cause,
        "latency": diagnosis.latency,
        "causes": [cause.to_dict() for cause in diagnosis.causes],
        "ttft": {
            "baseline": base.ttft_mean_s,
            "current": cur.ttft_mean_s,
            "growth_s": _delta(base.ttft_mean_s, cur.ttft_mean_s),
            "grew": diagnosis.ttft_grew,
        },
        "components": {
            name: {
                "baseline": base.components.get(name),
                "current": cur.components.get(name),
                "delta": _delta(base.components.get(name), cur.components.get(name)),
            }
            for name in COMPONENTS
        },  # fmt: skip
        "signals": {
            name: Evidence(name, base.values.get(name), cur.values.get(name)).to_dict() for name in SIGNAL_DOCS
        },
        "classes": {
            name: {"baseline": _class(base, name), "current": _class(cur, name)}
            for name in sorted({*base.classes, *cur.classes})
        },
        "prefix_evictions_by_tenant": {"baseline": base.evictions_by_tenant, "current": cur.evictions_by_tenant},
        "windows": {"baseline": _window(base), "current": _window(cur)},
        "notes": diagnosis.notes,
    }


def _class(signals: Signals, name: str) -> dict[str, Any] | None:
    found = signals.classes.get(name)
    return asdict(found) if found is not None else None


def _window(signals: Signals) -> dict[str, Any]:
    return {"label": signals.label, "source": signals.source, "duration_s": signals.duration_s}


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f} ms"
    return f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def _evidence_unit(signal: str) -> str:
    seconds = signal.endswith("_s") and not signal.endswith("_per_s")  # a rate is not a duration
    return "ms" if seconds or signal.startswith("ttft.") else ""


def _class_ttft(signals: Signals, name: str) -> str:
    found = signals.classes.get(name)
    return "-" if found is None else f"{_num(found.ttft_mean_s, 'ms')} / {_num(found.ttft_p90_s, 'ms')}"


def to_text(diagnosis: Diagnosis) -> str:
    base, cur = diagnosis.baseline, diagnosis.current
    growth = _delta(base.ttft_mean_s, cur.ttft_mean_s)
    lines = [
        f"servelm diagnose: {base.label} ({base.source}, {base.duration_s:.0f} s) vs "
        f"{cur.label} ({cur.source}, {cur.duration_s:.0f} s)",
        f"TTFT mean per request: {_num(base.ttft_mean_s, 'ms')} -> {_num(cur.ttft_mean_s, 'ms')} "
        f"({'+' if (growth or 0) >= 0 else ''}{_num(growth, 'ms')}; {'grew' if diagnosis.ttft_grew else 'within noise'})",
        "",
    ]
    for rank, cause in enumerate(diagnosis.causes):
        title = "Top cause" if rank == 0 else "Also"
        per = "per request" if diagnosis.latency == "ttft" else "of the mean time between tokens"
        share = f": explains {_num(cause.explains_s, 'ms')} {per}" if cause.explains_s else ""
        parts = f" (growth of {', '.join(cause.components)})" if cause.components else ""
        lines.append(f"{title}: {cause.name}{share}{parts}")
        if cause.knob:
            lines.append(f"  knob: {cause.knob}")
        if rank == 0:
            lines += ["", f"  {'signal':<30} {'baseline':>12} {'current':>12} {'ratio':>8}"]
            for e in cause.evidence:
                unit = _evidence_unit(e.signal)
                lines.append(
                    f"  {e.signal:<30} {_num(e.baseline, unit):>12} {_num(e.current, unit):>12} {_ratio(e.ratio):>8}"
                )
            lines.append("")
    lines += ["", "TTFT components (mean per request):"]
    for name in COMPONENTS:
        old, new = base.components.get(name), cur.components.get(name)
        lines.append(
            f"  {name:<12} {_num(old, 'ms'):>12} -> {_num(new, 'ms'):>12}   delta {_num(_delta(old, new), 'ms')}"
        )
    classes = sorted({*base.classes, *cur.classes})
    if classes:
        lines += ["", "TTFT per class (mean, p90):"]
        for name in classes:
            lines.append(f"  {name:<12} {_class_ttft(base, name)} -> {_class_ttft(cur, name)}")
    if cur.evictions_by_tenant:
        shown = ", ".join(f"{tenant} {rate:.3g}/s" for tenant, rate in sorted(cur.evictions_by_tenant.items()))
        lines += ["", f"Prefix-cache evictions by tenant (current): {shown}"]
    lines += [f"note: {note}" for note in diagnosis.notes]
    return "\n".join(lines).rstrip() + "\n"
