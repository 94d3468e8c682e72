"""A diagnose source by path: a captured window directory, or a `--log-requests` file."""

from __future__ import annotations

from pathlib import Path

from servelm.diagnose.request_log import read_request_log
from servelm.diagnose.signals import Signals, request_log_signals, window_signals
from servelm.diagnose.window import read_window


def load_signals(path: Path) -> Signals:
    """A directory is read as a window (capture.py's layout), a file as a request log; ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        return window_signals(read_window(path))
    if path.is_file():
        return request_log_signals(read_request_log(path))
    raise ValueError(f"{path} does not exist (expected a window directory or a request-log file)")
