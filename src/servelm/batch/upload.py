"""A `multipart/form-data` upload (`POST /v1/files`: fields `purpose` and `file`) read as it
arrives: the file part goes straight to disk and small fields to memory, so a 200 MB upload
costs the server a buffer, not 200 MB; over `limit` bytes it stops at once (UploadTooLarge)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header

_MAX_FIELD_BYTES = 64 * 1024  # `purpose` and any other plain field


class UploadError(ValueError):
    """The body is not a usable upload; the message says why (a 400)."""


class UploadTooLarge(UploadError):
    """The file part is over the limit (a 413)."""


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's name as the client sent it; None: no file part
    bytes: int = 0


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    value: bytearray = field(default_factory=bytearray)


async def receive_upload(content_type: str | None, chunks: AsyncIterator[bytes], destination: Path, limit: int) -> Upload:
    """Parse the body; the part named `file` is written to `destination` (created, or replaced)."""
    mime, options = parse_options_header(content_type or "")
    if mime != b"multipart/form-data" or b"boundary" not in options:
        raise UploadError("the upload must be multipart/form-data with fields `purpose` and `file`")
    upload = Upload()
    part = _Part()
    header_field = bytearray()
    header_value = bytearray()
    sink: BinaryIO | None = None
    problem: UploadError | None = None

    def on_part_begin() -> None:
        nonlocal part
        part = _Part()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_field.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        part.headers[bytes(header_field).lower()] = bytes(header_value)
        header_field.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        nonlocal sink
        _, disposition = parse_options_header(part.headers.get(b"content-disposition", b""))
        part.name = disposition.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in disposition:
            part.filename = disposition[b"filename"].decode("utf-8", "replace")
        if part.name == "file":
            upload.filename = part.filename or "upload.jsonl"
            sink = destination.open("wb")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        nonlocal problem
        if part.name == "file" and sink is not None:
            upload.bytes += end - start
            if upload.bytes > limit:
                problem = problem or UploadTooLarge(f"the file is over the limit of {limit} bytes")
                return
            sink.write(data[start:end])
        else:
            part.value.extend(data[start:end])
            if len(part.value) > _MAX_FIELD_BYTES:
                problem = problem or UploadError(f"form field {part.name!r} is over {_MAX_FIELD_BYTES} bytes")

    def on_part_end() -> None:
        nonlocal sink
        if part.name == "file" and sink is not None:
            sink.close()
            sink = None
        elif part.name:
            upload.fields[part.name] = part.value.decode("utf-8", "replace")

    callbacks = {"on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
                 "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
                 "on_part_data": on_part_data, "on_part_end": on_part_end}  # fmt: skip
    parser = MultipartParser(options[b"boundary"], callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in chunks:
            parser.write(chunk)
            if problem is not None:
                raise problem
        parser.finalize()
    except UploadError:
        raise
    except Exception as exc:  # python-multipart's parse errors: the client sent a broken body
        raise UploadError(f"the multipart body could not be read: {exc}") from exc
    finally:
        if sink is not None:
            sink.close()
    if upload.filename is None:
        raise UploadError("the upload has no `file` part")
    return upload
