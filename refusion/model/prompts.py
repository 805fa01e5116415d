"""Prompts as token ids, the one place that applies the chat template, and the model
facts a decoder needs (EOS and MASK ids): training, generation, the server and the
evaluators all format and resolve through here, so they cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, ConfigError, PromptError, first_line
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
    are the template's own variables (Qwen3's `enable_thinking`)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                continue_final_message=not add_generation_prompt,
                **template_options,
            )
        except _template_errors() as e:
            raise ChatTemplateError(
                f"the chat template fails ({type(e).__name__}: {first_line(e)}); fix chat_template.jinja "
                "(or tokenizer_config.json's chat_template), or pass --no-chat to prompt without it"
            ) from None
    text = "".join(m["content"] + "\n" for m in messages)
    return text if add_generation_prompt else text[:-1]  # the last message stays open


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template (a Jinja program shipped with the checkpoint) raises when it
    fails: Jinja's own errors (syntax, the sandbox refusing an attribute, the template's
    `raise_exception`) and the Python errors of the operations it runs."""
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
    return list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids of a prompt: text goes through the chat template as one user message (if
    the tokenizer has a template and chat=True); a list of ids is taken as it is."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise ConfigError("text prompts need a tokenizer; pass token ids to decode without one")
    if not (prompt.strip() if chat else prompt):  # without the template, whitespace is text to continue
        raise PromptError("the prompt is empty: give some text to continue", "empty_prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenize(tokenizer, prompt)


def prompt_text(tokenizer: Any, prompt: str, chat: bool = True) -> str:
    """The text `encode_prompt` tokenises for a text prompt (to show it, say)."""
    if chat and getattr(tokenizer, "chat_template", None):
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
