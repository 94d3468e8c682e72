"""One `servelm` child process and its log file; the stop order every launcher uses; /ready polling.

The local launcher runs every process of the cluster through these, and the Ray backend's
actor (ray_actor.py) runs its one process through them on whichever machine Ray put it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from servelm.cluster.spec import ProcessSpec, servelm_command

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class RunningProcess:
    spec: ProcessSpec
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def spawn(
    spec: ProcessSpec, log_dir: Path, env: Mapping[str, str] | None = None, owned: bool = False
) -> RunningProcess:
    """Start `servelm SPEC.argv` with stdout and stderr in LOG_DIR/NAME.log (truncated).

    `env`: variables added to this process's environment. `owned`: the child gets SIGKILL when
    the thread that started it dies (Linux's parent-death signal), and runs in its own session,
    so a terminal's Ctrl-C reaches only its owner, which stops it in order. For an owner that
    can be killed outright (a Ray actor): its process must not outlive it, holding the ports
    its restarted self needs. Call it from a thread that lives as long as the owner.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    owner = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def die_with_owner() -> None:  # runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != owner:  # the owner died before prctl took effect
            os._exit(1)

    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            servelm_command(spec.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
            preexec_fn=die_with_owner if owned else None, start_new_session=owned,
        )  # fmt: skip
    logger.info("started %s (pid %d): log %s", spec.name, process.pid, log_path)
    return RunningProcess(spec, process, log_path)


def stop_all(group: Sequence[RunningProcess], stop_timeout_s: float) -> None:
    """SIGTERM every process of the group, then SIGKILL whichever has not exited after
    `stop_timeout_s` (one deadline for the group). Safe to call twice."""
    for running in group:
        if running.process.poll() is None:
            running.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    for running in group:
        try:
            running.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait(timeout=10)


def http_status(url: str, timeout_s: float = 1.0) -> int:
    """GET URL's status code; 0 when nothing answers."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return 0


def wait_all_ready(probes: Mapping[str, Callable[[], bool]], timeout_s: float, interval_s: float = 0.25) -> None:
    """Poll each name's probe until every one has returned True once. A probe returns False for
    "not yet" and raises RuntimeError for "never" (its process died): that ends the wait."""
    deadline = time.monotonic() + timeout_s
    pending = dict(probes)
    while pending:
        for name, probe in list(pending.items()):
            if probe():
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {', '.join(pending)}")
        if pending:
            time.sleep(interval_s)
