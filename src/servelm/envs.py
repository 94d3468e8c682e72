"""The environment variables servelm reads, each behind one typed accessor.

New code reads the environment here and nowhere else, so every switch is listed in one file
with its meaning and default. Accessors read the environment on every call (nothing cached
here): a caller on a hot path keeps the value it read and offers its own reset (see
`servelm.kernels.cpu.reset`). Safe to call from any thread or process.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

KERNELS = "SERVELM_KERNELS"
C_COMPILER = "CC"
XDG_CACHE_HOME = "XDG_CACHE_HOME"
CACHE_DIR = "SERVELM_CACHE_DIR"
XDG_DATA_HOME = "XDG_DATA_HOME"
DATA_DIR = "SERVELM_DATA_DIR"
API_KEY = "SERVELM_API_KEY"
PEER_API_KEY = "SERVELM_PEER_API_KEY"
TRITON_INTERPRET = "TRITON_INTERPRET"
STEP_TRACE = "SERVELM_STEP_TRACE"


class KernelsMode(str, enum.Enum):
    AUTO = "auto"  # compiled kernels where they build here, the pure-torch paths elsewhere
    TORCH = "torch"  # the pure-torch paths only (debugging, A/B comparisons)
    # The compiled kernels op by op: a small decode step's layers not fused into one call
    # (models/fused_decode.py); A/B comparisons of that fusion.
    UNFUSED = "unfused"


def kernels_mode() -> KernelsMode:
    """SERVELM_KERNELS: `auto` (default, also when unset or empty), `torch` or `unfused`.

    Raises ValueError naming the valid values for anything else, rather than silently
    running a path the user did not ask for.
    """
    raw = os.environ.get(KERNELS, "").strip().lower()
    if not raw:
        return KernelsMode.AUTO
    try:
        return KernelsMode(raw)
    except ValueError:
        valid = ", ".join(mode.value for mode in KernelsMode)
        raise ValueError(f"{KERNELS}={raw!r} is not a valid value; valid values: {valid}") from None


def c_compiler() -> str | None:
    """CC: the C compiler that builds servelm's CPU kernels (a name on PATH or a path), as make
    and setuptools read it; None when unset, and the builder then looks for cc, gcc, clang."""
    return os.environ.get(C_COMPILER) or None


def cache_dir() -> Path:
    """SERVELM_CACHE_DIR, else $XDG_CACHE_HOME/servelm (~/.cache/servelm): servelm's on-disk caches
    (converted tokenizers, compiled kernels), each in its own subdirectory."""
    explicit = os.environ.get(CACHE_DIR)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get(XDG_CACHE_HOME) or Path.home() / ".cache") / "servelm"


def data_dir() -> Path:
    """SERVELM_DATA_DIR, else $XDG_DATA_HOME/servelm (~/.local/share/servelm): what servelm keeps
    that must outlive a restart (batch jobs and their files), each server in its own subdirectory."""
    explicit = os.environ.get(DATA_DIR)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get(XDG_DATA_HOME) or Path.home() / ".local" / "share") / "servelm"


def api_key() -> str | None:
    """SERVELM_API_KEY: the bearer token the server and the router require when no --api-key is given."""
    return os.environ.get(API_KEY) or None


def peer_api_key() -> str | None:
    """SERVELM_PEER_API_KEY, else SERVELM_API_KEY: the bearer token sent to a running replica that
    `--model peer://HOST:PORT` takes its weights from (replicas of one deployment share a key)."""
    return os.environ.get(PEER_API_KEY) or api_key()


def triton_interpret() -> bool:
    """TRITON_INTERPRET: Triton's own switch (it reads it when a kernel is defined) that runs its
    kernels under the interpreter on CPU tensors; true for 1/true/yes/on, as Triton reads it."""
    return os.environ.get(TRITON_INTERPRET, "").strip().lower() in ("1", "true", "yes", "on")


def step_trace_path() -> Path | None:
    """SERVELM_STEP_TRACE: a file the engine core appends every step's shape and times to, as JSON
    lines (engine/step_trace.py; `servelm simulate calibrate` fits its cost profile from them).
    Unset: no trace."""
    path = os.environ.get(STEP_TRACE)
    return Path(path) if path else None
