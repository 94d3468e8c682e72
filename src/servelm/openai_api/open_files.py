"""Both HTTP fronts raise their open-files limit at start: every client connection is a socket (in
the router, two: the client's and the replica's), and the usual soft default of 1024 caps a front
at ~1000 concurrent streams (then accept() fails with EMFILE and clients see resets). vLLM's
entry point does the same (`set_ulimit`)."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)
WANTED_OPEN_FILES = 65536


def raise_open_files_limit(wanted: int = WANTED_OPEN_FILES) -> int:
    """Raise the soft RLIMIT_NOFILE to `wanted`, within the hard limit (never lowered); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft
