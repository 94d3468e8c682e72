"""The data objects of the Files and Batch APIs, as the store keeps them and OpenAI renders them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# A batch's statuses, as OpenAI names them. Active ones are resumed when the server restarts.
VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")

# A line's state in the store: waiting to run, its response is in the output file, or in the error file.
LINE_PENDING, LINE_OUTPUT, LINE_ERROR = 0, 1, 2


@dataclass(frozen=True)
class FileRecord:
    id: str  # "file-…"
    tenant: str  # who uploaded it (or whose batch wrote it): nobody else sees it
    purpose: str  # "batch" (uploads), "batch_output" (what a batch wrote)
    filename: str
    bytes: int
    created_at: int  # unix seconds

    def openai_object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}  # fmt: skip


@dataclass(frozen=True)
class BatchError:
    """Why a batch failed validation, in OpenAI's shape (`line` 1-based, None when not one line's)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def openai_object(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class BatchRecord:
    id: str  # "batch_…"
    tenant: str
    endpoint: str  # every line's `url` must be this one
    input_file_id: str
    completion_window: str  # as given ("24h")
    window_s: float  # its length: the batch expires `window_s` after it was created
    created_at: int
    status: str = VALIDATING
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchError] = field(default_factory=list)
    total: int = 0
    completed: int = 0
    failed: int = 0
    # When the batch entered each status (unix seconds; None: not yet).
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    ending: str | None = None  # the status finalizing ends in (completed, cancelled, expired): a restart needs it
    # Tokens of the lines done (their responses' usage), as OpenAI's batch `usage` sums them.
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def expires_at(self) -> int:
        return int(self.created_at + self.window_s)

    def openai_object(self) -> dict[str, Any]:
        errors = {"object": "list", "data": [e.openai_object() for e in self.errors]} if self.errors else None
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata, "model": None,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
        }  # fmt: skip

    def errors_json(self) -> str:
        return json.dumps([e.openai_object() for e in self.errors])


@dataclass(frozen=True)
class PendingLine:
    """One input line still to run: where its text is in the input file (read when it runs, so a
    100,000-line batch never sits in memory)."""

    line_no: int  # 1-based, as OpenAI's validation errors count
    custom_id: str
    offset: int
    length: int


def result_line(result_id: str, custom_id: str | None, response: dict[str, Any] | None,
                error: dict[str, Any] | None) -> str:  # fmt: skip
    """One line of an output or error file, in OpenAI's format."""
    return json.dumps({"id": result_id, "custom_id": custom_id, "response": response, "error": error},
                      ensure_ascii=False, separators=(",", ":"))  # fmt: skip
