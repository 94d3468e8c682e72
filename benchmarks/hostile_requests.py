"""Run the hostile-request table (servelm.bench.hostile) against OpenAI-compatible servers.

    python benchmarks/hostile_requests.py servelm=http://127.0.0.1:8000 vllm=http://127.0.0.1:8001,model=/path

Prints, per server, how many cases got a 4xx, a 5xx, a wrong 2xx or no answer, and how many
left the keep-alive connection broken; then each case that did not get a 4xx. `model=` is put
into every body (vLLM wants the served name); `key=` sends a bearer key.
"""

from __future__ import annotations

import argparse
import time

from servelm.bench.hostile import hostile_cases, run_hostile


def _target(text: str) -> tuple[str, str, dict[str, str]]:
    name, _, rest = text.partition("=")
    url, *options = rest.split(",")
    return name, url, dict(option.split("=", 1) for option in options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", help="NAME=BASE_URL[,model=M][,key=K]")
    parser.add_argument("--max-body-mb", type=float, default=32.0, help="the oversize case exceeds this by 1 MB")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = parser.parse_args()
    cases = hostile_cases(int(args.max_body_mb * 2**20))
    rows = []
    for name, url, options in map(_target, args.targets):
        started = time.monotonic()
        report = run_hostile(url, cases, model=options.get("model"), api_key=options.get("key"), timeout_s=args.timeout)
        counts = report.counts
        rows.append((name, len(cases), counts["4xx"], counts["5xx"], counts["2xx"], counts["no-answer"],
                     report.broken_connections, time.monotonic() - started))  # fmt: skip
        for result in report.results:
            if result.outcome != "4xx" or not result.follow_up_ok:
                follow = "" if result.follow_up_ok else " [follow-up failed]"
                print(f"{name}: {result.outcome} {result.status} {result.case.name}{follow}: {result.detail[:160]!r}")
    print(f"\n{'server':<10} {'cases':>5} {'4xx':>5} {'5xx':>5} {'2xx':>5} {'none':>5} {'broken conn':>11} {'seconds':>8}")
    for name, total, c4, c5, c2, none, broken, seconds in rows:
        print(f"{name:<10} {total:>5} {c4:>5} {c5:>5} {c2:>5} {none:>5} {broken:>11} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
