"""Checkpoints and outputs that are not what they claim: damaged weights that `refusion
info` must refuse as `load` does, configs whose architecture disagrees with itself,
hostile files (fields of the wrong type or range, JSON the parser cannot take, FIFOs and
devices, shard paths outside the directory, GGUF headers claiming more than the file
holds, failing chat templates, NaN weights) that must fail in one line, saves that must
follow the umask and clean up after killed writers, and a reader that closes the pipe
early."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from refusion.cli.dispatch import EXIT_BROKEN_PIPE, main
from refusion.errors import CheckpointError, UnsupportedArchitectureError
from refusion.io import convert, describe, load, loading, save, save_pretrained
from refusion.io import staging as staging_dirs
from refusion.io.resolve import BUNDLED_DIR
from refusion.settings.model import ModelConfig


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(capsys, model: Path, *words: str) -> str:
    """`refusion info MODEL` fails as every verb does: nothing on stdout, one line on
    stderr, exit code 2; and `load` refuses the same checkpoint."""
    capsys.readouterr()
    code, out, err = run_cli(capsys, "info", model)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith("refusion info: error: "), err
    assert all(w in err for w in words), err
    with pytest.raises(CheckpointError):
        load(model)
    return err


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


# ---------------------------------------------------------------------------- info checks the weights
@pytest.mark.parametrize("keep", ["first 100 bytes", "header only", "all but the last byte"])
def test_info_refuses_a_truncated_file(make_hf_dir, capsys, keep):
    path = make_hf_dir("qwen3")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    cut = {"first 100 bytes": 100, "header only": header_end, "all but the last byte": len(data) - 1}[keep]
    weights.write_bytes(data[:cut])
    err = assert_one_line_error(capsys, path, "model.safetensors")
    if keep != "first 100 bytes":  # the header reads: the size check says what happened
        assert "truncated" in err and f"{len(data):,}" in err and "again" in err


def test_info_refuses_a_truncated_shard(make_hf_dir, capsys):
    path = make_hf_dir("llama", shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert_one_line_error(capsys, path, shard.name, "truncated")


def test_info_refuses_random_bytes(make_hf_dir, capsys):
    path = make_hf_dir("qwen3")
    (path / "model.safetensors").write_bytes(os.urandom(4096))
    assert_one_line_error(capsys, path, "model.safetensors", "not a readable safetensors file")


def test_info_refuses_an_index_naming_a_missing_shard(make_hf_dir, capsys):
    path = make_hf_dir("llama", shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(capsys, path, shard.name, "missing")


def test_info_refuses_a_vocab_size_the_embedding_does_not_have(make_hf_dir, capsys, tokenizer_len):
    path = make_hf_dir("qwen3")
    edit_json(path / "config.json", vocab_size=tokenizer_len + 7)
    assert_one_line_error(capsys, path, "model.embed_tokens.weight", str(tokenizer_len + 7))


def test_info_refuses_a_tokenizer_larger_than_the_vocabulary(make_hf_dir, capsys, tokenizer_len):
    """Weights and config agree, but the tokenizer makes ids past the embedding's rows."""
    path = make_hf_dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<|extra-1|>", "<|extra-2|>"])
    tokenizer.save_pretrained(path)
    assert_one_line_error(
        capsys, path, "tokenizer", f"{tokenizer_len + 2} tokens", f"vocab_size={tokenizer_len}"
    )


def test_info_accepts_a_padded_vocabulary(make_hf_dir, capsys, tokenizer_len):
    """More embedding rows than tokens is normal (vocabularies padded to a round size)."""
    path = make_hf_dir("qwen3", vocab_pad=5)
    code, out, err = run_cli(capsys, "info", path, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["vocab_size"], info["tokenizer_size"]) == (tokenizer_len + 5, tokenizer_len)
    assert load(path)[0].config.vocab_size == tokenizer_len + 5


def test_info_refuses_a_tensor_of_the_wrong_shape(make_hf_dir, capsys):
    path = make_hf_dir("qwen3")
    name = "model.layers.0.mlp.down_proj.weight"
    state = load_file(path / "model.safetensors")
    state[name] = state[name][:, :-1].clone()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(capsys, path, name)


def test_describe_reads_headers_but_no_weights(make_hf_dir, monkeypatch):
    path = make_hf_dir("qwen3")
    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("describe read the weights"))
    assert describe(path)["parameters"] > 0


