"""A checkpoint as a boundary and its parsers within limits: symlinks out of the directory
refused (CLI, library, server), decode_config.json's fields typed, GGUF headers, chat
templates and tokenizer files bounded before they can hang a load or fill the memory,
and a tokenizer that panics on a text turned into one line."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_hostile import assert_one_line_error, checkpoint, gguf_file, kv, run_cli  # noqa: F401
from transformers import AutoTokenizer

from refusion.errors import ChatTemplateError, CheckpointError, TokenizerError
from refusion.files import LIMITS
from refusion.io import describe, load
from refusion.io.resolve import BUNDLED_DIR
from refusion.model.prompts import chat_text, tokenize
from refusion.settings.recommended import Recommended

SECRET = "TOP-SECRET-LINE"


# ---------------------------------------------------------------------------- the checkpoint boundary
def outside_copy(tmp_path: Path, model: Path, name: str, text: str | None = None) -> Path:
    """A file outside the checkpoint (a copy of its own, or `text`), for a link to point at."""
    target = tmp_path / "elsewhere" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        target.write_text(text)
    else:
        shutil.copyfile(model / name, target)
    return target


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "chat_template.jinja",
            "{{ '" + SECRET + "' }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        ),
        ("decode_config.json", json.dumps({"examples": {"leak": SECRET}})),
        ("config.json", None),
        ("tokenizer.json", None),
        ("tokenizer_config.json", None),
        ("model.safetensors", None),
    ],
)
def test_a_symlink_out_of_the_checkpoint_is_refused(checkpoint, tmp_path, capsys, name, text):  # noqa: F811
    """`/etc/shadow` as the chat template would put the file's text into every prompt; a
    link to a loadable copy elsewhere is refused as well: a checkpoint reads only its own files."""
    target = outside_copy(tmp_path, checkpoint, name, text)
    (checkpoint / name).unlink()
    (checkpoint / name).symlink_to(target)
    err = assert_one_line_error(capsys, checkpoint, name, "outside the checkpoint directory")
    assert SECRET not in err and str(target) in err


def test_a_chat_template_in_the_extra_templates_folder_may_not_link_out(checkpoint, tmp_path, capsys):  # noqa: F811
    (checkpoint / "additional_chat_templates").mkdir()
    (checkpoint / "additional_chat_templates" / "tools.jinja").symlink_to(
        outside_copy(tmp_path, checkpoint, "secret.jinja", "{{ '" + SECRET + "' }}")
    )
    assert_one_line_error(capsys, checkpoint, "tools.jinja", "outside the checkpoint directory")


def test_recommended_settings_read_alone_refuse_a_link_out(checkpoint, tmp_path):  # noqa: F811
    """The playground shows decode_config.json's examples: read through the library too,
    the file must be the checkpoint's own."""
    target = outside_copy(tmp_path, checkpoint, "decode_config.json", json.dumps({"about": SECRET}))
    (checkpoint / "decode_config.json").unlink()
    (checkpoint / "decode_config.json").symlink_to(target)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        Recommended.read(checkpoint)


