"""Structured outputs in a request: OpenAI's `response_format` (`json_object`,
`json_schema`) and vLLM's extra fields (`structured_outputs` with one of `json`, `regex`,
`choice`, `grammar`; and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`), each written as the one grammar the decoder enforces
(`decode/grammar.py`, docs/structured-outputs.md). A request takes one of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...decode.grammar import choice_grammar, json_object_grammar, json_schema_grammar, regex_grammar
from ...settings.fields import shown
from .checks import string
from .errors import bad

# vLLM's names: structured_outputs.<key>, or guided_<key> for the same thing
KINDS = ("json", "regex", "choice", "grammar")
GUIDED = {f"guided_{k}": k for k in KINDS}
FIELDS = {"response_format", "structured_outputs", *GUIDED}


@dataclass(frozen=True)
class Structured:
    """A request's grammar and the field it came from (where its errors point)."""

    grammar: str
    param: str


def structured_of(body: dict[str, Any]) -> Structured | None:
    """The grammar that the request's structured-output field asks for (None: it asks for
    free text); a 400 for a malformed one, or for two at once."""
    given = [name for name in body if name in FIELDS and not _is_text(name, body[name])]
    if len(given) > 1:
        raise bad(f"give one structured output, not {' and '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return Structured(_response_format(value), name)
    if name == "structured_outputs":
        if not isinstance(value, dict) or len(set(value) & set(KINDS)) != 1 or set(value) - set(KINDS):
            raise bad(
                f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {shown(value)}",
                name,
                "invalid_type",
            )
        key = next(iter(value))
        return Structured(_grammar(key, value[key], f"{name}.{key}"), f"{name}.{key}")
    return Structured(_grammar(GUIDED[name], value, name), name)


def _is_text(name: str, value: Any) -> bool:
    """response_format {"type": "text"}: free text, as if not given."""
    return name == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: Any) -> str:
    where = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):
        raise bad(
            'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
            f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}, got {shown(value)}',
            where,
            "invalid_type",
        )
    if value["type"] == "json_object":
        return json_object_grammar()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad(
            'response_format.json_schema must be an object with a "name" and a "schema"',
            f"{where}.json_schema",
            "invalid_type",
        )
    schema = spec.get("schema", {})  # OpenAI: no schema is any JSON object
    return _grammar("json", schema or {"type": "object"}, f"{where}.json_schema.schema")


def _grammar(kind: str, value: Any, where: str) -> str:
    """One structured output's grammar: a JSON schema (an object, or its JSON text), a
    regex, a list of choices, or a grammar (Lark text in llguidance's dialect)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(f"{where} is not JSON: {e}", where) from None
        if not isinstance(value, (dict, bool)):
            raise bad(f"{where} must be a JSON schema (an object), got {shown(value)}", where, "invalid_type")
        return json_schema_grammar(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(
                f"{where} must be a list of non-empty strings, got {shown(value)}", where, "invalid_type"
            )
        return choice_grammar([string(f"{where}[{i}]", c) for i, c in enumerate(value)])
    text = string(where, value)
    if not text:
        raise bad(f"{where} must not be empty", where)
    return regex_grammar(text) if kind == "regex" else text
