"""Tool calls (docs/serving.md#tool-calls): a chat request's `tools` rendered by the model's
chat template, `tool_choice` decided, and the calls the model writes read back into
OpenAI's `tool_calls`, whole or as stream deltas.

The calls are read in the format of the templates that render tools by writing them
(Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>` + `{"name": ..., "arguments": {...}}` +
`</tool_call>`. `tool_choice` "auto" lets the model choose and reads what it wrote;
"required" and a named function make it call through a grammar (`decode/grammar.py`), so
the call parses and its arguments follow the function's parameter schema; "none" renders
the tools and reads nothing back. A template that ignores `tools`, or writes calls in
another format, is refused with a 400 before anything is decoded.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...decode.grammar import json_schema_grammar
from ...model.prompts import chat_text, template_source
from ...settings.fields import shown
from .checks import string
from .errors import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_PROBE = [{"role": "user", "content": "hi"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's shape, as the template gets them) and its choice:
    "none", "auto", "required", or the name of the function it must call."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def grammar(self) -> str:
        """The grammar of one call (several with parallel calls) of the allowed functions."""
        fns = [t["function"] for t in self.tools]
        if self.choice != "required":
            fns = [f for f in fns if f["name"] == self.choice]
        one = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in fns
            ]
        }
        body = json_schema_grammar(one).removeprefix("start: ")
        more = ' ("\\n" call)*' if self.parallel else ""
        return f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: {body}'


def tools_of(body: dict[str, Any]) -> Tools | None:
    """The request's tools and tool_choice (None: no tools given, or an empty list)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad(f"tool_choice {shown(choice)} needs tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list of function tools", "tools", "invalid_type")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    return Tools(tools, _choice(choice, names), body.get("parallel_tool_calls") is not False)


def _tool(t: Any, where: str) -> dict[str, Any]:
    if (
        not isinstance(t, dict)
        or t.get("type", "function") != "function"
        or not isinstance(t.get("function"), dict)
    ):
        raise bad(
            f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where, "invalid_type"
        )
    fn = t["function"]
    name = string(f"{where}.function.name", fn.get("name"))
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {shown(name)}", where)
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters must be a JSON schema (an object)", where, "invalid_type")
    out = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
    if fn.get("description") is not None:
        out["description"] = string(f"{where}.function.description", fn["description"])
    return {"type": "function", "function": out}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
            "invalid_type",
        )
    if fn["name"] not in names:
        raise bad(f"tool_choice names {shown(fn['name'])}, which is not among the tools", "tool_choice")
    return fn["name"]


def check_template(tokenizer: Any) -> None:
    """A 400 unless the model's chat template renders tools, and writes calls in the format
    the server reads back."""
    source = template_source(tokenizer)
    if source is None or not _renders_tools(tokenizer):
        raise bad(
            "this model's chat template does not render tools, so the model would never see them; "
            "use a model whose template does (Qwen2.5, Qwen3, Hermes), or leave out tools",
            "tools",
        )
    if OPEN not in source:
        raise bad(
            f"this model's chat template writes tool calls in a format the server does not read "
            f"(it reads {OPEN}{{...}}{CLOSE}, as Qwen's and Hermes' templates write them)",
            "tools",
        )


def _renders_tools(tokenizer: Any) -> bool:
    return chat_text(tokenizer, _PROBE, tools=[_PROBE_TOOL]) != chat_text(tokenizer, _PROBE)


# ---------------------------------------------------------------------------- reading calls back
def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape: arguments as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _parsed(block: str) -> dict[str, Any] | None:
    """A call block's JSON, if it is a call ({"name": str, "arguments": ...})."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get("arguments", {}))


def split_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply: its text outside the call blocks (None if only calls) and the calls.
    A block that is not a call stays in the text."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _parsed(m.group(1))
        if call is None:
            continue
        kept.append(text[at : m.start()])
        calls.append(call)
        at = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[at:]).strip()
    return content or None, calls


@dataclass
class CallStream:
    """A streamed reply split into its text and its calls: text streams as it comes up to a
    possible call's opening, a call goes out whole once its block closes, and what was
    held back comes out as text at the end if it was no call."""

    held: str = ""
    calls: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Text to stream now and the calls completed (each with its `index`)."""
        self.held += piece
        out, calls = [], []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial(self.held)
                out.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            end = self.held.find(CLOSE, start)
            if end < 0:
                if final:
                    out.append(self.held)
                    self.held = ""
                else:
                    out.append(self.held[:start])
                    self.held = self.held[start:]
                break
            call = _parsed(self.held[start + len(OPEN) : end].strip())
            out.append(self.held[:start] if call is not None else self.held[: end + len(CLOSE)])
            if call is not None:
                calls.append({"index": self.calls, **call})
                self.calls += 1
            self.held = self.held[end + len(CLOSE) :]
        text = "".join(out)
        return (text.strip() if self.calls and not text.strip() else text), calls


def _partial(text: str) -> int:
    """How many characters at the end of `text` may begin a call's opening."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
