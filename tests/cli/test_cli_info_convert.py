"""`refusion info` and `refusion convert` through `refusion.cli.dispatch`, as a user runs them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from refusion.cli.dispatch import main


@pytest.fixture
def base(make_hf_dir, capsys):
    path = make_hf_dir("qwen3")
    capsys.readouterr()  # drop what building the fixture printed
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_prints_the_facts(base, capsys):
    code, out, err = run_cli(capsys, "info", base)
    assert code == 0, err
    n_params = AutoModelForCausalLM.from_pretrained(base).num_parameters()
    assert "Qwen3ForCausalLM (qwen3)" in out
    assert f"{n_params:,}" in out
    assert "none (run `refusion convert`)" in out
    assert "context length" in out and "512" in out
    assert "2 key/value" in out and "float32" in out
    assert "lossless         no (lossless: ar_correction" in out  # DecodeConfig's defaults: the paper's rule


def test_info_says_the_bundled_models_settings_are_lossless_at_any_temperature(capsys):
    code, out, err = run_cli(capsys, "info")
    assert code == 0, err
    assert "lossless         yes, at any temperature: greedy token for token, sampled in distribution" in out


def test_info_json(base, capsys, tokenizer_len):
    code, out, _ = run_cli(capsys, "info", base, "--json")
    info = json.loads(out)
    assert code == 0
    assert info["parameters"] == AutoModelForCausalLM.from_pretrained(base).num_parameters()
    assert info["vocab_size"] == info["tokenizer_size"] == tokenizer_len
    assert info["context_length"] == 512 and info["mask_token_id"] is None
    assert (info["num_hidden_layers"], info["num_attention_heads"], info["num_key_value_heads"]) == (2, 4, 2)
    assert info["dtype"] == "float32" and info["architecture"] == "Qwen3ForCausalLM"


def test_convert_then_info_shows_the_mask_id(base, capsys, tmp_path, tokenizer_len):
    out_dir = tmp_path / "refusion-model"
    code, out, err = run_cli(capsys, "convert", base, out_dir)
    assert code == 0, err
    assert str(tokenizer_len) in out
    code, out, _ = run_cli(capsys, "info", out_dir, "--json")
    info = json.loads(out)
    assert code == 0 and info["mask_token_id"] == tokenizer_len and info["vocab_size"] == tokenizer_len + 1


def test_convert_dtype(base, capsys, tmp_path):
    code, _, err = run_cli(capsys, "convert", base, tmp_path / "bf16", "--dtype", "bfloat16")
    assert code == 0, err
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_convert_needs_force_for_a_non_empty_output(base, capsys, tmp_path):
    out_dir = tmp_path / "out"
    assert run_cli(capsys, "convert", base, out_dir)[0] == 0
    code, out, err = run_cli(capsys, "convert", base, out_dir)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("refusion convert: error:") and "--force" in err
    assert run_cli(capsys, "convert", base, out_dir, "--force")[0] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "{tmp}/absent"],
        ["info", "{tmp}/absent", "--json"],
        ["convert", "{tmp}/absent", "{tmp}/out"],
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, argv):
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"refusion {argv[0]}: error:")
    assert not (tmp_path / "out").exists()


def test_corrupt_base_leaves_no_output(base, capsys, tmp_path):
    (base / "model.safetensors").write_bytes(b"\0" * 100)
    code, _, err = run_cli(capsys, "convert", base, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "safetensors" in err
    assert not (tmp_path / "out").exists()
