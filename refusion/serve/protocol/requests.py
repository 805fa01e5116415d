"""A completion request: its body checked (`parse_request`), its decode settings
(`request_config`), and each prompt prepared once by the engine's admission (`admit`;
every prompt of a request: `admit_request`).

The decoding fields (temperature, top_p, seed, stop, ReFusion's knobs) are DecodeConfig's
own, checked by DecodeConfig's own check (`checks.py`), and each prompt is prepared
(tokenised, checked, fitted to the context) by the decode layer's `Admission`, whose
errors become 400s (`errors.library_error`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...decode.admit import Admission, PreparedRequest
from ...errors import ReFusionError
from ...settings.decode import MAX_TOP_LOGPROBS, PRESETS, DecodeConfig
from ...settings.fields import FieldError, shown
from .checks import as_request_error, decode_value, is_int, own_value, text
from .errors import APIError, bad, library_error
from .messages import for_template, parse_messages
from .structured import FIELDS as STRUCTURED
from .structured import Structured, structured_of
from .tools import Tools, check_template, tools_of

# request field -> the DecodeConfig field it sets under its own name (method, slot_size, .., stop_token_ids);
# max_tokens sets gen_length once fitted to the prompt (`admit`), and stop sets stop
DECODE_FIELDS = {f.name: f for f in dataclasses.fields(DecodeConfig) if f.metadata.get("http", True)}
_STOP = next(f for f in dataclasses.fields(DecodeConfig) if f.name == "stop")
# accepted and ignored
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
# accepted only at the value that means "off", and why nothing else is served
NEUTRAL = {
    "suffix": (
        lambda v: v == "",
        "a suffix asks for text that fits before it (fill-in-the-middle), which this server does not "
        "decode; send the prompt alone",
    ),
    "functions": (lambda v: v == [], "functions is OpenAI's deprecated form of tools: send tools"),
    "function_call": (
        lambda v: v in ("none", "auto"),
        "function_call is OpenAI's deprecated form of tool_choice: send tool_choice",
    ),
}
_BIAS = next(f for f in dataclasses.fields(DecodeConfig) if f.name == "logit_bias")
COMMON = {"model", "max_tokens", "stop", "stream", "preset", "logprobs", "logit_bias", "n"}
COMMON |= {*DECODE_FIELDS, *IGNORED, *NEUTRAL, *STRUCTURED}
FIELDS = {
    "completion": COMMON | {"prompt", "chat_template", "best_of", "echo"},
    "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"},
}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_slots"}
MAX_PROMPTS = 64
MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # choices per request: prompts x n
MAX_TOKENS = 2**31 - 1  # beyond any context; keeps the numbers in length errors printable


@dataclass
class CompletionRequest:
    """A validated request: what to decode and how (the settings still unresolved)."""

    kind: str  # "completion" or "chat"
    model: str | None
    prompts: list[str | list[int]] | None = None  # completion: text or token ids, one choice each
    messages: list[dict[str, Any]] | None = None  # chat: role and content (text), and the tool fields given
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    include_slots: bool = False  # stream the decoder's per-step slot events (docs/playground.md#events)
    chat_template: bool = False  # completion: each text prompt rendered as one user message through it
    warning: str | None = None  # said in the response (`completion_warning`): why its text may be noise
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # DecodeConfig fields
    n: int = 1  # choices per prompt
    best_of: int | None = None  # completion: rows decoded per prompt, of which the n most likely are returned
    echo: bool = False  # completion: each choice's text begins with its prompt's
    logprobs_asked: bool = False  # the client asked for log-probabilities (best_of records them anyway)
    structured: Structured | None = None  # the grammar its structured-output field asks for
    tools: Tools | None = None  # chat: the tools the template renders, and tool_choice

    @property
    def grammar(self) -> Structured | None:
        """What the decoder is held to: a structured output, or a call that tool_choice forces."""
        if self.tools is not None and self.tools.forced:
            return Structured(self.tools.grammar(), "tool_choice")
        return self.structured

    @property
    def choices(self) -> int:
        """A completion has n choices per prompt (prompt i's are i * n .. i * n + n - 1), a chat n."""
        return (len(self.prompts or []) if self.kind == "completion" else 1) * self.n

    @property
    def rows(self) -> int:
        """Rows decoded per prompt: best_of, else n."""
        return self.best_of or self.n

    @property
    def decoded(self) -> int:
        """Rows decoded in all (prompt i's are i * rows .. i * rows + rows - 1)."""
        return self.choices // self.n * self.rows


def parse_request(body: Any, kind: str) -> CompletionRequest:
    """Check a decoded JSON body for /v1/completions (kind "completion") or
    /v1/chat/completions ("chat"); raise APIError (400) on the first problem."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    body = {k: v for k, v in body.items() if v is not None}  # null = not given, as at OpenAI
    for name, (ok, why) in NEUTRAL.items():
        if name in body and not ok(body[name]):
            raise bad(f"{name}={shown(body[name])} is not served: {why}", name, "unsupported_value")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    req = CompletionRequest(kind=kind, model=model)
    if kind == "completion":
        if "prompt" not in body:
            raise bad("you must provide a prompt", "prompt", "missing_required_parameter")
        req.prompts = _prompts(body["prompt"])
        req.chat_template = _chat_template(body, req.prompts)
    else:
        if "messages" not in body:
            raise bad("you must provide messages", "messages", "missing_required_parameter")
        req.messages = parse_messages(body["messages"])
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body:
            req.max_tokens = own_value(name, "int", body[name], lo=1, hi=MAX_TOKENS)
    if "stop" in body:
        req.stop = list(decode_value(_STOP, body["stop"]))
    req.stream = own_value("stream", "bool", body.get("stream", False))
    if "n" in body:
        req.n = own_value("n", "int", body["n"], lo=1, hi=MAX_N)
    _best_of_and_echo(req, body)
    if req.decoded > MAX_CHOICES:
        raise bad(
            f"at most {MAX_CHOICES} choices per request (prompts x n, or x best_of), got {req.decoded}",
            "best_of" if req.best_of else "n",
        )
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - STREAM_OPTIONS:
            raise bad(
                "stream_options must be an object with include_usage or include_slots",
                "stream_options",
                "invalid_type",
            )
        req.include_usage = own_value(
            "stream_options.include_usage", "bool", opts.get("include_usage", False)
        )
        req.include_slots = _stream_slots(opts, req.stream)
    if "preset" in body:
        req.preset = own_value("preset", "str", body["preset"], choices=PRESETS)
    req.overrides = {name: decode_value(f, body[name]) for name, f in DECODE_FIELDS.items() if name in body}
    if "logit_bias" in body:
        req.overrides["logit_bias"] = decode_value(_BIAS, body["logit_bias"])
    top = _logprobs(body, kind)
    req.logprobs_asked = top is not None
    if top is not None or (req.best_of or 1) > req.n:  # best_of ranks the rows by their log-probabilities
        req.overrides["logprobs"] = top or 0
    if req.echo and req.logprobs_asked:
        raise bad(
            "echo with logprobs would report the prompt's log-probabilities, which this server does not "
            "compute; send one of them",
            "echo",
        )
    _structure(req, body)
    return req


def _best_of_and_echo(req: CompletionRequest, body: dict[str, Any]) -> None:
    """A completion's best_of (rows decoded per prompt, the n most likely returned: it needs
    the whole rows, so no stream) and echo."""
    if "best_of" in body:
        req.best_of = own_value("best_of", "int", body["best_of"], lo=1, hi=MAX_N)
        if req.best_of < req.n:
            raise bad(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
        if req.best_of > req.n and req.stream:
            raise bad(
                "best_of ranks whole rows before returning any, so it cannot stream: send it without stream",
                "best_of",
            )
    req.echo = own_value("echo", "bool", body.get("echo", False))


def _structure(req: CompletionRequest, body: dict[str, Any]) -> None:
    """The request's structured output and tools, and the grammar they hold it to."""
    req.structured = structured_of(body)
    req.tools = tools_of(body) if req.kind == "chat" else None
    if req.structured is not None and req.tools is not None and req.tools.forced:
        raise bad(
            f"tool_choice {req.tools.choice!r} makes the reply a tool call, which {req.structured.param} "
            "would constrain too: give one of them",
            req.structured.param,
        )
    if req.grammar is not None:
        req.overrides["grammar"] = req.grammar.grammar


