"""Start a real `servelm serve` in a subprocess and wait until it answers /ready (it serves).

For tests and benchmarks that must exercise the server as deployed: its own process,
its own engine-core process, real HTTP on 127.0.0.1. Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from servelm.ports import free_port


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    scheme: str = "http"  # https when started with --ssl-certfile

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM: the server drains in-flight requests, then exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not go; returns the exit code."""
        self.terminate()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def launch_server(
    model: str | Path | None,
    extra_args: Sequence[str] = (),
    *,
    port: int | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 240.0,
    verify: bool | ssl.SSLContext = True,
    wait_for: str = "/ready",
) -> ServerProcess:
    """`python -m servelm.cli serve --model MODEL --port PORT EXTRA...`, serving on return (or raises with its log).
    With --ssl-certfile in EXTRA it serves HTTPS; `verify` is httpx's (a context trusting a self-signed certificate).
    `wait_for`: the path that must answer 200 first; "/live" returns as soon as it listens (the engine starting)."""
    port = port or free_port()
    log_file = tempfile.NamedTemporaryFile(prefix=f"servelm-{port}-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "servelm.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model is not None:
        command += ["--model", str(model)]
    command += list(extra_args)
    process = subprocess.Popen(
        command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=False
    )
    server = ServerProcess(process, port, Path(log_file.name), "https" if "--ssl-certfile" in extra_args else "http")
    log_file.close()
    try:
        wait_until_ready(process, f"{server.base_url}{wait_for}", startup_timeout_s, verify=verify)
    except RuntimeError as exc:
        server.stop()
        raise RuntimeError(f"servelm serve {exc}:\n{server.log_tail()}") from None
    return server


def wait_until_ready(
    process: subprocess.Popen, url: str, timeout_s: float, *, verify: bool | ssl.SSLContext = True, interval_s: float = 0.2
) -> None:
    """Poll `url` until it answers 200; RuntimeError ("exited with N during start-up" / "not ready
    after T s") if the process dies first or the time runs out. Any HTTP server, any process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} during start-up")
        try:
            if httpx.get(url, timeout=1.0, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")