def test_info_of_the_bundled_model_still_works(capsys):
    code, out, err = run_cli(capsys, "info", "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Qwen3ForCausalLM"


# ---------------------------------------------------------------------------- architectures
def hf_dict(**changes) -> dict:
    d = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize(
    "model_type, architectures, bad",
    [
        ("qwen3", ["FooBarForCausalLM"], "FooBarForCausalLM"),
        ("qwen3", ["LlamaForCausalLM"], "LlamaForCausalLM"),
        ("llama", ["Qwen2ForCausalLM"], "Qwen2ForCausalLM"),
        ("qwen2", ["Qwen2ForSequenceClassification"], "Qwen2ForSequenceClassification"),
        ("qwen3", ["Qwen3ForCausalLM", "FooBarForCausalLM"], "FooBarForCausalLM"),
        ("qwen3", "FooBarForCausalLM", "FooBarForCausalLM"),
    ],
)
def test_an_architecture_that_disagrees_with_model_type_is_refused(model_type, architectures, bad):
    with pytest.raises(UnsupportedArchitectureError) as err:
        ModelConfig.from_hf_dict(hf_dict(model_type=model_type, architectures=architectures))
    message = str(err.value)
    assert bad in message and f"model_type={model_type!r}" in message and "\n" not in message


@pytest.mark.parametrize(
    "model_type, architectures",
    [
        ("llama", ["LlamaForCausalLM"]),
        ("qwen2", ["Qwen2ForCausalLM"]),
        ("qwen3", ["Qwen3ForCausalLM"]),
        ("qwen3", None),
        ("qwen3", []),
    ],
)
def test_matching_or_absent_architectures_are_accepted(model_type, architectures):
    config = ModelConfig.from_hf_dict(hf_dict(model_type=model_type, architectures=architectures))
    assert config.model_type == model_type


def test_info_and_load_refuse_an_unknown_architecture(make_hf_dir, capsys):
    path = make_hf_dir("qwen3")
    edit_json(path / "config.json", architectures=["FooBarForCausalLM"])
    assert_one_line_error(capsys, path, "FooBarForCausalLM", "'qwen3'")
    with pytest.raises(UnsupportedArchitectureError, match="FooBarForCausalLM"):
        load(path)


def test_a_config_without_architectures_still_loads(make_hf_dir):
    path = make_hf_dir("qwen3")
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    assert load(path)[0].config.model_type == "qwen3"
    assert describe(path)["architecture"] == "Qwen3ForCausalLM"


# ---------------------------------------------------------------------------- modes of what is saved
def modes(directory: Path) -> tuple[int, set[int]]:
    """The directory's mode and the set of its files' modes."""
    return stat.S_IMODE(directory.stat().st_mode), {
        stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()
    }


@pytest.fixture
def umask():
    """Set the umask for the test, restoring the previous one after."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_save_pretrained_follows_the_umask(tiny_model, tiny_tokenizer, tmp_path, umask, mask):
    umask(mask)
    out = save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "saved")
    assert modes(out) == (0o777 & ~mask, {0o666 & ~mask})
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_convert_follows_the_umask(make_hf_dir, tmp_path, umask, mask):
    base = make_hf_dir("qwen3")
    umask(mask)
    convert(base, tmp_path / "out")
    assert modes(tmp_path / "out") == (0o777 & ~mask, {0o666 & ~mask})


def test_overwrite_follows_the_umask(tiny_model, tmp_path, umask):
    out = tmp_path / "saved"
    umask(0o077)
    save_pretrained(tiny_model, None, out)
    umask(0o022)
    save_pretrained(tiny_model, None, out, overwrite=True)
    assert modes(out) == (0o755, {0o644})


# ---------------------------------------------------------------------------- staging left by killed saves
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_staging(parent: Path, target: str, pid: int, host: str | None = None, size: int = 1000) -> Path:
    host = host or staging_dirs.writer_tag().rsplit("-", 1)[0]
    d = parent / f".{target}.partial-{host}-{pid}-0123abcd"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"\0" * size)
    (d / "sub" / "x").write_bytes(b"\0" * size)
    return d


def test_staging_names_carry_the_writer(tiny_model, tmp_path, monkeypatch):
    seen: list[Path] = []

    def fail(_model, directory, _max_shard_bytes):
        seen.append(directory)
        raise OSError("disk full")

    monkeypatch.setattr(save, "_write_weights", fail)
    with pytest.raises(CheckpointError, match="disk full"):
        save_pretrained(tiny_model, None, tmp_path / "out")
    (staging,) = seen
    assert staging.parent == tmp_path
    assert staging.name.startswith(".out.partial-") and f"-{os.getpid()}-" in staging.name
    assert not staging.exists()


def test_a_dead_writers_staging_is_removed_on_the_next_save(tiny_model, tmp_path, caplog):
    stale = fake_staging(tmp_path, "out", dead_pid(), size=300_000)
    with caplog.at_level(logging.WARNING, logger="refusion.io.staging"):
        save_pretrained(tiny_model, None, tmp_path / "out")
    assert not stale.exists()
    assert (tmp_path / "out" / "model.safetensors").is_file()
    (record,) = [r for r in caplog.records if r.name == "refusion.io.staging"]
    message = record.getMessage()
    assert "\n" not in message
    assert (
        "removed 1 staging folder of" in message and str(tmp_path / "out") in message and "0.6 MB" in message
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_live_foreign_and_other_targets_staging_stay(tiny_model, tmp_path, caplog):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = dead_pid()
        keep = [
            fake_staging(tmp_path, "out", os.getpid()),  # this process: a save in another thread
            fake_staging(tmp_path, "out", sleeper.pid),  # a live writer
            fake_staging(tmp_path, "other", dead),  # another target
            fake_staging(tmp_path, "out", dead, host="elsewhere.example"),  # its pids are not ours to judge
            fake_staging(tmp_path, "out.partial-x", dead),  # a target whose name looks like staging
        ]
        gone = fake_staging(tmp_path, "out", dead)
        (tmp_path / ".out.partial-abc12345").mkdir()  # no writer in the name: cannot be judged
        keep.append(tmp_path / ".out.partial-abc12345")
        with caplog.at_level(logging.WARNING, logger="refusion.io.staging"):
            save_pretrained(tiny_model, None, tmp_path / "out")
        assert all(p.is_dir() for p in keep) and not gone.exists()
        assert len([r for r in caplog.records if "removed 1 staging folder" in r.getMessage()]) == 1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_convert_removes_a_dead_writers_staging(make_hf_dir, tmp_path):
    stale = fake_staging(tmp_path, "out", dead_pid())
    convert(make_hf_dir("qwen3"), tmp_path / "out")
    assert not stale.exists() and (tmp_path / "out" / "config.json").is_file()


def test_nothing_to_remove_logs_nothing(tiny_model, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="refusion.io.staging"):
        save_pretrained(tiny_model, None, tmp_path / "out")
    assert not [r for r in caplog.records if r.name == "refusion.io.staging"]


# ---------------------------------------------------------------------------- a closed stdout
@pytest.fixture
def closed_pipe():
    """A writable stream on a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = os.fdopen(write_end, "w")
    yield stream
    stream.close()


@pytest.mark.parametrize(
    "argv", [["info"], ["info", "--json"], ["--help"], ["info", "--help"], ["generate", "--help"]]
)
def test_a_closed_stdout_ends_quietly(closed_pipe, capsys, monkeypatch, argv):
    monkeypatch.setattr(sys, "stdout", closed_pipe)  # here: capsys sets its own as the test starts
    assert main(argv) == EXIT_BROKEN_PIPE
    closed_pipe.flush()  # what is left goes to /dev/null now: no second error at exit
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_elsewhere_is_not_hidden(monkeypatch, capsys):
    """A BrokenPipeError from something other than stdout (a child's stdin) is a bug to show."""
    import refusion.cli.commands.info as info

    def broken(_args):
        raise BrokenPipeError("a child's stdin")

    monkeypatch.setattr(info, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["info"])


REFUSION = [sys.executable, "-c", "import sys; from refusion.cli import main; sys.exit(main())"]


def test_info_into_a_closed_pipe_prints_no_traceback():
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([*REFUSION, "info"], stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    os.close(read_end)  # gone before the child has imported anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_BROKEN_PIPE and err == "", err


def test_info_piped_to_head_prints_no_traceback():
    """The race a user meets: head may exit before or after info writes; either way no
    traceback, and an exit code of 0 or 141."""
    script = f"{shlex.join(REFUSION)} info | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}} >&2"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert done.stderr.strip() in ("0", str(EXIT_BROKEN_PIPE)), done.stderr


# ---------------------------------------------------------------------------- hostile files
DEEP = "[" * 100_000 + "]" * 100_000  # nesting past the JSON parser's recursion limit
LONG = "9" * 5000  # more digits than Python's int() converts


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A copy of the bundled model, to spoil."""
    out = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR, out)
    return out


def set_config_text(model: Path, key: str, text: str) -> None:
    """config.json with `key` set to the raw JSON `text` (what json.dumps cannot write)."""
    config = json.loads((model / "config.json").read_text())
    config[key] = "@@"
    (model / "config.json").write_text(json.dumps(config).replace('"@@"', text))


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("vocab_size", "865", "must be an integer, got '865' (str)"),
        ("hidden_size", 256.0, "must be an integer, got 256.0 (float)"),
        ("num_hidden_layers", -4, "between 1 and"),
        ("intermediate_size", 0, "between 1 and"),
        ("num_attention_heads", 10**40, "an integer of about 41 digits"),
        ("num_key_value_heads", "4", "must be an integer"),
        ("max_position_embeddings", -1, "between 1 and"),
        ("head_dim", 63, "even number"),
        ("rms_norm_eps", float("nan"), "finite number, got NaN"),
        ("rms_norm_eps", -1e-6, "between 0.0 and 1.0"),
        ("rope_theta", -10000.0, ">= 1.0"),
        ("rope_theta", float("inf"), "finite number, got Infinity"),
        ("rope_scaling", "linear", "must be an object"),
        ("rope_scaling", {"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor"),
        ("eos_token_id", 865, "between 0 and 864, got 865"),
        ("eos_token_id", [2, 99999], "between 0 and 864, got 99999"),
        ("eos_token_id", [2, None], "must be an integer, got None"),
        ("eos_token_id", -1, "between 0 and 864"),
        ("bos_token_id", 10**6, "between 0 and 864"),
        ("mask_token_id", "3", "must be an integer"),
        ("tie_word_embeddings", "no", "must be a boolean"),
        ("torch_dtype", ["float32"], "must be a string"),
    ],
)
def test_a_config_field_of_the_wrong_type_or_range_is_one_line(checkpoint, capsys, field, value, words):
    edit_json(checkpoint / "config.json", **{field: value})
    assert_one_line_error(capsys, checkpoint, "config.json", field, words)


@pytest.mark.parametrize(
    "key, text, words",
    [
        ("vocab_size", LONG, "a number too long to read"),
        ("extra", DEEP, "nested deeper"),
        ("extra", '"\\ud800"', "lone UTF-16 surrogate"),
    ],
)
def test_config_json_the_parser_cannot_take_is_one_line(checkpoint, capsys, key, text, words):
    set_config_text(checkpoint, key, text)
    assert_one_line_error(capsys, checkpoint, "config.json", words)


def test_a_config_of_a_million_layers_is_weighed_against_the_weights(checkpoint, capsys, within):
    edit_json(checkpoint / "config.json", num_hidden_layers=1_000_000)
    with within(30):
        assert_one_line_error(
            capsys, checkpoint, "config.json", "num_hidden_layers=1000000", "more than the weight files"
        )


def spoil(path: Path, how: str) -> None:
    """Put something other than a regular file where a checkpoint's file was."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif how == "symlink loop":
        path.symlink_to(path.name + ".loop")
        path.with_name(path.name + ".loop").symlink_to(path.name)
    elif how == "directory":
        path.mkdir()


@pytest.mark.parametrize(
    "name, how, words",
    [
        ("config.json", "fifo", "is a FIFO"),
        ("config.json", "symlink loop", "is a symlink loop"),
        ("config.json", "directory", "is a directory"),
        ("tokenizer.json", "fifo", "is a FIFO"),
        ("tokenizer_config.json", "symlink loop", "is a symlink loop"),
        ("chat_template.jinja", "fifo", "is a FIFO"),
        ("model.safetensors", "fifo", "is a FIFO"),
    ],
)
def test_a_checkpoint_file_that_is_not_a_regular_file_is_one_line(
    checkpoint, capsys, within, name, how, words
):
    spoil(checkpoint / name, how)
    with within(30):
        assert_one_line_error(capsys, checkpoint, name, words, "not a")


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("tokenizer.json", DEEP, "nested deeper"),
        ("tokenizer.json", '{"version": ' + LONG + "}", "a number too long"),
        ("tokenizer_config.json", DEEP, "nested deeper"),
        ("tokenizer_config.json", '{"eos_token": "\\ud800"}', "lone UTF-16 surrogate"),
        ("tokenizer_config.json", '{"model_max_length": ' + LONG + "}", "a number too long"),
    ],
)
def test_tokenizer_files_the_parser_cannot_take_are_one_line(checkpoint, capsys, name, text, words):
    (checkpoint / name).write_text(text)
    assert_one_line_error(capsys, checkpoint, name, words)


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ raise_exception('no system prompts') }}", "no system prompts"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ],
)
def test_a_chat_template_that_fails_is_one_line(checkpoint, capsys, template, words):
    (checkpoint / "chat_template.jinja").write_text(template)
    assert_one_line_error(capsys, checkpoint, "chat template", words, "--no-chat")


