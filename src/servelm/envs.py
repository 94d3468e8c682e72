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


class KernelsMode(str, enum.Enum):
    AUTO = "auto"  # compiled kernels where they build here, the pure-torch paths elsewhere
    TORCH = "torch"  # the pure-torch paths only (debugging, A/B comparisons)


def kernels_mode() -> KernelsMode:
    """SERVELM_KERNELS: `auto` (default, also when unset or empty) or `torch`.

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


def cache_home() -> Path:
    """XDG_CACHE_HOME, else ~/.cache: the root of per-user caches (compiled kernels live below it)."""
    return Path(os.environ.get(XDG_CACHE_HOME) or Path.home() / ".cache")
