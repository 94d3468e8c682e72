"""Where the test suite's CPU goes: a pytest plugin that records each test's CPU seconds, and a
report of them per file. The suite runs two workers on two cores and is CPU-bound (RESULTS.md,
test suite time): a test that only waits less hands its core to the other worker's test, so what
shortens the suite is CPU, which durations do not show.

    CPU_REPORT_DIR=/tmp/suite-cpu PYTHONPATH=src:benchmarks .venv/bin/python -m pytest -p suite_cpu \\
        -q -n 2 --dist loadfile -m "not serial"
    PYTHONPATH=src .venv/bin/python benchmarks/suite_cpu.py /tmp/suite-cpu [--top 40]

A test's CPU is its worker's own plus that of every descendant the worker reaped during the test
(a server it started and stopped, and that server's engine core). Not counted: processes reaped
by init (killed after their parent), and a session fixture's server until the session ends. A
child left unwaited counts where it is reaped (a later Popen reaps finished children): one file
showing far more CPU than wall time (113 CPU-s in 15 s) is such a reaping, not its own work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPORT_DIR_ENV = "CPU_REPORT_DIR"


def _cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own_before, reaped_before = _cpu_seconds()
    started = time.perf_counter()
    yield
    own_after, reaped_after = _cpu_seconds()
    out = Path(os.environ.get(REPORT_DIR_ENV, "suite-cpu"))
    out.mkdir(parents=True, exist_ok=True)
    record = {"id": item.nodeid, "own": own_after - own_before, "children": reaped_after - reaped_before,
              "wall": time.perf_counter() - started}  # fmt: skip
    with (out / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def report(directory: Path, top: int) -> str:
    records: list[dict[str, Any]] = [json.loads(line) for path in sorted(directory.glob("*.jsonl"))
                                     for line in path.read_text().splitlines()]  # fmt: skip
    per_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for record in records:
        totals = per_file[record["id"].split("::")[0]]
        totals[0] += record["own"]
        totals[1] += record["children"]
        totals[2] += record["wall"]
    cpu = sum(r["own"] + r["children"] for r in records)
    lines = [f"{len(records)} tests: {cpu:.0f} CPU-s, {sum(r['wall'] for r in records):.0f} s of test wall time",
             "   CPU-s     own  children    wall  file"]  # fmt: skip
    ranked = sorted(per_file.items(), key=lambda item: -(item[1][0] + item[1][1]))[:top]
    lines += [f"{own + kids:8.1f} {own:7.1f} {kids:9.1f} {wall:7.1f}  {name}" for name, (own, kids, wall) in ranked]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help=f"where the plugin wrote ({REPORT_DIR_ENV})")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    print(report(args.directory, args.top))


if __name__ == "__main__":
    main()