def shard_index(model: Path, weight_map) -> None:
    """The single weight file as a one-shard checkpoint whose index holds `weight_map`."""
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def test_an_index_naming_a_shard_outside_the_directory_is_refused(checkpoint, tmp_path, capsys):
    """An absolute path to another (loadable) copy of the weights: it must not be read."""
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(checkpoint / "model.safetensors", outside)
    names = list(load_file(outside))
    shard_index(checkpoint, {name: str(outside) for name in names})
    assert_one_line_error(capsys, checkpoint, "model.safetensors.index.json", outside.name, "inside")


@pytest.mark.parametrize(
    "weight_map, words",
    [
        ({"model.embed_tokens.weight": "../model/model-00001-of-00001.safetensors"}, "inside"),
        ({"model.embed_tokens.weight": "/dev/zero"}, "inside"),
        ({"model.embed_tokens.weight": 5}, "inside"),
        (["model-00001-of-00001.safetensors"], "weight_map must be an object"),
    ],
)
def test_an_index_that_is_not_a_map_of_shard_names_is_refused(checkpoint, capsys, weight_map, words):
    shard_index(checkpoint, weight_map)
    assert_one_line_error(capsys, checkpoint, "model.safetensors.index.json", words)


def test_an_index_too_deep_to_parse_is_one_line(checkpoint, capsys):
    shard_index(checkpoint, {})
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    assert_one_line_error(capsys, checkpoint, "model.safetensors.index.json", "nested deeper")


