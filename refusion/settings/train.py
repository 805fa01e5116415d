"""`TrainConfig`: everything a training run needs, one dataclass for `refusion train`
(every field is a flag, its help the comment beside it) and `train(TrainConfig(...))`.
It imports no torch, so the CLI can build its flags without loading it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import ConfigError, DataError
from ..files import check_regular

OBJECTIVES = ("refusion", "ar")
PRECISIONS = ("auto", "no", "bf16", "fp16")
DTYPE_NAMES = ("float32", "bfloat16")
AR_REDUCTIONS = ("token", "example")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# what to do about a data file that cannot be read
DATA_FIX = "give --data (or --eval-data) a regular .json or .jsonl file of records"


@dataclass
class TrainConfig:
    """Everything a training run needs. Every field is also a `refusion train` flag."""

    # ---- what to train, on what, where to
    data: str = ""  # training data: JSON list or JSONL of {"query","response"} or {"messages"}
    out: str = ""  # output directory (a Hugging Face model directory at the end)
    model: str | None = None  # base checkpoint: local HF dir, hub id or .gguf
    init_config: str | None = None  # instead of `model`: a config.json to initialise randomly
    tokenizer: str | None = None  # tokenizer directory (required with init_config; overrides the model's)
    add_mask_token: bool = False  # add <|mask|> to a base model that lacks it (as `refusion convert`)
    dtype: str = "float32"  # weights dtype: float32, or bfloat16 (halves memory; sensible with LoRA)
    # ---- objective
    objective: str = "refusion"  # refusion (slot reorganisation + hybrid AR/MDM loss) or ar (next-token)
    slot_sizes: tuple[int, ...] = (4, 8, 16, 32)  # slot size drawn per example
    mask_eps: float = 1e-3  # p = (1 - eps) * t + eps
    ar_reduction: str = "token"  # AR CE averaged over all labels ("token") or per example ("example")
    boundary_labels: bool = False  # beyond the paper: AR labels on clean slots' and the prompt's last tokens
    ar_mix: float = 0.0  # beyond the paper: share of examples trained as plain AR (keeps the AR head's skill)
    frontier_mix: float = 0.0  # beyond the paper: share of examples masking one slot after a clean prefix
    max_length: int = 2048  # longer examples (prompt + response + EOS) are skipped and counted
    # ---- optimisation
    batch_size: int = 8  # examples per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 0  # optimizer steps; 0 = derive from epochs
    epochs: float = 1.0  # passes over the training split when max_steps is 0
    lr: float = 1e-5  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # linear warmup steps; None = warmup_ratio of the total
    warmup_ratio: float = 0.03  # warmup as a fraction of the total steps, when warmup_steps is None
    weight_decay: float = 0.0  # AdamW decay on matrices (never on norms, biases)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping; 0 = off
    cpu: bool = False  # train on the CPU even where a GPU is available
    precision: str = "auto"  # auto (bf16 where the GPU supports it, else none), no, bf16, fp16
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    # ---- LoRA (needs peft); the adapters are merged into the saved weights
    lora: bool = False  # train LoRA adapters instead of all weights (merged into the saved model)
    lora_r: int = 16  # LoRA rank
    lora_alpha: float = 32.0  # LoRA scale numerator: the update is (alpha / r) * B @ A
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_targets: tuple[str, ...] = LORA_TARGETS  # linear layers that get adapters
    # ---- evaluation, logging, checkpoints
    eval_data: str | None = None  # held-out file; None = split eval_fraction off the training data
    eval_fraction: float = 0.02  # share of the training data held out for evaluation
    eval_max_examples: int = 256  # at most this many held-out examples
    eval_every: int = 200  # steps between evaluations (and one at the end); 0 = only at the end
    log_every: int = 10  # steps between log records
    save_every: int = 500  # steps between checkpoints (and one at the end); 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept; 0 = keep all
    resume: bool = False  # continue from the latest checkpoint in out/checkpoints
    allow_config_change: bool = False  # with resume: accept settings unlike the run's (listed when refused)
    seed: int = 0  # seeds initialisation, data order, the eval split and the objective's draws
    tensorboard: bool = True  # also log to out/tensorboard when tensorboard is installed
    progress: bool = True  # tqdm progress bar on the main process

    def __post_init__(self) -> None:
        self.slot_sizes = tuple(int(s) for s in self.slot_sizes)
        self.lora_targets = tuple(self.lora_targets)

    def validate(self, flags: bool = False) -> None:
        """Raise ConfigError / DataError on the first bad setting. The messages name the
        settings as arguments (`model=...`), or with `flags` as the `refusion train` flags
        (`--model ...`), so that each reader is told what they can change."""
        say = _flag if flags else _argument
        if not self.data:
            raise ConfigError(f"no training data given ({say('data', 'FILE')})")
        if not self.out:
            raise ConfigError(f"no output directory given ({say('out', 'DIR')})")
        if (self.model is None) == (self.init_config is None):
            raise ConfigError(
                f"give exactly one of {say('model', 'BASE')} or {say('init_config', 'config.json')}: "
                "a base model to train on, or a model config to initialise randomly"
            )
        if self.init_config is not None and self.tokenizer is None:
            raise ConfigError(
                f"training from {say('init_config')} needs a tokenizer directory ({say('tokenizer', 'DIR')})"
            )
        checks = [
            (self.objective in OBJECTIVES, f"{say('objective')} must be one of {OBJECTIVES}"),
            (self.precision in PRECISIONS, f"{say('precision')} must be one of {PRECISIONS}"),
            (self.dtype in DTYPE_NAMES, f"{say('dtype')} must be one of {DTYPE_NAMES}"),
            (
                self.batch_size >= 1 and self.grad_accum >= 1,
                f"{say('batch_size')} and {say('grad_accum')} must be >= 1",
            ),
            (self.max_length >= 2, f"{say('max_length')} must be >= 2"),
            (
                self.max_steps >= 0 and self.epochs > 0,
                f"{say('max_steps')} must be >= 0 and {say('epochs')} > 0",
            ),
            (
                self.lr > 0 and 0 <= self.min_lr_ratio <= 1,
                f"need {say('lr')} > 0 and 0 <= {say('min_lr_ratio')} <= 1",
            ),
            (0 <= self.eval_fraction < 1, f"{say('eval_fraction')} must lie in [0, 1)"),
            (self.log_every >= 1, f"{say('log_every')} must be >= 1"),
            (
                self.eval_every >= 0 and self.save_every >= 0,
                f"{say('eval_every')} and {say('save_every')} must be >= 0",
            ),
            (self.lora_r >= 1, f"{say('lora_r')} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.objective_config()  # validates slot sizes, eps, ar_reduction
        for path in (self.data, self.eval_data):  # before any model is loaded
            if path:
                check_regular(path, DataError, fix=DATA_FIX)

    def objective_config(self) -> ObjectiveConfig:
        """The objective's settings (validated)."""
        return ObjectiveConfig(
            self.slot_sizes,
            self.mask_eps,
            self.ar_reduction,
            self.boundary_labels,
            self.ar_mix,
            self.frontier_mix,
        )


