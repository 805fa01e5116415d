"""`refusion info [MODEL]`: what a checkpoint is, read from its config and tokenizer.

No weight is read, but the weight files' headers are checked as `refusion.load` checks
them (sizes, tensor names and shapes against the config), so a checkpoint that would not
load is an error here too, not a description."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="model directory, hub id or .gguf file (default: the bundled model)"
    )
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import describe

    info = describe(args.model)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def format_info(info: dict[str, Any]) -> str:
    """Aligned `label  value` lines for a person to read."""
    mask = info["mask_token_id"]
    tokenizer = "no tokenizer" if info["tokenizer_size"] is None else f"tokenizer: {info['tokenizer_size']}"
    rows = [
        ("model", info["path"]),
        ("architecture", f"{info['architecture']} ({info['model_type']})"),
        ("parameters", f"{info['parameters']:,}"),
        ("vocab size", f"{info['vocab_size']} ({tokenizer})"),
        ("context length", info["context_length"]),
        ("MASK id", "none (run `refusion convert`)" if mask is None else mask),
        ("dtype", info["dtype"] or "unspecified"),
        ("layers", info["num_hidden_layers"]),
        ("hidden size", info["hidden_size"]),
        ("heads", f"{info['num_attention_heads']} query, {info['num_key_value_heads']} key/value"),
        ("head dim", info["head_dim"]),
        ("tied embeddings", "yes" if info["tie_word_embeddings"] else "no"),
    ]
    rec = info.get("recommended") or {}
    decode = rec.get("decode")
    rows.append(("decoding", ", ".join(f"{k}={v}" for k, v in decode.items()) if decode
                 else "no decode_config.json: DecodeConfig's defaults"))
    if rec.get("about"):
        rows.append(("about", rec["about"]))
    if rec.get("single_turn"):
        rows.append(("chat", "single turns only (`refusion chat` keeps no history)"))
    if rec.get("examples"):
        rows.append(("examples", f"{len(rec['examples'])} prompts: `refusion generate --examples`"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