def spoil_weight(model: Path, value: float) -> str:
    name = "model.layers.0.mlp.down_proj.weight"
    state = load_file(model / "model.safetensors")
    state[name][0, 0] = value
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_refused_unless_allowed(checkpoint, capsys, value):
    name = spoil_weight(checkpoint, value)
    with pytest.raises(CheckpointError, match="--allow-nonfinite-weights") as err:
        load(checkpoint)
    assert name in str(err.value) and "1 NaN or infinite value" in str(err.value)
    code, out, err_text = run_cli(capsys, "generate", checkpoint, "hi", "--gen-length", "4")
    assert (code, out) == (2, "") and err_text.count("\n") == 1, err_text
    assert name in err_text and "--allow-nonfinite-weights" in err_text
    model, _ = load(checkpoint, allow_nonfinite=True)
    assert not bool(torch.isfinite(model.state_dict()[name]).all())
    code, _, err_text = run_cli(
        capsys, "generate", checkpoint, "hi", "--gen-length", "4", "--allow-nonfinite-weights"
    )
    assert code == 0, err_text


def test_integer_weights_are_refused_not_cast(checkpoint, capsys):
    """int8 values cast to float would be weights of the wrong scale, without a word."""
    state = load_file(checkpoint / "model.safetensors")
    name = "model.embed_tokens.weight"
    state[name] = (state[name] * 100).to(torch.int8)
    save_file(state, checkpoint / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(capsys, checkpoint, name, "stored as I8", "not as floating point")


def test_a_safetensors_header_too_deep_to_parse_is_one_line(checkpoint, capsys):
    header = DEEP.encode()
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert_one_line_error(capsys, checkpoint, "model.safetensors", "not a readable safetensors file")


def gguf_file(tmp_path: Path, body: bytes, version: int = 3) -> Path:
    """A GGUF file: the magic, `version`, then `body` (the counts and what follows)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", version) + body + b"\0" * 64)
    return path


def kv(key: bytes, kind: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + value


@pytest.mark.parametrize(
    "body, version, words",
    [
        (struct.pack("<QQ", 2**63 - 1, 0), 3, "tensor_count=9,223,372,036,854,775,807"),
        (struct.pack("<QQ", 0, 2**63 - 1), 3, "kv_count=9,223,372,036,854,775,807"),
        (struct.pack("<QQQ", 0, 1, 2**60) + b"general.architecture", 3, "key 0 declares"),
        (struct.pack("<QQ", 0, 1) + kv(b"general.name", 8, struct.pack("<Q", 2**62)), 3, "'general.name'"),
        (
            struct.pack("<QQ", 0, 1) + kv(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**61)),
            3,
            "length",
        ),
        (struct.pack("<QQ", 0, 1) + kv(b"x", 77, b""), 3, "unknown value type 77"),
        (struct.pack("<QQ", 0, 0), 99, "version 99"),
    ],
)
def test_a_gguf_header_that_claims_more_than_the_file_holds_is_one_line(
    tmp_path, capsys, within, body, version, words
):
    path = gguf_file(tmp_path, body, version)
    with within(30):
        assert_one_line_error(capsys, path, "model.gguf", "GGUF header is damaged", words)