def config_fields() -> list:
    """The fields of TrainConfig, for the CLI."""
    return list(fields(TrainConfig))


def flag_name(name: str) -> str:
    """The `refusion train` flag of a TrainConfig field: max_length -> --max-length."""
    return "--" + name.replace("_", "-")


def _flag(name: str, metavar: str = "") -> str:
    return f"{flag_name(name)} {metavar}".rstrip()


def _argument(name: str, metavar: str = "") -> str:
    return f"{name}={metavar}" if metavar else name


@dataclass(frozen=True)
class ObjectiveConfig:
    """Hyperparameters of the ReFusion objective."""

    slot_sizes: tuple[int, ...] = (4, 8, 16, 32)  # slot size drawn uniformly per example
    eps: float = 1e-3  # mask probability p = (1 - eps) * t + eps, t ~ U(0, 1)
    # How the AR cross-entropy is averaged: "token" = mean over every AR label of the batch
    # (docs/algorithm.md#loss read literally); "example" = mean per example, then over the batch, which makes
    # the batch loss exactly the mean of the per-example losses.
    ar_reduction: str = "token"
    # Beyond the paper: also label the last token of each clean slot with the response token
    # after it (true position + 1, whatever is fed next), and the prompt's last token with the
    # first response token, so that the AR head is trained across slot boundaries: what a
    # decoder that checks a slot's first token against its left neighbour's prediction reads.
    boundary_labels: bool = False
    # Beyond the paper: this share of the examples is trained as plain next-token prediction
    # (every slot clean, in order, labelled across slot boundaries), which keeps the AR
    # head's left-to-right skill that ReFusion's verification and AR correction rely on.
    ar_mix: float = 0.0
    # Beyond the paper: this share of the examples (none of them ar_mix's) keeps the response
    # clean and in order up to one slot drawn uniformly, masks that slot and cuts the response
    # after it. That is what every draft of lossless decoding sees (the whole text to its left,
    # nothing to its right), while the paper's random masks mostly show later text as well.
    frontier_mix: float = 0.0

    def __post_init__(self) -> None:
        if not self.slot_sizes or any(int(s) < 1 for s in self.slot_sizes):
            raise ConfigError(f"slot sizes must be positive integers, got {self.slot_sizes}")
        if not 0.0 < self.eps <= 1.0:
            raise ConfigError(f"eps must lie in (0, 1], got {self.eps}")
        if not 0.0 <= self.ar_mix <= 1.0:
            raise ConfigError(f"ar_mix must lie in [0, 1], got {self.ar_mix}")
        if not 0.0 <= self.frontier_mix <= 1.0 - self.ar_mix:
            raise ConfigError(
                f"frontier_mix must lie in [0, 1 - ar_mix] = [0, {1.0 - self.ar_mix:g}], got "
                f"{self.frontier_mix} (the two shares are of the same examples)"
            )
        if self.ar_reduction not in AR_REDUCTIONS:
            raise ConfigError(f"ar_reduction must be one of {AR_REDUCTIONS}, got {self.ar_reduction!r}")

    def max_slots(self, seq_len: int) -> int:
        """Slots a response of up to `seq_len` tokens can need with the smallest slot size."""
        return max(1, math.ceil(seq_len / min(self.slot_sizes)))