def _chat_template(body: dict[str, Any], prompts: list[str | list[int]]) -> bool:
    """A completion's "chat_template": true renders its text prompts through the model's chat
    template (token ids are fed as they are, so they cannot be rendered)."""
    on = own_value("chat_template", "bool", body.get("chat_template", False))
    if on and not all(isinstance(p, str) for p in prompts):
        raise bad(
            '"chat_template": true renders text prompts; token-id prompts are fed as they are',
            "chat_template",
        )
    return on


CHAT_ONLY_WARNING = (
    "this model knows text only through its chat template, and a /v1/completions prompt is "
    'continued raw: expect noise. Use /v1/chat/completions, or send "chat_template": true to '
    "render each prompt as one user message"
)


def completion_warning(req: CompletionRequest, chat_only: bool) -> str | None:
    """Why a request's text is likely noise: a text completion continued raw on a model whose
    checkpoint marks it chat-only (`chat_only` in its decode_config.json). Token ids are
    taken as the client's own rendering."""
    raw_text = req.kind == "completion" and any(isinstance(p, str) for p in req.prompts or [])
    return CHAT_ONLY_WARNING if chat_only and raw_text and not req.chat_template else None


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """How many alternatives each token's log-probability comes with (None: none asked
    for): chat's `logprobs` (a boolean) and `top_logprobs`, or a completion's `logprobs`
    (an integer)."""
    hi = MAX_TOP_LOGPROBS
    if kind == "completion":
        return own_value("logprobs", "int", body["logprobs"], lo=0, hi=hi) if "logprobs" in body else None
    on = own_value("logprobs", "bool", body.get("logprobs", False))
    top = body.get("top_logprobs")
    top = None if top is None else own_value("top_logprobs", "int", top, lo=0, hi=hi)
    if top and not on:
        raise bad('top_logprobs needs "logprobs": true', "top_logprobs")
    return (top or 0) if on else None


