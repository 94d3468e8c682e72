"""One JSON line per finished request (`servelm serve --log-requests`), for offline digging.

The line carries the request's whole timeline (see timeline.py) and its TTFT split, so a
slow request can be explained after the fact with `jq`, without metrics or a debugger.
Lines go to the `servelm.requests` logger; by default that writes bare JSON to stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec

from servelm.obs.timeline import RequestTimeline

LOGGER_NAME = "servelm.requests"


class RequestLogger:
    def __init__(self, enabled: bool, stream: Any = None) -> None:
        self.enabled = enabled
        self.logger = logging.getLogger(LOGGER_NAME)
        if enabled and not self.logger.handlers:
            handler = logging.StreamHandler(stream or sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False  # bare JSON lines, not wrapped in the root format

    def log(self, timeline: RequestTimeline, **summary: Any) -> None:
        if not self.enabled:
            return
        record = {**summary, "timeline": timeline.to_dict()}
        self.logger.info(msgspec.json.encode(record).decode())
