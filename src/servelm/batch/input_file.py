"""A batch's input file, read line by line: each line is `{"custom_id", "method": "POST", "url", "body"}`.

What fails the whole batch at validation (OpenAI's behaviour): a line whose `url` is not the
batch's endpoint, a missing or non-string `custom_id`, a method other than POST, a body that is
not an object, an empty file. What fails only its line (it goes to the error file, the rest run):
a line that is not JSON. A body the endpoint refuses is found when the line runs (its 4xx is
the line's result). Blank lines are skipped. Memory stays bounded: only one line is held at once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

from servelm.batch.records import BatchError, result_line

# (line_no, custom_id, byte offset, length, error result or None), as BatchStore.replace_lines takes them.
ScannedLine = tuple[int, str | None, int, int, str | None]


class BatchInvalid(ValueError):
    def __init__(self, error: BatchError) -> None:
        super().__init__(error.message)
        self.error = error


def new_result_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def scan_input(path: Path, endpoint: str) -> Iterator[ScannedLine]:
    """Every line of the input, checked; BatchInvalid at the first that fails the batch."""
    found = False
    with path.open("rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            found = True
            try:
                item = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                error = {"code": "invalid_json", "message": f"line {line_no} is not valid JSON: {exc}"}
                yield line_no, None, start, len(raw), result_line(new_result_id(), None, None, error)
                continue
            yield line_no, _checked_custom_id(item, line_no, endpoint), start, len(raw), None
    if not found:
        raise BatchInvalid(BatchError("empty_file", "The input file has no requests."))


def _checked_custom_id(item: object, line_no: int, endpoint: str) -> str:
    if not isinstance(item, dict):
        raise BatchInvalid(BatchError("invalid_request", "Each line must be a JSON object.", line=line_no))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchInvalid(BatchError("missing_required_parameter", "custom_id is required and must be a non-empty string.",
                                      param="custom_id", line=line_no))  # fmt: skip
    if str(item.get("method", "")).upper() != "POST":
        raise BatchInvalid(BatchError("invalid_value", f"method must be POST, got {item.get('method')!r}.",
                                      param="method", line=line_no))  # fmt: skip
    if item.get("url") != endpoint:
        raise BatchInvalid(BatchError("mismatched_url",
                                      f"The line's url {item.get('url')!r} is not the batch's endpoint {endpoint!r}.",
                                      param="url", line=line_no))  # fmt: skip
    if not isinstance(item.get("body"), dict):
        raise BatchInvalid(BatchError("invalid_value", "body must be a JSON object.", param="body", line=line_no))
    return custom_id