def test_serve_refuses_a_checkpoint_that_links_out(checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    pytest.importorskip("fastapi")
    import refusion.serve

    def serving(*args, **kwargs):
        raise AssertionError("the server started on a checkpoint that links out")

    monkeypatch.setattr(refusion.serve, "serve", serving)
    target = outside_copy(tmp_path, checkpoint, "chat_template.jinja", SECRET)
    (checkpoint / "chat_template.jinja").unlink()
    (checkpoint / "chat_template.jinja").symlink_to(target)
    code, out, err = run_cli(capsys, "serve", checkpoint)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "outside the checkpoint" in err, err


def test_links_inside_the_checkpoint_and_into_a_hub_cache_are_followed(tmp_path, capsys):
    """Files linked within the directory load; so does a Hugging Face cache snapshot, whose
    every file links to a blob of the repository's blobs/ folder."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(BUNDLED_DIR.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    assert describe(snapshot)["vocab_size"] == 865
    inside = tmp_path / "inside"
    shutil.copytree(BUNDLED_DIR, inside)
    (inside / "templates").mkdir()
    (inside / "chat_template.jinja").rename(inside / "templates" / "chat.jinja")
    (inside / "chat_template.jinja").symlink_to(Path("templates") / "chat.jinja")
    code, out, err = run_cli(capsys, "info", inside)
    assert code == 0, err


# ---------------------------------------------------------------------------- decode_config.json typed
@pytest.mark.parametrize(
    "content, words",
    [
        ({"examples": [1, None, {"a": 1}]}, '"examples" must be an object'),
        ({"examples": {"a": 1}}, '"examples" maps labels'),
        ({"decode": [1, 2]}, '"decode" must be an object'),
        ({"decode": "slot_size=8"}, '"decode" must be an object'),
        ({"decode": {"slot_size": "8"}}, "slot_size must be an integer"),
        ({"decode": {"slot_sise": 8}}, "no setting 'slot_sise'"),
        ({"about": {"text": "x"}}, '"about" must be a string'),
        ({"single_turn": "no"}, '"single_turn" must be true or false'),
        ([1, 2], "expected an object"),
    ],
)
def test_decode_config_fields_of_the_wrong_type_are_one_line(checkpoint, capsys, content, words):  # noqa: F811
    (checkpoint / "decode_config.json").write_text(json.dumps(content))
    assert_one_line_error(capsys, checkpoint, "decode_config.json", words)


def test_decode_config_nulls_are_fields_not_given(checkpoint):  # noqa: F811
    (checkpoint / "decode_config.json").write_text(
        json.dumps({"decode": None, "about": None, "examples": None})
    )
    assert Recommended.read(checkpoint) == Recommended()


# ---------------------------------------------------------------------------- GGUF headers within limits
def array_kv(key: bytes, n: int) -> bytes:
    """A key whose value is an array of n uint8 elements."""
    return kv(key, 9, struct.pack("<IQ", 0, n) + b"\1" * n)


@pytest.mark.parametrize(
    "body, words",
    [
        (
            struct.pack("<QQ", 0, 1) + array_kv(b"general.junk", LIMITS.gguf_array + 1),
            "the length of 'general.junk'",
        ),
        (
            struct.pack("<QQ", 0, 3) + b"".join(array_kv(b"j%d" % i, LIMITS.gguf_array) for i in range(3)),
            "arrays hold over",
        ),
        (
            struct.pack("<QQ", 0, LIMITS.gguf_pairs + 1)
            + b"".join(kv(b"k%d" % i, 4, struct.pack("<I", i)) for i in range(LIMITS.gguf_pairs + 1)),
            "kv_count=65,537",
        ),
        (
            struct.pack("<QQ", LIMITS.gguf_tensors + 1, 0) + b"\0" * (24 * (LIMITS.gguf_tensors + 1)),
            "tensor_count",
        ),
    ],
    ids=["one long array", "arrays together", "too many keys", "too many tensors"],
)
def test_gguf_counts_within_the_file_but_over_the_limits_are_one_line(tmp_path, capsys, within, body, words):
    """A 30 MB array or two million keys fit in their file, but the gguf package and
    transformers turn each element into a Python object, for minutes: refused at once."""
    path = gguf_file(tmp_path, body)
    with within(30):
        assert_one_line_error(capsys, path, "model.gguf", words, "a limit of this reader")


# ---------------------------------------------------------------------------- chat templates within bounds
BAD_TEMPLATES = {
    "three nested range loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99999) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "'a' * 99999, three times": (
        "{% set a = 'a' * 99999 %}{% set b = a * 99999 %}{{ b * 99999 }}",
        "characters",
    ),
    "10^10 characters of output": (
        "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "steps",
    ),
    "a string doubled by ~": (
        "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
        "characters",
    ),
    "nested loops over a string": (
        "{% set s = 'a' * 90000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "a width of 10^10": ("{{ 'a'.ljust(10**10) }}", "width"),
    "a printf width": ("{{ '%999999999d' % 1 }}", "formatted"),
    "a format width": ("{{ '{:>999999999}'.format(1) }}", "formatted"),
    "replace that multiplies": ("{{ ('a' * 1000000)|replace('a', 'a' * 1000) }}", "characters"),
    "join that multiplies": ("{{ (('a' * 4000)|list * 1000)|join('b' * 24000) }}", "chat template fails"),
    "a huge power": ("{{ 7 ** 999999 }}", "power"),
    "a list of one long string, as text": ("{{ [('a' * 4000000)] * 1000 }}", "as text"),
    "a dict of one long string, joined by ~": (
        "{{ '' ~ dict.fromkeys(range(1000), 'a' * 4000000) }}",
        "as text",
    ),
}


@pytest.mark.parametrize("template, words", BAD_TEMPLATES.values(), ids=BAD_TEMPLATES)
def test_a_chat_template_that_loops_or_allocates_without_end_is_one_line(
    checkpoint,  # noqa: F811
    capsys,
    within,
    template,
    words,
):
    (checkpoint / "chat_template.jinja").write_text(template)
    with within(30):
        err = assert_one_line_error(capsys, checkpoint, "chat template", "a limit of this reader", words)
    assert "--no-chat" in err


def test_bounds_hold_for_every_render_not_only_at_load(tiny_tokenizer, within):
    """A template that stays within its bounds on the load's one-message check can go
    over them on a request's conversation: the same one line, at once."""
    tiny_tokenizer.chat_template = (
        "{% for m in messages %}{% for n in messages %}{% for o in messages %}{% for p in range(100) %}"
        "{% endfor %}{% endfor %}{% endfor %}{% endfor %}"
    )
    chat_text(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    with within(30), pytest.raises(ChatTemplateError, match="steps"):
        chat_text(tiny_tokenizer, [{"role": "user", "content": "hi"}] * 100)


QWEN3_LIKE = "".join(
    [
        "{%- set ns = namespace(last=messages|length - 1) %}{%- for m in messages[::-1] %}",
        "{%- if m.role == 'user' and ns.last == messages|length - 1 %}",
        "{%- set ns.last = loop.revindex0 %}{%- endif %}{%- endfor %}",
        "{%- for message in messages %}",
        "{%- if message.role == 'assistant' and message.reasoning_content is defined %}",
        "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content.strip('\\n') + ",
        "'\\n</think>\\n\\n' + message.content.lstrip('\\n') }}",
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content }}{%- endif %}",
        "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
        "{%- if enable_thinking is defined and enable_thinking is false %}",
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
        "{{ bos_token }}{{ eos_token }}|{{ '%5.2f'|format(3.14159) }}|{{ [1, 2]|join(', ') }}|",
        "{{ {'a': 'é'}|tojson }}|{{ 'x y'|replace(' ', '_') }}|{% generation %}G{% endgeneration %}",
        "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}",
        "{{ dict(a=1)|tojson }}{{ '{:>5}'.format('a') }}{{ 'ab' ~ 'cd' }}{{ ns.last }}",
    ]
)
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hey", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
    ],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "I begin "}],
]


