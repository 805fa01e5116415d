"""`refusion info [MODEL]`: what a checkpoint is, read from its config and tokenizer.

No weight is read, but the weight files' headers are checked as `refusion.load` checks
them (sizes, tensor names and shapes against the config), so a checkpoint that would not
load is an error here too, not a description."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ...settings.decode import DecodeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, hub id, .gguf file, bundled:NAME or package:MODULE/PATH "
        "(default: the bundled model)",
    )
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    memory = parser.add_argument_group("memory per device (with --batch-size and --context)")
    memory.add_argument("--batch-size", type=int, default=None, help="requests decoded together")
    memory.add_argument(
        "--context", type=int, default=None, help="positions per request (prompt + generation)"
    )
    # its own dest: here the flag sizes a split, it does not launch one
    memory.add_argument(
        "--tensor-parallel-size",
        dest="split",
        type=int,
        default=1,
        help="devices the model is split over (default 1)",
    )
    memory.add_argument("--dtype", default=None, help="weights and cache dtype (default: the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    from ...io import describe

    info = describe(args.model)
    if (args.batch_size is None) != (args.context is None):
        from ...errors import ConfigError

        raise ConfigError("give --batch-size and --context together (e.g. --batch-size 8 --context 4096)")
    if args.batch_size is not None:
        info["memory"] = _memory(args, info)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _memory(args: argparse.Namespace, info: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan for AR requests and for ReFusion requests with the checkpoint's settings,
    by the rule the engine admits and allocates with (`model.sizing`)."""
    from ...decode.methods import method_of
    from ...errors import ConfigError
    from ...io import DTYPES, load_metadata
    from ...model.sizing import memory_plan
    from ...parallel import check_divisible

    if args.batch_size < 1 or args.context < 1 or args.split < 1:
        raise ConfigError("--batch-size, --context and --tensor-parallel-size take positive numbers")
    config, _ = load_metadata(args.model)
    check_divisible(config, args.split)
    name = args.dtype or str(info["dtype"] or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    cfg = DecodeConfig(**((info.get("recommended") or {}).get("decode") or {}))
    plans = []
    ar, refusion = cfg.replace(method="ar"), cfg.replace(method="refusion")
    for label, c in (("ar", ar), (f"refusion ({refusion.slots_per_block} slots per block)", refusion)):
        need = method_of(c).cache_need(c, 0)
        plan = memory_plan(config, DTYPES[name], args.batch_size, args.context, need, args.split)
        if info.get("quantization"):  # the weights as stored, not as the config's dtype would hold them
            plan["weights_bytes"] = sum(info["weight_bytes"].values())
            plan["total_bytes"] = plan["weights_bytes"] + plan["kv_cache_bytes"]
        plans.append({"decoding": label, **plan})
    return plans


def format_info(info: dict[str, Any]) -> str:
    """Aligned `label  value` lines for a person to read."""
    rows = _architecture_rows(info) + _weight_rows(info) + _decoding_rows(info) + _memory_rows(info)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _architecture_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    mask = info["mask_token_id"]
    tokenizer = "no tokenizer" if info["tokenizer_size"] is None else f"tokenizer: {info['tokenizer_size']}"
    return [
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


def _weight_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The weights' bytes, and how they were quantized, where the info says."""
    rows: list[tuple[str, Any]] = []
    if info.get("weight_bytes"):
        from ...io.quantize import describe_bytes

        rows.append(("weights", describe_bytes(info["weight_bytes"])))
    q = info.get("quantization")
    if q:
        left = f", {len(q['unquantized'])} layers left in {q['dtype']}" if q.get("unquantized") else ""
        rows.append(
            (
                "quantized",
                f"{q['scheme']} weights of the blocks' linear layers ({q['library']} {q['version']}, "
                f"packed for {q['packed_for']}, {q['dtype']} activations{left})",
            )
        )
    return rows


def _decoding_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """What the checkpoint's decode_config.json recommends and says about the model."""
    rec = info.get("recommended") or {}
    decode = rec.get("decode")
    rows: list[tuple[str, Any]] = [
        (
            "decoding",
            ", ".join(f"{k}={v}" for k, v in decode.items())
            if decode
            else "no decode_config.json: DecodeConfig's defaults",
        )
    ]
    rows.append(("lossless", lossless_text(DecodeConfig(**(decode or {})))))
    if rec.get("about"):
        rows.append(("about", rec["about"]))
    if rec.get("single_turn"):
        rows.append(("chat", "single turns only (`refusion chat` keeps no history)"))
    if rec.get("chat_only"):
        rows.append(("prompts", "through its chat template only (raw text completions give noise)"))
    if rec.get("examples"):
        rows.append(("examples", f"{len(rec['examples'])} prompts: `refusion generate --examples`"))
    return rows


def lossless_text(cfg: DecodeConfig) -> str:
    """Whether settings decode what AR decoding of the same weights does (`DecodeConfig.lossless`)."""
    if cfg.lossless == "any temperature":
        return (
            "yes, at any temperature: greedy token for token, sampled in distribution (speculative sampling)"
        )
    if cfg.lossless == "temperature 0":
        return "greedy only: token for token at temperature 0; sampled, not exact"
    return "no (lossless: ar_correction, first_token_check, token_threshold >= 0.5, one slot per block)"


def _memory_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """Memory per device of each planned way of decoding."""
    return [
        (
            f"memory, {plan['decoding']}",
            f"{_size(plan['total_bytes'])} per device = weights {_size(plan['weights_bytes'])} "
            f"+ KV cache {_size(plan['kv_cache_bytes'])} "
            f"({plan['batch_size']} requests x {plan['context']} positions, "
            f"{plan['cache_rows']} cache rows of {plan['row_capacity']} entries, {plan['dtype']}, "
            f"tensor-parallel size {plan['tensor_parallel_size']})",
        )
        for plan in info.get("memory") or []
    ]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
