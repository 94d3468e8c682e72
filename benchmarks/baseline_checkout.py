"""Run this benchmark script again against another checkout's src/, for an A/B in one sitting.

A script that measures in-process (the engine, no server) takes `--baseline-src DIR` and a
`--json` flag that prints its raw results (`add_baseline_arguments`); `measure_baseline` reruns
the script in a subprocess with PYTHONPATH=DIR and the same arguments plus --json, and returns
what it printed; `with_baseline` does both sides of that for a script's main(), and
`parse_and_measure` is that main's argument handling too. The two
measurements run one after the other, not interleaved: run the pair in both orders when the
difference is small (swap PYTHONPATH and --baseline-src).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline-src", default=None, help="another checkout's src/, measured the same way after")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON (the subprocess form)")


def with_baseline(script: str, args: argparse.Namespace, ours: Any) -> dict[str, Any] | None:
    """In the subprocess form (--json): print `ours` and return None. Else {"this checkout": ours},
    and "baseline": the script's results under --baseline-src with the same arguments, if given."""
    if args.json:
        print(json.dumps(ours))
        return None
    rows = {"this checkout": ours}
    if args.baseline_src:
        same_args = [a for a in sys.argv[1:] if a not in ("--baseline-src", args.baseline_src)]
        rows["baseline"] = measure_baseline(script, same_args, args.baseline_src)
    return rows


def parse_and_measure(
    parser: argparse.ArgumentParser, script: str, measure: Callable[[argparse.Namespace], Any]
) -> tuple[argparse.Namespace, dict[str, Any] | None]:
    """A script's main() in one call: the baseline arguments added, the command line parsed, and
    `with_baseline`'s rows for `measure(args)` (None in the subprocess form: nothing to print)."""
    add_baseline_arguments(parser)
    args = parser.parse_args()
    return args, with_baseline(script, args, measure(args))


def measure_baseline(script: str, args: list[str], baseline_src: str) -> Any:
    """`script` run with `args` + --json under PYTHONPATH=baseline_src: its JSON output, parsed."""
    command = [sys.executable, script, *args, "--json"]
    env = {**os.environ, "PYTHONPATH": baseline_src}
    return json.loads(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout)
