"""Structured outputs and tool calls through the official `openai` client against a live
server on the bundled model: JSON schemas, JSON mode, vLLM's regex and choice extras, and
tool calls (on the bundled weights under a chat template that renders tools); each output
parses and validates, AR and the shipped (lossless) ReFusion settings give the same one,
streamed as whole; requests that cannot be served are refused with a 400 that says why."""

from __future__ import annotations

import copy
import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import jsonschema  # noqa: E402
from test_serve import LiveServer  # noqa: E402

import refusion  # noqa: E402
from refusion.serve import create_app  # noqa: E402

NAME = "refusion-tiny"
LOSSLESS = {"ar": {"method": "ar"}, "refusion": {}}
# prompts the bundled model was never trained on
PROMPTS = [
    "Describe a person you admire.",
    "Plan a weekend trip to the sea.",
    "What is the capital of France?",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"enum": ["tea", "books", "sea"]}, "maxItems": 2},
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
# ChatML with tools written into a system turn and calls as Qwen's and Hermes' templates write them
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{%- for tool in tools %}\n- {{ tool.function.name }}{%- endfor %}\n"
    'Call one as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def ask(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.fixture(scope="module")
def client(bundled):
    model, tok = bundled
    s = LiveServer(create_app(model, tok, model_name=NAME))
    yield s.client()
    s.stop()


@pytest.fixture(scope="module")
def tool_client(bundled):
    """The bundled weights under a chat template that renders tools."""
    model, tok = bundled
    tok = copy.deepcopy(tok)
    tok.chat_template = TOOLS_TEMPLATE
    s = LiveServer(create_app(model, tok, model_name=NAME))
    yield s.client()
    s.stop()


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# ---------------------------------------------------------------------------- structured outputs
def test_json_schema_outputs_validate_and_refusion_equals_ar(client):
    for prompt in PROMPTS:
        texts = {}
        for method, extra in LOSSLESS.items():
            r = client.chat.completions.create(
                model=NAME,
                messages=ask(prompt),
                response_format=schema_format(PERSON),
                max_tokens=96,
                extra_body=extra,
            )
            assert r.choices[0].finish_reason == "stop"
            texts[method] = r.choices[0].message.content
            jsonschema.validate(json.loads(texts[method]), PERSON)
        assert texts["refusion"] == texts["ar"]


def test_a_streamed_json_schema_output_is_the_whole_one(client):
    whole = client.chat.completions.create(
        model=NAME, messages=ask(PROMPTS[0]), response_format=schema_format(PERSON), max_tokens=96
    )
    stream = client.chat.completions.create(
        model=NAME,
        messages=ask(PROMPTS[0]),
        response_format=schema_format(PERSON),
        max_tokens=96,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content


def test_json_mode_gives_an_object(client):
    r = client.chat.completions.create(
        model=NAME, messages=ask(PROMPTS[1]), response_format={"type": "json_object"}, max_tokens=96
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
        ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda t: t in ("sunny", "rainy")),
        ({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
        ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+'}}, lambda t: re.fullmatch("a[bc]+", t)),
        (
            {"guided_json": json.dumps({"type": "integer", "minimum": 0, "maximum": 999})},
            lambda t: isinstance(json.loads(t), int),
        ),
    ],
)
def test_vllms_structured_output_extras(client, extra, check):
    outs = [
        client.completions.create(
            model=NAME, prompt="The weather today:", max_tokens=24, extra_body={**extra, **LOSSLESS[m]}
        ).choices[0]
        for m in LOSSLESS
    ]
    assert outs[0].text == outs[1].text and outs[0].finish_reason == "stop"
    assert check(outs[0].text), outs[0].text


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"method": "mdm"}, "response_format", "method mdm"),
        ({"ar_correction": False}, "response_format", "lossless settings"),
        ({"slot_size": 8}, "response_format", "one slot per block"),
        ({"guided_regex": "[0-9]"}, "guided_regex", "give one structured output"),
    ],
)
def test_requests_that_cannot_be_held_to_a_schema_are_refused(client, extra, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=ask(PROMPTS[0]), response_format=schema_format(PERSON), extra_body=extra
        )
    assert e.value.body["param"] == param and says in e.value.body["message"]


@pytest.mark.parametrize(
    "fmt, param, says",
    [
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema", "name"),
        ({"type": "xml"}, "response_format", "json_object"),
        (
            schema_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
            "response_format",
            "compile",
        ),
    ],
)
def test_a_malformed_response_format_is_refused(client, fmt, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ask(PROMPTS[0]), response_format=fmt)
    assert e.value.body["param"] == param and says in e.value.body["message"]


# ---------------------------------------------------------------------------- tool calls
def _check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("method", sorted(LOSSLESS))
def test_a_named_tool_choice_makes_the_call(tool_client, method):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = tool_client.chat.completions.create(
        model=NAME,
        messages=ask("What is the weather in Paris this week?"),
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=128,
        extra_body=LOSSLESS[method],
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    _check_weather_call(c.message.tool_calls[0])


def test_required_tool_calls_stream_as_whole_calls_and_ar_equals_refusion(tool_client):
    calls = {}
    for method, extra in LOSSLESS.items():
        chunks = list(
            tool_client.chat.completions.create(
                model=NAME,
                messages=ask("What time is it, and the weather in Rome?"),
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=128,
                stream=True,
                extra_body=extra,
            )
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert len(deltas) == 1 and deltas[0].index == 0
        calls[method] = (deltas[0].function.name, json.loads(deltas[0].function.arguments))
        assert calls[method][0] in ("get_weather", "get_time")
    assert calls["ar"] == calls["refusion"]


def test_tool_choice_none_and_auto_answer(tool_client):
    for choice in ("none", "auto"):
        r = tool_client.chat.completions.create(
            model=NAME, messages=ask("Hello"), tools=[WEATHER], tool_choice=choice, max_tokens=16
        )
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert c.message.content is not None or c.message.tool_calls


def test_tools_on_a_template_that_ignores_them_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=ask("Hi"), tools=[WEATHER], tool_choice="required"
        )
    assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]", "letters"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "one of them",
        ),
    ],
)
def test_malformed_tool_requests_are_refused(tool_client, fields, param, says):
    body = {"tools": [WEATHER], **fields}
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.chat.completions.create(model=NAME, messages=ask("Hi"), **body)
    assert e.value.body["param"] == param and says in e.value.body["message"]
