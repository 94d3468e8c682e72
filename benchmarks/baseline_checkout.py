"""Run this benchmark script again against another checkout's src/, for an A/B in one sitting.

A script that measures in-process (the engine, no server) takes `--baseline-src DIR` and a
`--json` flag that prints its raw results; `measure_baseline` reruns the script in a subprocess
with PYTHONPATH=DIR and the same arguments plus --json, and returns what it printed. The two
measurements run one after the other, not interleaved: run the pair in both orders when the
difference is small (swap PYTHONPATH and --baseline-src).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def measure_baseline(script: str, args: list[str], baseline_src: str) -> Any:
    """`script` run with `args` + --json under PYTHONPATH=baseline_src: its JSON output, parsed."""
    command = [sys.executable, script, *args, "--json"]
    env = {**os.environ, "PYTHONPATH": baseline_src}
    return json.loads(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout)
