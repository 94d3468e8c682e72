"""The JSON Schema corpus benchmarks/structured.py samples against: the kinds real tools and forms
use (nested objects, arrays of objects with min/maxItems, enums, patterns with lengths, numeric
bounds, nullable unions, $ref/$defs, tools without parameters), each with the prompt that asks
for it. Every schema closes its objects (additionalProperties false), as OpenAI's strict mode
requires of a tool's parameters."""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object schema; every property required unless `required` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **extra}  # fmt: skip


STR = {"type": "string", "maxLength": 40}
SHORT = {"type": "string", "minLength": 1, "maxLength": 16}
DATE = {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"}
TIME = {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}
PATH = {"type": "string", "pattern": "^[a-z_/]{1,30}\\.(py|ts|rs|go|md)$"}

CORPUS: list[tuple[str, str, dict[str, Any]]] = [
    ("read_file", "Call read_file to open the main module.", obj({"path": PATH})),
    ("run_tests", "Run the unit tests for the parser.", obj({"target": SHORT, "verbose": {"type": "boolean"},
                                                               "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}})),
    ("list_dir", "List the source directory.", obj({})),
    ("get_time", "What time is it? Call the tool.", {"type": "object", "properties": {}}),
    ("book_slot", "Book a dentist appointment next week.", obj({"date": DATE, "time": TIME,
                                                               "duration_min": {"enum": [15, 30, 45, 60]}})),
    ("set_alarm", "Set an alarm for tomorrow morning.", obj({"time": TIME, "label": {"type": ["string", "null"], "maxLength": 20},
                                                              "repeat": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                                                         "maxItems": 7}})),
    ("weather", "Get the weather in Paris.", obj({"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    ("search", "Search the docs for 'paged attention'.", obj({"query": STR, "top_k": {"type": "integer", "minimum": 1, "maximum": 20}})),
    ("edit_file", "Replace a line in utils.py.", obj({"path": PATH, "old": STR, "new": STR,
                                                      "line": {"type": "integer", "minimum": 1}})),
    ("grep", "Find uses of 'schedule' in the code.", obj({"pattern": SHORT, "paths": {"type": "array", "items": PATH, "minItems": 1, "maxItems": 3}})),
    ("order", "Order two pizzas.", {"$defs": {"item": obj({"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                                             "size": {"enum": ["s", "m", "l"]}})},
                                     **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
                                            "delivery": {"type": "boolean"}})}),
    ("contact", "Add a contact.", obj({"name": SHORT, "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
                                       "phone": {"anyOf": [{"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}, {"type": "null"}]}})),
    ("invoice", "Write an invoice.", obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                                          "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
                                              "desc": SHORT, "amount": {"type": "number", "minimum": 0, "maximum": 10000}})},
                                          "currency": {"enum": ["EUR", "USD", "GBP"]}})),
    ("geo", "Where is the Eiffel tower? Give coordinates.", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("sentiment", "Classify: 'the food was cold'.", obj({"label": {"enum": ["positive", "negative", "neutral"]},
                                                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("entities", "Extract the people in: 'Ada met Alan in London'.", obj({"people": {"type": "array", "items": SHORT, "maxItems": 4},
                                                                          "places": {"type": "array", "items": SHORT, "maxItems": 4}})),
    ("git_commit", "Commit the change.", obj({"message": {"type": "string", "minLength": 5, "maxLength": 60},
                                              "amend": {"type": "boolean"}, "files": {"type": "array", "items": PATH, "maxItems": 3}})),
    ("http_request", "Fetch the status page.", obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                                                    "url": {"type": "string", "pattern": "^https://[a-z]{1,12}\\.(com|io)/[a-z]{0,12}$"},
                                                    "headers": {"type": "array", "maxItems": 2, "items": obj({"name": SHORT, "value": SHORT})}})),
    ("sql", "Count the users table.", obj({"query": {"type": "string", "pattern": "^SELECT [a-z*(), ]{1,30} FROM [a-z_]{1,16};$"},
                                           "read_only": {"const": True}})),
    ("translate", "Translate 'hello' to French.", obj({"text": SHORT, "target": {"enum": ["fr", "de", "es", "it"]}})),
    ("reminder", "Remind me to call mom.", obj({"text": STR, "at": {"oneOf": [TIME, {"type": "null"}]}})),
    ("rating", "Rate the movie out of five.", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                   "review": {"type": ["string", "null"], "maxLength": 40}})),
    ("flags", "Set the feature flags.", obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"},
                                             "level": {"type": "integer", "enum": [0, 1, 2]}})),
    ("tree", "Describe a folder with one subfolder.", {"$defs": {"node": obj({"name": SHORT, "children": {
        "type": "array", "maxItems": 2, "items": obj({"name": SHORT})}})}, **obj({"root": {"$ref": "#/$defs/node"}})}),
    ("matrix", "Give a 2x2 matrix.", obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    ("color", "Pick a color.", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}, "name": {"type": ["string", "null"], "maxLength": 12}})),
    ("user", "Create a user profile.", obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                                            "age": {"type": ["integer", "null"], "minimum": 13, "maximum": 120},
                                            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "viewer"]}, "minItems": 1, "maxItems": 2}})),
    ("flight", "Find a flight to Rome.", obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                              "date": DATE, "passengers": {"type": "integer", "minimum": 1, "maximum": 6},
                                              "cabin": {"enum": ["economy", "business"]}})),
    ("step_list", "List three steps to make tea.", obj({"steps": {"type": "array", "minItems": 3, "maxItems": 3,
                                                                 "items": {"type": "string", "minLength": 3, "maxLength": 30}}})),
    ("answer", "Is 17 prime? Answer with the tool.", obj({"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 40}})),
    ("shape", "Describe a circle or a square.", obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}})]}})),
    ("noop", "Ping the server.", {"type": "object", "properties": {}, "additionalProperties": False}),
]
