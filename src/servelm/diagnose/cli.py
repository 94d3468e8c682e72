"""`servelm diagnose`: compare two windows, capture one, or capture one live and compare it.

servelm diagnose BASELINE CURRENT [--json]           each a window dir or a request-log file
servelm diagnose capture URL --seconds N --out DIR   save a window of URL's /metrics
servelm diagnose URL --baseline DIR --seconds N      capture the current window live, then compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from servelm import envs


def add_diagnose_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "diagnose", help="why did TTFT grow? compare a baseline window with the current one and name the cause",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("targets", nargs="+", metavar="TARGET", help="BASELINE CURRENT | capture URL | URL")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--seconds", type=float, default=None, help="length of a captured window")
    parser.add_argument("--out", type=Path, default=None, help="capture: the window directory to write")
    parser.add_argument("--baseline", type=Path, default=None, help="live: the saved baseline window (or request log)")
    parser.add_argument("--label", default=None, help="capture: the window's label (default: the directory's name)")
    parser.add_argument("--api-key", default=None, help=f"for a protected /metrics (or env {envs.API_KEY})")
    parser.add_argument("--sample-interval", type=float, default=0.5, dest="sample_interval_s")
    parser.add_argument("--min-growth-ms", type=float, default=50.0, help="TTFT growth below this is noise")
    parser.add_argument("--min-growth-ratio", type=float, default=0.2, help="... and below this share of the baseline")
    parser.set_defaults(handler=_run, parser=parser)
    return parser


def _run(args: argparse.Namespace) -> int:
    targets: list[str] = args.targets
    parser: argparse.ArgumentParser = args.parser
    api_key = args.api_key or envs.api_key()
    if targets[0] == "capture":
        if len(targets) != 2 or args.seconds is None or args.out is None:
            parser.error("usage: servelm diagnose capture URL --seconds N --out DIR")
        out = _capture(targets[1], args.out, args.label or args.out.name, args.seconds, api_key, args.sample_interval_s)
        print(f"window saved to {out}")
        return 0
    if len(targets) == 1:
        if args.baseline is None or args.seconds is None:
            parser.error("usage: servelm diagnose URL --baseline DIR --seconds N")
        current_dir = args.out or Path(tempfile.mkdtemp(prefix="servelm-window-"))
        _capture(targets[0], current_dir, args.label or "current", args.seconds, api_key, args.sample_interval_s)
        baseline, current = args.baseline, current_dir
    elif len(targets) == 2:
        baseline, current = Path(targets[0]), Path(targets[1])
    else:
        parser.error("expected BASELINE CURRENT, capture URL, or URL --baseline DIR")
    return _compare(baseline, current, args)


def _capture(url: str, out: Path, label: str, seconds: float, api_key: str | None, interval_s: float) -> Path:
    from servelm.diagnose.capture import record_window

    return asyncio.run(record_window(url, out, label, seconds, api_key, interval_s))


def _compare(baseline: Path, current: Path, args: argparse.Namespace) -> int:
    from servelm.diagnose.causes import Noise, diagnose
    from servelm.diagnose.report import to_json, to_text
    from servelm.diagnose.sources import load_signals

    noise = Noise(min_ratio=args.min_growth_ratio, min_seconds=args.min_growth_ms / 1000.0)
    diagnosis = diagnose(load_signals(baseline), load_signals(current), noise)
    if args.json:
        json.dump(to_json(diagnosis), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(to_text(diagnosis))
    return 0
