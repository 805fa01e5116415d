"""Prompts as token ids, the one place that applies the chat template, and the model
facts a decoder needs (EOS and MASK ids): training, generation, the server and the
evaluators all format and resolve through here, so they cannot drift apart."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, ConfigError, PromptError, TokenizerError, first_line
from ..settings.model import ModelConfig

MASK_TOKEN = "<|mask|>"
Prompt = str | Sequence[int]


def chat_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **template_options: Any,
) -> str:
    """A conversation as the text the model continues: the tokenizer's chat template with
    the assistant's turn opened (or, with add_generation_prompt=False, the last message
    left open to be continued), or, for a tokenizer without one, each message's content
    on its own line (the format training uses for such tokenizers). `template_options`
    are the template's own variables (Qwen3's `enable_thinking`). The template is rendered
    within bounds (`chat_template.py`): one that loops, allocates or writes without end
    fails as any broken template does."""
    source = template_source(tokenizer)
    if source is not None:
        from .chat_template import render

        variables = {**getattr(tokenizer, "special_tokens_map", {}), **template_options}
        try:
            return render(
                source,
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final=not add_generation_prompt,
                variables=variables,
            )
        except _template_errors() as e:
            raise ChatTemplateError(
                f"the chat template fails ({type(e).__name__}: {first_line(e)}); fix chat_template.jinja "
                "(or tokenizer_config.json's chat_template), or pass --no-chat to prompt without it"
            ) from None
    text = "".join(m["content"] + "\n" for m in messages)
    return text if add_generation_prompt else text[:-1]  # the last message stays open


def template_source(tokenizer: Any) -> str | None:
    """The tokenizer's chat template, or None: of several named ones, the "default" (as
    transformers picks it)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        if "default" not in source:
            raise ChatTemplateError(
                f"the tokenizer has chat templates named {', '.join(sorted(map(str, source)))} but none "
                '"default"; name one "default" in its files, or pass --no-chat to prompt without it'
            )
        source = source["default"]
    return source or None


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template (a Jinja program shipped with the checkpoint) raises when it
    fails: Jinja's own errors (syntax, the sandbox refusing an attribute, the template's
    `raise_exception`, a bound it went over) and the Python errors of the operations it
    runs, a MemoryError among them."""
    from jinja2 import TemplateError

    return (
        TemplateError,
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        AttributeError,
        ArithmeticError,
        RecursionError,
        MemoryError,
    )


def chat_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    continue_final: bool = False,
    **template_options: Any,
) -> list[int]:
    """`chat_text` tokenised (the template carries its own special tokens); with
    continue_final, the last message (an assistant turn begun for the model) stays open."""
    text = chat_text(tokenizer, messages, not continue_final, **template_options)
    return tokenize(tokenizer, text, add_special_tokens=False)


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, without `transformers`' warning that a sequence is longer than
    the model takes ("... will result in indexing errors"): the engine measures every
    prompt against the context itself and says what to do about one that does not fit."""
    return list(_encode(tokenizer, text, add_special_tokens))


def tokenize_batch(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, tokenised together (the tokenizer splits the work over threads)."""
    return [list(ids) for ids in _encode(tokenizer, list(texts), add_special_tokens)]


def _encode(tokenizer: Any, text: str | list[str], add_special_tokens: bool) -> Any:
    """The tokenizer's ids for `text`. A panic of the tokenizers library (Rust's; in
    Python a `PanicException`, a BaseException that no `except Exception` sees) becomes a
    TokenizerError: a pre-tokenizer whose regex backtracks past its engine's limit on
    some text panics on that text, and would otherwise end a CLI verb with a traceback
    and a server request with a plain-text 500."""
    with _rust_messages_held() as held:
        try:
            return tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
        except BaseException as e:
            if type(e).__name__ != "PanicException":
                raise
            held.drop()
            raise TokenizerError(
                f"the tokenizer failed on this text ({first_line(e)}): its pre-tokenizer's regular "
                "expression backtracks too far on it; change the text, or use a tokenizer with a simpler "
                "pre-tokenizer pattern"
            ) from None


class _Held:
    """What the process wrote to its stderr while held, passed on unless dropped."""

    def __init__(self) -> None:
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True


@contextlib.contextmanager
def _rust_messages_held() -> Iterator[_Held]:
    """Hold what is written to file descriptor 2 meanwhile, and drop it if asked: a Rust
    panic prints its message and backtrace there itself, before Python sees the panic,
    so a CLI verb would show them above its one line. Only in a process with one thread
    (a CLI verb): elsewhere (a server) other threads' lines would be held too, and the
    panic's lines stay in the log."""
    held = _Held()
    if threading.active_count() > 1:
        yield held
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield held
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            written = sink.read()
            if written and not held.dropped:
                os.write(2, written)


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids of a prompt: text goes through the chat template as one user message (if
    the tokenizer has a template and chat=True); a list of ids is taken as it is."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise ConfigError("text prompts need a tokenizer; pass token ids to decode without one")
    if not (prompt.strip() if chat else prompt):  # without the template, whitespace is text to continue
        raise PromptError("the prompt is empty: give some text to continue", "empty_prompt")
    if chat and template_source(tokenizer):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenize(tokenizer, prompt)


def prompt_text(tokenizer: Any, prompt: str, chat: bool = True) -> str:
    """The text `encode_prompt` tokenises for a text prompt (to show it, say)."""
    if chat and template_source(tokenizer):
        return chat_text(tokenizer, [{"role": "user", "content": prompt}])
    return prompt


def tokenizer_mask_id(tokenizer: Any) -> int | None:
    """The id of `<|mask|>` in the tokenizer's vocabulary (added tokens included), or None."""
    return tokenizer.get_vocab().get(MASK_TOKEN) if tokenizer is not None else None


def mask_id_of(config: ModelConfig, tokenizer: Any = None) -> int | None:
    """The MASK id: the model config's, else the tokenizer's `<|mask|>`, else None."""
    return config.mask_token_id if config.mask_token_id is not None else tokenizer_mask_id(tokenizer)


def eos_ids_of(config: ModelConfig, tokenizer: Any = None) -> set[int]:
    """The ids that end a generation: the model config's EOS ids and the tokenizer's."""
    eos = set(config.eos_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos
