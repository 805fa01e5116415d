"""A small byte-level BPE tokenizer for models trained on the task suite.

Same recipe as Qwen2/Qwen3's tokenizer, scaled down: Qwen's pre-tokenizer
regex (every digit its own token, so a small model can learn carrying),
byte-level BPE (any text encodes, Python indentation included, and
``decode(encode(x)) == x`` exactly), no BOS, and the ChatML template.

Special tokens:

- ``<|im_end|>`` is the EOS token: the chat template closes every turn with
  it, so an assistant response followed by EOS is exactly what the template
  renders for that turn (training appends EOS to responses; decoding stops
  at it).
- ``<|endoftext|>`` is the padding token (and ends documents, if ever used).
- ``<|im_start|>`` opens a turn.
- ``<|mask|>`` is ReFusion's MASK token (``tokenizer.mask_token``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN]  # ids 0..3 in this order

# Qwen2/Qwen3's pre-tokenizer pattern: \p{N} alone splits digits one by one.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen uses it (without tools or thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 1024
DEFAULT_N_TEXTS = 20_000  # training items whose prompts and responses train BPE
MODEL_MAX_LENGTH = 512  # the bundled config's max_position_embeddings (scripts/train_bundled.sh)


def _bare_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, out_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts``; wrap it for ``transformers`` with the
    special tokens and chat template above; save it to ``out_dir`` (loadable
    offline with ``AutoTokenizer.from_pretrained(out_dir)``) when given."""
    tok = _bare_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


def task_texts(n: int = DEFAULT_N_TEXTS, seed: int = 0) -> list[str]:
    """The tokenizer's corpus: prompts and responses of ``n`` training items,
    each after its role line, as the chat template lays them out between
    special tokens (BPE training would merge across raw special tokens)."""
    from .splits import make_split

    texts = []
    for item in make_split("train", n, seed=seed):
        texts += [f"user\n{item.prompt}", f"assistant\n{item.response}"]
    return texts


def build_default_tokenizer(
    out_dir: str | Path | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE, n_texts: int = DEFAULT_N_TEXTS
) -> PreTrainedTokenizerFast:
    """The tokenizer for the bundled model, in one call."""
    return train_tokenizer(task_texts(n_texts), vocab_size, out_dir)
