"""A reader for the PromQL subset our deploy files use, and the check that what a query selects is
exported: every metric a query selects must be a sample name of the exposition (suffixes included,
as Prometheus stores them: `_bucket`, `_sum`, `_count`, `_total`), every label a selector matches
or a `by (...)` groups on must be a label of that metric, and a literal label value must be one the
exposition has. Anything outside the subset fails loudly rather than passing unchecked.

Used by the Grafana dashboard's test and the Kubernetes autoscaling rules' test.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<range>\[[^\]]*\])
      | (?P<number>\d+(?:\.\d+)?)
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<op>=~|!~|!=|==|<=|>=|[-+*/<>=,(){}])""",
    re.VERBOSE,
)
_AGGREGATIONS = {"sum", "avg", "max", "min", "count", "topk", "bottomk", "quantile", "stddev", "stdvar", "group"}
_FUNCTIONS = _AGGREGATIONS | {"rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max", "abs"}
_GROUPING = {"by", "without"}
_SET_OPERATORS = {"and", "or", "unless"}  # binary operators between two vectors, as `+` is
_UNSUPPORTED = {"on", "ignoring", "group_left", "group_right", "offset", "bool"}


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, operator, value)


@dataclass
class QueryRefs:
    """The metrics and labels one PromQL expression refers to."""

    selectors: list[Selector]
    groupings: list[tuple[list[str], list[str]]]  # (labels of a by/without, metrics of its aggregation)


def _lex(expr: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"PromQL this test does not read, at {expr[position:]!r} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append((match.lastgroup or "", match.group()))
        position = match.end()
    return tokens


def _closing(tokens: list[tuple[str, str]], start: int) -> int:
    """Index of the bracket that closes the one at `start`."""
    depth = 0
    for index in range(start, len(tokens)):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(tokens[index][1], 0) if tokens[index][0] == "op" else 0
        if depth == 0:
            return index
    raise ValueError(f"unbalanced brackets in {tokens}")


def parse_refs(expr: str) -> QueryRefs:
    tokens = _lex(expr)
    selectors: dict[int, Selector] = {}  # by token index
    clauses: dict[int, tuple[list[str], int]] = {}  # by/without index → (labels, index after the list)
    index = 0
    while index < len(tokens):
        kind, text = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else None
        if kind != "ident" or text in _SET_OPERATORS:
            index += 1
        elif text in _UNSUPPORTED:
            raise ValueError(f"`{text}` is outside the PromQL subset this test reads: extend it ({expr!r})")
        elif text in _GROUPING:
            end = _closing(tokens, index + 1)
            clauses[index] = ([t for k, t in tokens[index + 2 : end] if k == "ident"], end + 1)
            index = end + 1
        elif text in _FUNCTIONS and following in ("(", *_GROUPING):
            index += 1
        elif following == "(":
            raise ValueError(f"unknown PromQL function {text!r} in {expr!r}")
        else:
            selector = Selector(text)
            index += 1
            if following == "{":
                end = _closing(tokens, index)
                inner = [t for t in tokens[index + 1 : end] if t[1] != ","]
                selector.matchers = [
                    (inner[i][1], inner[i + 1][1], json.loads(inner[i + 2][1])) for i in range(0, len(inner), 3)
                ]
                index = end + 1
            selectors[index - 1] = selector
    return QueryRefs(list(selectors.values()), _groupings(tokens, selectors, clauses))


def _groupings(
    tokens: list[tuple[str, str]], selectors: dict[int, Selector], clauses: dict[int, tuple[list[str], int]]
) -> list[tuple[list[str], list[str]]]:
    """Each by/without clause with the metrics of the aggregation it belongs to, written either
    `sum by (l) (body)` or `sum (body) by (l)`."""
    out = []
    for index, (kind, text) in enumerate(tokens):
        if kind != "ident" or text not in _AGGREGATIONS:
            continue
        before = clauses.get(index + 1)
        body_start = before[1] if before else index + 1
        body_end = _closing(tokens, body_start)
        after = clauses.get(body_end + 1)
        clause = before or after
        if clause is not None:
            metrics = [s.metric for i, s in selectors.items() if body_start < i < body_end]
            out.append((clause[0], metrics))
    return out


Exposition = dict[str, list[dict[str, str]]]  # sample name → the label sets it has


def parse_exposition(text: str) -> Exposition:
    samples: Exposition = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def problems(refs: QueryRefs, exposition: Exposition) -> list[str]:
    """What in `refs` the server does not export (empty: all of it is there)."""
    found = []
    labels_of = {name: {label for labels in sets for label in labels} for name, sets in exposition.items()}
    for selector in refs.selectors:
        if selector.metric not in exposition:
            found.append(f"metric {selector.metric} is not exported")
            continue
        for label, operator, value in selector.matchers:
            if label not in labels_of[selector.metric]:
                found.append(f"{selector.metric} has no label {label}")
            elif (
                operator == "=" and "$" not in value and all(s.get(label) != value for s in exposition[selector.metric])
            ):
                found.append(f"{selector.metric} never has {label}={value!r}")
    for labels, metrics in refs.groupings:
        for metric in metrics:
            missing = [label for label in labels if metric in labels_of and label not in labels_of[metric]]
            if missing:
                found.append(f"{metric} is grouped by {missing}, labels it does not have")
    return found
