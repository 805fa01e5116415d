"""The task tokenizer: exact round trips, digits, special tokens, chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from refusion.tasks import load_test_items, make_split
from refusion.tasks.tokenizer import (
    EOS_TOKEN,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    build_default_tokenizer,
    train_tokenizer,
)

MAX_PROMPT_TOKENS = 64
MAX_RESPONSE_TOKENS = 120
MAX_SEQUENCE = 256


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_default_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)  # from disk, as users load it


@pytest.fixture(scope="module")
def items():
    return load_test_items() + make_split("train", 1000, seed=11)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_saved_files_and_size(tok_dir, tok):
    names = {p.name for p in tok_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert 300 < len(tok) <= 1024


def test_special_tokens(tok):
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.mask_token == MASK_TOKEN
    ids = {t: tok.convert_tokens_to_ids(t) for t in (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN, IM_START)}
    assert len(set(ids.values())) == 4
    assert tok.eos_token_id == ids[EOS_TOKEN] and tok.mask_token_id == ids[MASK_TOKEN]
    for t, i in ids.items():
        assert _ids(tok, t) == [i]  # matched whole inside text, never split
    assert _ids(tok, f"a{MASK_TOKEN}{MASK_TOKEN}b")[1:3] == [ids[MASK_TOKEN]] * 2
    assert _ids(tok, "x") == tok("x")["input_ids"]  # no BOS/EOS added on encode


def test_round_trip_every_prompt_and_response(tok, items):
    for it in items:
        for text in (it.prompt, it.response):
            assert tok.decode(_ids(tok, text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_round_trip_any_text(tok, text):
    assert tok.decode(_ids(tok, text)) == text


def test_round_trip_code_whitespace(tok):
    text = "def f(x):\n\tif x:\n        return  x \n\n\n    return -1\r\n  # é ✓ 😀 \\n"
    assert tok.decode(_ids(tok, text)) == text


def test_digits_are_single_tokens(tok):
    for token_id in range(len(tok)):
        s = tok.decode([token_id])
        if any(c.isdigit() for c in s):
            assert len(s) == 1, (token_id, s)
    assert [tok.decode([i]) for i in _ids(tok, "1234")] == ["1", "2", "3", "4"]


def test_chat_template(tok, items):
    it = items[0]
    user = [{"role": "user", "content": it.prompt}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|im_start|>user\n{it.prompt}<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": it.response}], tokenize=False)
    assert full == f"{prompt}{it.response}{EOS_TOKEN}\n"
    # prompt ids + response ids + EOS is the tokenisation of the whole turn
    # (what training builds and decoding stops at).
    assert _ids(tok, prompt) + _ids(tok, it.response) + [tok.eos_token_id] == _ids(tok, full)[:-1]
    for role in ("user", "assistant"):
        assert len(_ids(tok, f"{IM_START}{role}\n")) == 3  # role names are single tokens


def test_lengths_fit(tok, items):
    for it in items:
        p, r = _ids(tok, it.prompt), _ids(tok, it.response)
        assert len(p) < MAX_PROMPT_TOKENS, it.prompt
        assert len(r) <= MAX_RESPONSE_TOKENS, it.response
        assert len(p) + len(r) + 10 <= MAX_SEQUENCE  # + chat template and EOS


def test_training_is_deterministic(tmp_path):
    texts = [it.response for it in make_split("train", 200, seed=2)]
    a, b = train_tokenizer(texts, 400), train_tokenizer(texts, 400, tmp_path)
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "tokenizer.json").exists()


def test_chat_text_without_a_template_continues_or_opens_a_turn():
    """The one chat formatter, for a tokenizer without a template: each message on its own
    line (as training formats it); with add_generation_prompt=False the last one stays open."""
    from types import SimpleNamespace

    from refusion.model.prompts import chat_text

    tok = SimpleNamespace(chat_template=None)
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "The answer is"}]
    assert chat_text(tok, messages) == "Q?\nThe answer is\n"
    assert chat_text(tok, messages, add_generation_prompt=False) == "Q?\nThe answer is"
