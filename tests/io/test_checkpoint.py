"""Loading, saving and converting checkpoints, against `transformers` as the other reader
and writer of the format, and every bad input with its typed error."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import refusion
from refusion.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from refusion.io import (
    add_mask_token,
    convert,
    dtypes,
    load,
    resolve,
    save,
    save_pretrained,
)
from refusion.model.prompts import MASK_TOKEN

FAMILIES = ["llama", "llama3", "qwen2", "qwen3"]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def sample(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(0))  # (B, T)
    return tokens, torch.arange(10).expand(2, -1)


def logits_of(model, vocab: int) -> torch.Tensor:
    return model(*sample(vocab))


def hf_logits_of(hf_model, vocab: int) -> torch.Tensor:
    tokens, positions = sample(vocab)
    return hf_model(tokens, position_ids=positions).logits


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def no_leftovers(parent: Path) -> bool:
    """No staging or moved-aside directories next to an output dir."""
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------- load / save
def test_load_returns_model_and_tokenizer_exported_as_refusion_load(make_hf_dir):
    model, tokenizer = refusion.load(make_hf_dir("qwen3"))
    assert refusion.load is load
    assert model.config.model_type == "qwen3" and model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>" and model.config.mask_token_id is None
    assert not model.training


@pytest.mark.parametrize("name", FAMILIES)
def test_save_then_load_round_trip_is_identical(make_hf_dir, tmp_path, name):
    model, tokenizer = load(make_hf_dir(name))
    out = save_pretrained(model, tokenizer, tmp_path / "saved")
    again, tok2 = load(out)
    vocab = model.config.vocab_size
    assert torch.equal(logits_of(again, vocab), logits_of(model, vocab))
    assert again.config.to_hf_dict() == model.config.to_hf_dict()
    assert tok2.get_vocab() == tokenizer.get_vocab() and tok2.chat_template == tokenizer.chat_template
    assert no_leftovers(tmp_path)


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_loads_what_we_save(make_hf_dir, tmp_path, name):
    model, tokenizer = load(make_hf_dir(name))
    save_pretrained(model, tokenizer, tmp_path / "saved")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    vocab = model.config.vocab_size
    torch.testing.assert_close(logits_of(model, vocab), hf_logits_of(hf, vocab))


def test_save_in_shards_with_an_index_that_transformers_and_we_load(make_hf_dir, tmp_path):
    model, tokenizer = load(make_hf_dir("qwen3"))
    out = save_pretrained(model, tokenizer, tmp_path / "sharded", max_shard_bytes=60_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    biggest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert all(f.stat().st_size <= max(60_000, biggest) + 10_000 for f in shards)  # + the header
    vocab = model.config.vocab_size
    again, _ = load(out)
    assert torch.equal(logits_of(again, vocab), logits_of(model, vocab))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits_of(model, vocab), hf_logits_of(hf, vocab))


def test_sharded_safetensors_with_index(make_hf_dir):
    path = make_hf_dir("llama", shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file() and len(
        list(path.glob("model-*.safetensors"))
    ) > 2
    model, _ = load(path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    vocab = model.config.vocab_size
    torch.testing.assert_close(logits_of(model, vocab), hf_logits_of(hf, vocab))


def test_tied_embeddings_stay_tied_on_load(make_hf_dir):
    path = make_hf_dir("qwen2")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # transformers stores one copy
    model, _ = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_choices(make_hf_dir):
    path = make_hf_dir("qwen3")
    assert load(path, dtype="bfloat16")[0].dtype == torch.bfloat16
    assert load(path, dtype=torch.float16)[0].dtype == torch.float16
    assert load(path, dtype="auto")[0].dtype == torch.float32  # the config's
    edit_json(path / "config.json", torch_dtype="bfloat16", dtype="bfloat16")
    assert load(path)[0].dtype == torch.bfloat16


def test_saved_config_records_the_weights_dtype(make_hf_dir, tmp_path):
    model, tokenizer = load(make_hf_dir("qwen3"), dtype="bfloat16")
    save_pretrained(model, tokenizer, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load(tmp_path / "bf16")[0].dtype == torch.bfloat16


def test_directory_without_tokenizer_loads_with_none(make_hf_dir):
    model, tokenizer = load(make_hf_dir("llama", tokenizer=False))
    assert tokenizer is None and model.config.vocab_size > 0


# ---------------------------------------------------------------------------- MASK token
@pytest.mark.parametrize("name", ["llama", "qwen2"])  # untied, tied
def test_convert_adds_mask_token(make_hf_dir, tmp_path, name):
    base = make_hf_dir(name)
    base_model, base_tok = load(base)
    n_tok, vocab = len(base_tok), base_model.config.vocab_size
    mask_id = convert(base, tmp_path / "out")
    assert mask_id == n_tok == vocab  # a new row past the end
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mask_token_id"] == mask_id
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == mask_id
    assert tok(f"hello{MASK_TOKEN}", add_special_tokens=False)["input_ids"][-1] == mask_id
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight  # (V + 1, hidden)
    assert embed.shape[0] == vocab + 1 and head.shape[0] == vocab + 1
    old_embed = base_model.model.embed_tokens.weight
    torch.testing.assert_close(embed[:vocab], old_embed, rtol=0, atol=0)
    torch.testing.assert_close(embed[mask_id], old_embed.mean(0))
    torch.testing.assert_close(head[mask_id], base_model.lm_head.weight.mean(0))
    ours, _ = load(tmp_path / "out")
    assert ours.config.mask_token_id == mask_id
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "qwen2")
    torch.testing.assert_close(logits_of(ours, vocab + 1), hf_logits_of(hf, vocab + 1))


def test_mask_in_padded_vocabulary_uses_a_spare_row(make_hf_dir):
    """Like Qwen's vocabularies: rows past the tokenizer exist; the first spare one is used
    and set to the mean of the token rows before it, without growing the matrices."""
    model, tokenizer = load(make_hf_dir("qwen3", vocab_pad=5))
    n_tok, vocab = len(tokenizer), model.config.vocab_size
    before = model.lm_head.weight.clone()
    mask_id = add_mask_token(model, tokenizer)
    assert mask_id == n_tok < vocab and model.config.vocab_size == vocab
    torch.testing.assert_close(model.lm_head.weight[mask_id], before[:n_tok].mean(0))
    torch.testing.assert_close(model.lm_head.weight[mask_id + 1 :], before[mask_id + 1 :], rtol=0, atol=0)


def test_add_mask_token_is_idempotent(make_hf_dir):
    model, tokenizer = load(make_hf_dir("llama"))
    first = add_mask_token(model, tokenizer)
    shape, n_tok = model.model.embed_tokens.weight.shape, len(tokenizer)
    assert add_mask_token(model, tokenizer) == first
    assert model.model.embed_tokens.weight.shape == shape and len(tokenizer) == n_tok


def test_add_mask_token_keeps_the_other_special_tokens(make_hf_dir):
    model, tokenizer = load(make_hf_dir("qwen3"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    mask_id = add_mask_token(model, tokenizer)
    assert {"<|tool|>", MASK_TOKEN, "<|im_end|>"} <= set(tokenizer.all_special_tokens)
    assert tokenizer.decode([5, mask_id, 6], skip_special_tokens=True) == tokenizer.decode([5, 6])


def test_add_mask_token_without_tokenizer_appends_a_row(make_hf_dir):
    model, _ = load(make_hf_dir("qwen2", tokenizer=False))
    vocab = model.config.vocab_size
    old_rows = model.model.embed_tokens.weight.clone()
    assert add_mask_token(model, None) == vocab
    assert model.config.vocab_size == vocab + 1 and model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.model.embed_tokens.weight[vocab], old_rows.mean(0))
    assert model(torch.tensor([[vocab]]), torch.tensor([[0]])).shape == (1, 1, vocab + 1)


def test_mask_id_comes_from_the_tokenizer_when_config_lacks_it(make_hf_dir, tmp_path):
    convert(make_hf_dir("qwen3"), tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = cfg.pop("mask_token_id")
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    model, _ = load(tmp_path / "out")
    assert model.config.mask_token_id == expected


# ---------------------------------------------------------------------------- bad inputs
def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no model directory"):
        load(tmp_path / "absent")


def test_missing_config(make_hf_dir):
    path = make_hf_dir("qwen3")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load(path)


def test_missing_weights(make_hf_dir):
    path = make_hf_dir("qwen3")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(make_hf_dir, damage):
    path = make_hf_dir("qwen3")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file" * 20 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        load(path)


def test_missing_shard(make_hf_dir):
    path = make_hf_dir("llama", shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load(path)


def test_unsupported_architecture_names_the_supported_ones(make_hf_dir):
    path = make_hf_dir("qwen3")
    edit_json(path / "config.json", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError) as err:
        load(path)
    assert all(name in str(err.value) for name in ("llama", "qwen2", "qwen3"))


def rewrite_weights(path: Path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_mismatched_shape_names_the_tensor(make_hf_dir):
    path = make_hf_dir("qwen3")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(path, lambda s: s.update({name: s[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(path)


def test_missing_tensor_names_the_tensor(make_hf_dir):
    path = make_hf_dir("qwen3")
    name = "model.layers.0.self_attn.k_norm.weight"
    rewrite_weights(path, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=f"{name.replace('.', r'[.]')} is missing"):
        load(path)


def test_unexpected_tensor_is_refused(make_hf_dir):
    """Weights the config does not describe mean config and weights disagree (e.g. q/k
    norms under a Llama config)."""
    path = make_hf_dir("qwen3")
    edit_json(path / "config.json", model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match="unexpected tensor .*_norm"):
        load(path)


def test_unknown_dtype(make_hf_dir):
    with pytest.raises(ConfigError, match="float13"):
        load(make_hf_dir("qwen3"), dtype="float13")
    with pytest.raises(ConfigError):
        load(make_hf_dir("qwen3", dirname="other"), dtype=torch.int8)


def test_dtype_the_device_cannot_run(make_hf_dir, monkeypatch):
    """The config's dtype falls back to float32; an explicit one is an error."""
    path = make_hf_dir("qwen3")
    edit_json(path / "config.json", torch_dtype="bfloat16", dtype="bfloat16")
    monkeypatch.setattr(dtypes, "_device_runs", lambda device, dtype: dtype == torch.float32)
    assert load(path)[0].dtype == torch.float32
    with pytest.raises(ConfigError, match="cannot run"):
        load(path, dtype="bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device(make_hf_dir):
    with pytest.raises(ConfigError, match="cuda"):
        load(make_hf_dir("qwen3"), device="cuda")


def test_hub_id_offline_says_how_to_load_locally(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="local model directory"):
        load("refusion-test-org/no-such-model")


def test_missing_bundled_model(monkeypatch, tmp_path):
    monkeypatch.setattr(resolve, "BUNDLED_DIR", tmp_path / "refusion-tiny")
    with pytest.raises(CheckpointError, match="bundled"):
        load()


def test_plain_file_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="is a file"):
        load(tmp_path / "weights.bin")


