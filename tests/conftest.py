"""Shared fixtures: tiny random Hugging Face models and a tiny tokenizer, built offline.

Everything here is made from scratch in a temporary directory (no hub access): a
byte-level BPE tokenizer trained on a few sentences, and tiny Llama / Qwen2 / Qwen3
models with randomised weights, written the way `transformers` writes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.overrides import TorchFunctionMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from refusion import ModelConfig, Transformer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SENTENCES = [
    "The cat sat on the mat and looked at the dog.",
    "Two plus three is five; five plus five is ten.",
    "def add(a, b):\n    return a + b\n",
    "A slot is a run of tokens decoded together, then verified left to right.",
    "Hello world! Hello there, how are you today?",
]

# Tiny members of each family, each switching on the features that distinguish it.
_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA, untied, plain RoPE
    "llama": dict(
        _COMMON, model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    # Llama-3 frequency scaling (positions beyond the original 64 matter) and q/k/v/o bias
    "llama3": dict(
        _COMMON,
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # qkv bias, tied embeddings, GQA
    "qwen2": dict(
        _COMMON, model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    # q/k norm, head_dim not hidden/heads, GQA
    "qwen3": dict(
        _COMMON,
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}

# The test machines have two cores shared with other jobs: with two intra-op threads,
# a busy neighbour makes OpenMP spin-waits cost 10-30x; one thread is never worse than 2x.
torch.set_num_threads(1)


# REFUSION_TEST_DEVICE=cuda runs the tests on that device (scripts/gpu_check.sh): models
# and inputs that the tests build without naming a device are built there. Unset (the
# default), nothing changes: the suite runs on the CPU.
TEST_DEVICE = os.environ.get("REFUSION_TEST_DEVICE")
_FACTORIES = {
    torch.empty,
    torch.empty_strided,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tensor,
    torch.as_tensor,
}


class OnTestDevice(TorchFunctionMode):
    """Tensor factories without an explicit device build on the test device, so a test
    written for the CPU runs unchanged on an accelerator (parameters too: nn.Linear and
    friends allocate through torch.empty). A draw from a CPU generator is made on the CPU
    and then moved, so seeded inputs hold the same values on every device."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type == "cpu":
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def _test_device() -> Iterator[None]:
    if TEST_DEVICE is None:
        yield
        return
    with OnTestDevice(TEST_DEVICE):
        yield


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text round-trips) with ChatML-style specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong op shows in the logits; norm weights around 1
    (not exactly 1, so a forgotten norm weight shows too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny tokenizer (tokenizer.json, tokenizer_config.json, chat template)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def tiny_tokenizer(tokenizer_dir: Path):
    """A fresh copy of the tiny tokenizer, safe to modify."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tokenizer_len(tokenizer_dir: Path) -> int:
    return len(AutoTokenizer.from_pretrained(tokenizer_dir))


@pytest.fixture(scope="session")
def make_hf_model(tokenizer_len: int) -> Callable[..., PreTrainedModel]:
    """Factory: a tiny random `transformers` model of the named TINY_CONFIGS family, float32,
    eval mode, eager attention (the plainest reference). vocab = tokenizer + vocab_pad."""

    def make(name: str, vocab_pad: int = 0, seed: int = 0, **overrides: Any) -> PreTrainedModel:
        cfg = dict(TINY_CONFIGS[name], **overrides)
        config = AutoConfig.for_model(
            **cfg, vocab_size=tokenizer_len + vocab_pad, bos_token_id=1, eos_token_id=2, pad_token_id=0
        )
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        randomise_(model, seed)
        return model.eval()

    return make


@pytest.fixture
def make_hf_dir(
    tmp_path: Path, tokenizer_dir: Path, make_hf_model: Callable[..., PreTrainedModel]
) -> Callable[..., Path]:
    """Factory: a Hugging Face model directory written by `transformers` (config.json,
    safetensors, optionally sharded with an index, and the tiny tokenizer unless
    tokenizer=False). Returns its path."""

    def make(
        name: str = "qwen3",
        *,
        shard_size: str | None = None,
        tokenizer: bool = True,
        vocab_pad: int = 0,
        dirname: str | None = None,
    ) -> Path:
        out = tmp_path / (dirname or f"hf-{name}")
        model = make_hf_model(name, vocab_pad=vocab_pad)
        model.save_pretrained(out, **({"max_shard_size": shard_size} if shard_size else {}))
        if tokenizer:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        return out

    return make


@pytest.fixture
def model_dir(make_hf_dir: Callable[..., Path], tmp_path: Path) -> Path:
    """A tiny random Qwen3 checkpoint converted by `refusion convert` (MASK added), with
    the tiny tokenizer: what a user's converted model directory looks like."""
    from refusion.io import convert

    out = tmp_path / "rf"
    convert(make_hf_dir("qwen3"), out)
    return out


@pytest.fixture
def tiny_model() -> Transformer:
    """A small random ReFusion `Transformer` built in memory (Qwen3 shape: GQA, q/k norm),
    float32, eval mode. Vocabulary of 64; no tokenizer."""
    model = Transformer(tiny_config())
    randomise_(model, seed=0)
    return model.eval()


def tiny_config(**changes: Any) -> ModelConfig:
    """The tests' small Qwen3-shaped config (GQA, q/k norm; vocabulary of 64, EOS 1), with
    `changes` on top (a MASK id, a smaller vocabulary, a shorter context)."""
    fields: dict[str, Any] = dict(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=256,
        eos_token_id=1,
    )
    return ModelConfig(**(fields | changes))


@pytest.fixture
def within() -> Callable[[int], Any]:
    """`with within(30): ...` fails the block after 30 s (SIGALRM): for a reader that once
    blocked on a FIFO or built a model of a million layers, a failure rather than a suite
    that never ends."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def limit(seconds: int) -> Iterator[None]:
        def expire(*_: Any) -> None:
            raise TimeoutError(f"took more than {seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return limit


@pytest.fixture(autouse=True)
def lone_rows_start_afresh() -> Iterator[None]:
    """Each test's lone rows start without the record of lone drafting blocks that earlier
    tests left on a model they share (`widths.Drafting.lone`): a test written for a row
    alone that drafts its first block would otherwise decode AR blocks after a test whose
    drafts lost. The forward-cost calibration stays shared (it only prices)."""
    from refusion.decode.widths import _DRAFTING, Drafting

    for d in list(_DRAFTING.values()):
        fresh = Drafting()
        d.lone, d.lone_probe = fresh.lone, fresh.lone_probe
    yield