@pytest.mark.parametrize("template", ["bundled", "qwen3-like"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one turn", "four turns", "prefilled"])
@pytest.mark.parametrize("options", [{}, {"enable_thinking": False}], ids=["", "no thinking"])
def test_the_bounded_render_writes_what_transformers_writes(template, conversation, options):
    tok = AutoTokenizer.from_pretrained(BUNDLED_DIR)
    if template != "bundled":
        tok.chat_template = QWEN3_LIKE
    for opened in (True, False):
        want = tok.apply_chat_template(
            conversation,
            add_generation_prompt=opened,
            continue_final_message=not opened,
            tokenize=False,
            **options,
        )
        assert chat_text(tok, conversation, opened, **options) == want


# ---------------------------------------------------------------------------- tokenizer files within limits
def big_vocabulary(model: Path, entries: int) -> None:
    """tokenizer.json with `entries` more tokens in its vocabulary, written as a stream."""
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = tok["model"].pop("vocab")
    head, tail = json.dumps({**tok, "model": {**tok["model"], "vocab": "@@"}}).split('"@@"')
    with open(model / "tokenizer.json", "w") as f:
        f.write(head + json.dumps(vocab)[:-1])
        for start in range(0, entries, 100_000):
            f.write(
                "".join(f', "t{i}": {len(vocab) + i}' for i in range(start, min(start + 100_000, entries)))
            )
        f.write("}" + tail)


def test_a_tokenizer_of_ten_million_entries_is_refused_at_once(checkpoint, capsys, within):  # noqa: F811
    big_vocabulary(checkpoint, 10_000_000)
    with within(30):
        assert_one_line_error(
            capsys, checkpoint, "tokenizer.json", f"larger than {LIMITS.tokenizer_json_bytes:,}"
        )


def test_a_tokenizer_with_more_entries_than_the_vocabulary_is_refused_before_it_is_built(
    checkpoint,  # noqa: F811
    capsys,
    within,
):
    big_vocabulary(checkpoint, 2_000_000)
    with within(30):
        assert_one_line_error(
            capsys, checkpoint, "tokenizer.json", "entries in model.vocab", "vocab_size=865"
        )


# ---------------------------------------------------------------------------- a tokenizer that panics
PANIC_REGEX = r"(\w+\s?)*$"  # backtracks past the regex engine's limit on "aaa...a!"


def panicking_copy(model: Path) -> None:
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = PANIC_REGEX
    (model / "tokenizer.json").write_text(json.dumps(tok))


def test_a_tokenizer_panic_is_a_typed_error(checkpoint):  # noqa: F811
    panicking_copy(checkpoint)
    _, tok = load(checkpoint)
    assert tokenize(tok, "hello there")
    with pytest.raises(TokenizerError, match="pre-tokenizer") as err:
        tokenize(tok, "a" * 40 + "!")
    assert err.value.code == "tokenizer_failed"


def test_a_tokenizer_panic_in_the_cli_is_one_line_and_exit_2(checkpoint):  # noqa: F811
    """The Rust runtime prints the panic (and a backtrace) itself: the CLI shows one line all the same."""
    panicking_copy(checkpoint)
    env = {**os.environ, "RUST_BACKTRACE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "refusion.cli", "generate", str(checkpoint), "a" * 40 + "!", "--no-chat"]
    done = subprocess.run([*argv, "--gen-length", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "refusion generate: error: the tokenizer failed" in done.stderr
