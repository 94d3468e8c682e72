"""What a request asks its output to match: OpenAI's `response_format` and vLLM's
`structured_outputs`, as one StructuredSpec for the engine (servelm.structured enforces it).

    response_format {"type": "text"}                         free text
                    {"type": "json_object"}                  any JSON object
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs {"json": schema} | {"json_object": true} | {"regex": "..."} |
                       {"choice": ["a", "b"]} | {"grammar": "Lark or GBNF"}   (exactly one)

Whether a spec compiles is checked before the request reaches the engine (StructuredCheck), so
a bad schema is a 400 naming the field, never a failed request mid-stream.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelm.sampling_params import StructuredSpec
from servelm.server.errors import bad_request, unavailable
from servelm.structured.backends import make_backend
from servelm.structured.grammars import GrammarCompiler, GrammarError

ANY_JSON_OBJECT = '{"type": "object"}'
# A spec whose own compile takes longer than this is refused with 400 (the compile runs on; its
# result is cached, so a retry after it finished is served). Its wait for its turn on the compile
# thread, and the backend's one-time build that the first structured request pays, do not count:
# on a loaded 2-core host that build alone took most of the 10 s, and a plain schema was refused.
COMPILE_TIMEOUT_S = 10.0
# Waiting that long for the compile to start (other specs ahead of it) is overload: 503, retry.
COMPILE_QUEUE_TIMEOUT_S = 60.0
QUEUE_POLL_S = 0.25
MAX_CHOICES = 4096


class StrictBody(BaseModel):
    """A request body part that forbids unknown fields and coercion (protocol.py's rule)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(StrictBody):
    name: Annotated[str, Field(max_length=256)]
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> StructuredSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredSpec(kind="json", text=ANY_JSON_OBJECT)
        if self.json_schema is None:
            raise bad_request('response_format of type "json_schema" needs json_schema', param="response_format")
        schema = self.json_schema.schema_
        if self.json_schema.strict and isinstance(schema, dict):
            schema = closed_objects(schema)
        return StructuredSpec(kind="json", text=json.dumps(schema if schema is not None else {}))


def closed_objects(schema: Any) -> Any:
    """`strict: true` as OpenAI means it: an object schema that does not say whether other keys
    may appear allows none (OpenAI requires `additionalProperties: false` there; left open, a model
    sampled at temperature 1.0 adds keys until max_tokens cuts the JSON short)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class StructuredOutputs(StrictBody):
    """vLLM's `structured_outputs` request field."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None

    def spec(self) -> StructuredSpec:
        given = {name: value for name, value in (("json", self.json_), ("json_object", self.json_object or None),
                 ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar)) if value is not None}  # fmt: skip
        if len(given) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, json_object, regex, choice and grammar",
                param="structured_outputs",
            )
        [(kind, value)] = given.items()
        if kind == "json_object":
            return StructuredSpec(kind="json", text=ANY_JSON_OBJECT)
        if kind == "json":
            return StructuredSpec(kind="json", text=value if isinstance(value, str) else json.dumps(value))
        if kind == "choice":
            return StructuredSpec(kind="choice", text=json.dumps(value))
        assert isinstance(value, str)  # regex and grammar are strings (pydantic checked)
        return StructuredSpec(kind=kind, text=value)


def structured_spec(response_format: ResponseFormat | None,
                    structured_outputs: StructuredOutputs | None) -> StructuredSpec | None:  # fmt: skip
    """The request's spec (None: free text); both fields given is a 400."""
    from_format = response_format.spec() if response_format is not None else None
    if structured_outputs is not None:
        if from_format is not None:
            raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
        return structured_outputs.spec()
    return from_format


class StructuredCheck:
    """Compiles a request's spec with the engine's backend before the request is queued: a spec
    that does not compile, uses a keyword the backend cannot enforce, or takes too long is a 400."""

    def __init__(self, backend_name: str, tokenizer: Any) -> None:
        vocab_size = len(tokenizer)
        self._compiler = GrammarCompiler(lambda: make_backend(backend_name, tokenizer, vocab_size))

    async def check(self, spec: StructuredSpec | None, param: str) -> None:
        if spec is None:
            return
        compiled = asyncio.wrap_future(self._compiler.submit(spec))
        queued_s = 0.0
        while True:
            compiling_s = self._compiler.compiling_for_s(spec)
            wait_s = QUEUE_POLL_S if compiling_s is None else max(0.0, COMPILE_TIMEOUT_S - compiling_s)
            try:
                # Shielded: a timeout must not cancel the cached compile other requests may share.
                await asyncio.wait_for(asyncio.shield(compiled), wait_s)
                return
            except GrammarError as exc:
                raise bad_request(f"{param}: {exc}", param=param) from exc
            except TimeoutError as exc:
                if compiling_s is not None:
                    raise bad_request(
                        f"{param}: the grammar took more than {COMPILE_TIMEOUT_S:g} s to compile", param=param
                    ) from exc
                queued_s += wait_s
                if queued_s >= COMPILE_QUEUE_TIMEOUT_S:
                    raise unavailable("Grammar compiles are backed up; retry later.") from exc

    def close(self) -> None:
        self._compiler.close()
