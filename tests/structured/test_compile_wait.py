"""The API's compile check (StructuredCheck) bounds a spec's own compile, not the time it waits for
the backend to be built or for its turn: a loaded host must not refuse a plain schema because the
first structured request pays the backend's one-time build."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from servelm.sampling_params import StructuredSpec
from servelm.server import structured_request
from servelm.server.errors import APIError
from servelm.server.structured_request import StructuredCheck
from servelm.tokenization.loading import load_tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


def test_a_slow_backend_build_does_not_count_against_the_compile(monkeypatch, tokenizer) -> None:
    real_make_backend = structured_request.make_backend

    def built_on_a_loaded_host(*args: Any) -> Any:
        time.sleep(1.0)  # the build's share of a busy machine: longer than the compile limit below
        return real_make_backend(*args)

    monkeypatch.setattr(structured_request, "make_backend", built_on_a_loaded_host)
    monkeypatch.setattr(structured_request, "COMPILE_TIMEOUT_S", 0.5)
    check = StructuredCheck("auto", tokenizer)
    try:
        asyncio.run(check.check(StructuredSpec(kind="json", text=json.dumps(SCHEMA)), "response_format"))
    finally:
        check.close()


def test_a_spec_that_does_not_compile_is_a_400_naming_the_field(tokenizer) -> None:
    check = StructuredCheck("auto", tokenizer)
    try:
        with pytest.raises(APIError) as raised:
            asyncio.run(check.check(StructuredSpec(kind="regex", text="(unclosed"), "structured_outputs"))
    finally:
        check.close()
    assert raised.value.status == 400 and "structured_outputs" in str(raised.value)