# ---------------------------------------------------------------------------- atomic output
def failing_writer(*_args, **_kwargs):
    raise OSError("No space left on device")


def test_failed_save_leaves_no_output_dir(make_hf_dir, tmp_path, monkeypatch):
    model, tokenizer = load(make_hf_dir("qwen3"))
    monkeypatch.setattr(save, "_write_weights", failing_writer)
    out = tmp_path / "parent" / "out"
    with pytest.raises(CheckpointError, match="No space left"):
        save_pretrained(model, tokenizer, out)
    assert not out.exists() and no_leftovers(out.parent)


def test_failed_convert_leaves_no_output_dir(make_hf_dir, tmp_path, monkeypatch):
    base = make_hf_dir("llama")
    monkeypatch.setattr(save, "_write_weights", failing_writer)
    with pytest.raises(CheckpointError):
        convert(base, tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)
    (base / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(CheckpointError):
        convert(base, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_convert_refuses_a_non_empty_output_unless_overwriting(make_hf_dir, tmp_path, monkeypatch):
    base, out = make_hf_dir("qwen3"), tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        convert(base, out)
    monkeypatch.setattr(save, "_write_weights", failing_writer)
    with pytest.raises(CheckpointError):
        convert(base, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"  # a failed overwrite keeps the old content
    monkeypatch.undo()
    convert(base, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file() and no_leftovers(tmp_path)


def test_convert_into_an_empty_existing_dir(make_hf_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    convert(make_hf_dir("qwen3"), tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
