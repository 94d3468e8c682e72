"""Request bodies must be declared JSON. A browser page may send a cross-origin POST without a
CORS preflight only with a "simple" content type (text/plain, form types); accepting JSON under
those would let any web page drive an unkeyed server on localhost. The OpenAI API answers 415 too.
"""

from __future__ import annotations

NOT_JSON_MESSAGE = "Unsupported Content-Type: the request body must be JSON, sent as `Content-Type: application/json`."


def is_json_content_type(value: str | None) -> bool:
    """`application/json`, or any `application/...+json`, with parameters (charset) allowed."""
    if not value:
        return False
    media_type = value.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))