def _stream_slots(opts: dict[str, Any], stream: bool) -> bool:
    """stream_options.include_slots: the per-step slot events, which only a stream carries."""
    on = own_value("stream_options.include_slots", "bool", opts.get("include_slots", False))
    if on and not stream:
        raise bad(
            'stream_options.include_slots needs "stream": true (the slot events come as stream chunks)',
            "stream_options.include_slots",
        )
    return on


def _prompts(p: Any) -> list[str | list[int]]:
    if isinstance(p, str):
        return [text("prompt", p)]
    if not isinstance(p, list) or not p:
        raise bad(
            "prompt must be a string, a list of strings, or token ids (a list of integers or of lists)",
            "prompt",
            "invalid_type",
        )
    if all(is_int(t) for t in p):
        return [list(p)]
    if all(isinstance(t, str) for t in p) or all(
        isinstance(t, list) and t and all(is_int(x) for x in t) for t in p
    ):
        if len(p) > MAX_PROMPTS:
            raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
        return [text(f"prompt[{i}]", t, "prompt") if isinstance(t, str) else list(t) for i, t in enumerate(p)]
    raise bad(
        "prompt must be a string, a list of strings, or token ids (a list of integers or of lists)",
        "prompt",
        "invalid_type",
    )


# ------------------------------------------------------------------ decode settings
def request_config(base: DecodeConfig, req: CompletionRequest) -> DecodeConfig:
    """The server's DecodeConfig with the request's preset (its slot settings only: the
    server's sampling settings stay) and knobs on top, and the request's stop strings
    (gen_length is set later, per prompt, by `admit`)."""
    with as_request_error():
        cfg = DecodeConfig.preset(req.preset, base) if req.preset else base
        return cfg.replace(**req.overrides, stop=tuple(req.stop) or cfg.stop)


def admit_request(req: CompletionRequest, admission: Admission, base: DecodeConfig) -> list[PreparedRequest]:
    """Each of the request's prompts prepared once by the engine's admission, with the
    server's settings `base` and the request's on top (`request_config`), then decoded as
    n choices (`choice_seeds`), prompt after prompt."""
    cfg = request_config(base, req)
    prompts, param = request_prompts(req, admission.tokenizer)
    tools = None
    if req.tools is not None:
        check_template(admission.tokenizer)
        tools = req.tools.tools
    grammar = req.grammar.param if req.grammar is not None else None
    ready = [
        admit(admission, p, cfg, req.max_tokens, param, req.chat_template, tools, grammar) for p in prompts
    ]
    return [dataclasses.replace(r, cfg=c) for r in ready for c in choice_seeds(r.cfg, req.rows)]


def choice_seeds(cfg: DecodeConfig, n: int) -> list[DecodeConfig]:
    """The settings of n choices of one prompt: choice i samples with seed + i (wrapping
    within the seed's range), so a seeded request gives the same n answers again and each
    choice is what a request of that seed alone gives; without a seed each choice draws
    its own at random. Greedy choices are the same text n times."""
    if n == 1 or cfg.seed is None:
        return [cfg] * n
    return [cfg.replace(seed=(cfg.seed + i + 2**63) % 2**64 - 2**63) for i in range(n)]


def request_prompts(req: CompletionRequest, tokenizer: Any) -> tuple[list[Any], str]:
    """The request's prompts, one per choice, and the field that holds them: a chat's
    messages (with the fields its chat template reads) or a completion's prompts."""
    if req.kind == "chat":
        return [for_template(req.messages or [], getattr(tokenizer, "chat_template", None))], "messages"
    return list(req.prompts or []), "prompt"


def admit(
    admission: Admission,
    prompt: Any,
    cfg: DecodeConfig,
    max_tokens: int | None,
    param: str,
    chat: bool = False,
    tools: list[dict[str, Any]] | None = None,
    grammar: str | None = None,
) -> PreparedRequest:
    """One prompt prepared by the engine's admission (max_tokens must fit as it is;
    omitted, the server's gen_length is lowered to what fits), or a 400 whose `param` is
    the setting its advice changes (`param`, the prompt's field, when only the prompt can;
    `grammar`, the field that set the grammar, for the grammar's errors).
    `chat`: text rendered as one user message through the chat template (messages always are)."""
    try:
        return admission.prepare(
            prompt, cfg, chat=chat, length=max_tokens, lower=True, length_name="max_tokens", tools=tools
        )
    except FieldError as e:
        if e.field == "grammar":
            raise bad(str(e), grammar, "invalid_value") from None
        raise library_error(e, param) from None
    except ReFusionError as e:
        raise library_error(e, param) from None


def check_model(name: str | None, served: str) -> None:
    """A 404 for a model this server does not serve (no name: the one it does)."""
    if name is not None and name != served:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )
