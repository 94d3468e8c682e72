"""Finding a test's child processes (Linux /proc): a server's engine core, to kill it."""

from __future__ import annotations

import os
import subprocess
import time

from servelm.testing.process_tree import alive


def child_pids(pid: int, cmdline_has: str = "") -> list[int]:
    """Child processes of `pid` whose command line contains `cmdline_has` (an engine core spawned
    by `servelm serve` has "spawn_main" in its command line)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
            except (OSError, ValueError):
                continue
            if parent == pid and cmdline_has in cmdline:
                children.append(int(entry))
    return children


def kill_hard(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """kill -9 `process`, then wait for its children (a server's engine core) to notice and go
    (exited: a zombie waiting for init to reap it holds no memory or port)."""
    children = child_pids(process.pid)
    process.kill()
    process.wait(timeout=10)
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
