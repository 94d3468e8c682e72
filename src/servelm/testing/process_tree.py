"""Which processes a test started, from Linux /proc: so a teardown test can check that none is left."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Running; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (children, their children, ...): pid -> command line."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        parents[int(entry)] = int(stat.rsplit(") ", 1)[1].split()[1])
        cmdlines[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = cmdlines[child]
                frontier.append(child)
    return found
