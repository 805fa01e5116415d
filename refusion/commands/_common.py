"""Arguments shared by the verbs that load a model and decode: one `DecodeConfig` for all."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..decode import PRESETS, DecodeConfig

# DecodeConfig fields exposed as flags (flag name = field name with dashes)
_DECODE_FLAGS: dict[str, tuple[type, str]] = {
    "gen_length": (int, "tokens to generate at most"),
    "slot_size": (int, "ReFusion: tokens per slot"),
    "serial_blocks": (int, "ReFusion: left-to-right blocks of the generation region"),
    "slot_threshold": (float, "ReFusion plan: select slots whose first-token confidence exceeds this"),
    "token_threshold": (float, "ReFusion verify: a drafted token passes above this AR probability"),
    "mdm_block_length": (int, "MDM: tokens per semi-autoregressive block"),
    "mdm_steps": (int, "MDM: denoising steps over gen_length (default: gen_length)"),
    "mdm_threshold": (float, "MDM: fix every position above this confidence instead of top-k"),
    "temperature": (float, "0 = greedy"),
    "top_p": (float, "nucleus sampling"),
    "top_k": (int, "top-k sampling (0 = off)"),
    "seed": (int, "sampling seed"),
    "max_batch_size": (int, "prompts decoded together at most"),
    "memory_budget_gb": (float, "KV-cache memory that bounds the batch size"),
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, help="model directory, hub id or .gguf file (default: the bundled model)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's, if the device runs it)")


def add_decode_arguments(parser: argparse.ArgumentParser, default_method: str = "refusion") -> None:
    g = parser.add_argument_group("decoding")
    g.add_argument("--method", choices=["refusion", "ar", "mdm"], default=None, help=f"default: {default_method}")
    g.add_argument("--preset", choices=PRESETS, default=None, help="the authors' settings for a benchmark")
    for name, (typ, help_text) in _DECODE_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=help_text)
    g.add_argument("--compile", action="store_true", default=None,
                   help="AR and ReFusion: run forwards as one torch.compile graph (a minute or so at first use; needs a C++ compiler on CPU)")
    g.add_argument("--eos-id", type=int, default=None, help="override the tokenizer's EOS id")
    g.add_argument("--mask-id", type=int, default=None, help="override the model's MASK id")
    parser.set_defaults(_default_method=default_method)


def decode_config_from_args(args: argparse.Namespace, base: DecodeConfig | None = None) -> DecodeConfig:
    """Preset (or `base`, or the defaults), then every flag the user gave on top."""
    if args.preset:
        cfg = DecodeConfig.preset(args.preset)
    else:
        cfg = base or DecodeConfig(method=args._default_method)
    changes: dict[str, Any] = {k: getattr(args, k) for k in _DECODE_FLAGS if getattr(args, k) is not None}
    if args.method:
        changes["method"] = args.method
    for k in ("eos_id", "mask_id", "compile"):
        if getattr(args, k) is not None:
            changes[k] = getattr(args, k)
    return dataclasses.replace(cfg, **changes)


def load_from_args(args: argparse.Namespace):
    from ..checkpoint import load

    return load(args.model, device=args.device, dtype=args.dtype)
