"""`refusion bench speed [MODEL]`: how far our forward and AR decode are from the machine
and from `transformers`, side by side in one run.

Four sections, every figure a median over interleaved rounds (the machine is shared, so
what is compared is measured in the same minute):

  a. the machine's floors on the model's device: copy bandwidth (GB/s) and the matmul rate
     (GFLOP/s) in the model's dtype;
  b. ms per forward of 1 and s tokens on a cache of `--cache-len` entries, ours against the
     floor max(bytes / bandwidth, flops / matmul rate) and against transformers' forward
     with a DynamicCache of the same length (both built from the same weights);
  c. greedy AR decode tokens/s, batch 1, a fixed number of new tokens (EOS ignored on both
     sides), ours against transformers' `generate`, with a token-for-token check;
  d. ReFusion against our AR on a few suite prompts, when the model has a MASK token.

MODEL is anything `refusion.load` takes, or `random:NAME` (a randomly initialised model of
one of RANDOM_SHAPES, for speed only). `--compile` adds the compiled forward
(`decode.forward.CompiledStep`) to sections b and c: its forwards against the same floors,
and its AR decode against `generate`, with its tokens checked against our eager decode.
`--quantized` adds section e.

This module is the command and the models it measures; the floors are `floors.py`, the
timed sections `speed_sections.py` (e: `speed_quantized.py`), the report `speed_report.py`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..cli.flags import add_decode_arguments, add_model_arguments
from ..model.prompts import encode_prompt
from ..model.transformer import Transformer
from ..settings.model import ModelConfig
from .decode import bench_prompts, quantized_models
from .floors import MachineProbe
from .results import add_results_argument, writes_results
from .speed_quantized import quantized_section
from .speed_report import print_report, targets
from .speed_sections import ar_section, forward_section, refusion_section

# Shapes of randomly initialised models (`random:NAME`): speed does not depend on the values.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # the real Qwen3-0.6B config, plus a MASK token just past Qwen3's 151669 tokenizer ids
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        mask_token_id=151669,
    ),
    # the same family scaled down until a CPU runs the whole GPU check in minutes
    "small": dict(
        model_type="qwen3",
        vocab_size=32768,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        mask_token_id=32767,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help=f"as --model, or random:{{{','.join(RANDOM_SHAPES)}}}"
    )
    add_model_arguments(parser)
    add_decode_arguments(parser)
    g = parser.add_argument_group("speed")
    g.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds of sections a and b; medians are reported"
    )
    g.add_argument("--decode-rounds", type=int, default=3, help="interleaved rounds of sections c and d")
    g.add_argument("--cache-len", type=int, default=200, help="cache entries before each timed forward")
    g.add_argument("--sizes", default="1,4,8,16,32", help="tokens per timed forward")
    g.add_argument(
        "--new-tokens", type=int, default=64, help="AR decode: tokens generated per run (EOS ignored)"
    )
    g.add_argument(
        "--prompts", type=int, default=4, help="ReFusion vs AR: how many suite prompts (default: 4)"
    )
    g.add_argument(
        "--sample-ms", type=float, default=25.0, help="a timed sample repeats the call for about this long"
    )
    g.add_argument(
        "--bw-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth floor (default 256 on cpu, 2048 on cuda)",
    )
    g.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="square matmul size for the rate floor (default 1024 cpu, 8192 cuda)",
    )
    g.add_argument(
        "--hf",
        choices=["auto", "off"],
        default="auto",
        help="compare with transformers (auto: when it is installed)",
    )
    g.add_argument(
        "--quantized",
        default="",
        metavar="SCHEMES",
        help="section e: the model quantized with each scheme (comma-separated: int8,int4), its forwards and "
        "AR decode interleaved with the unquantized model's, and each one's peak memory in a fresh process",
    )
    g.add_argument("--json", dest="json_out", default=None, help="also write every figure to this JSON file")
    add_results_argument(parser, "speed.md")


def random_model(
    name: str, device: str | torch.device, dtype: torch.dtype | None = None, seed: int = 0
) -> Transformer:
    """A randomly initialised model of RANDOM_SHAPES[name], built directly on the device
    (a 0.6B model initialised on a CPU first would take longer than the benchmark).
    Matrices are drawn as transformers initialises them (normal, std 0.02): near-uniform
    next-token distributions, so no decoder finds a shortcut that trained weights lack."""
    if name not in RANDOM_SHAPES:
        raise SystemExit(f"unknown random shape {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device), torch.no_grad():
        model = Transformer(ModelConfig(**RANDOM_SHAPES[name]))
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def load_model(
    spec: str | None, device: str, dtype: str | None, allow_nonfinite: bool = False
) -> tuple[Transformer, Any]:
    """(model, tokenizer) for a checkpoint path / hub id / None (bundled), or `random:NAME`
    (tokenizer None: prompts then come from the bundled tokenizer's ids)."""
    if spec and spec.startswith("random:"):
        from ..io import parse_dtype

        return random_model(spec.split(":", 1)[1], device, parse_dtype(dtype, torch.device(device))), None
    from ..io import load

    return load(spec, device=device, dtype=dtype, allow_nonfinite=allow_nonfinite)


def hf_twin(model: Transformer) -> Any:
    """The same weights in a `transformers` model (sdpa attention), or None when transformers
    is not installed. Built from our config and state dict, so one load serves both sides
    (a GGUF de-quantisation takes tens of seconds). EOS is removed from its generation
    config so that `generate` runs exactly the requested number of tokens, as ours does."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    config = AutoConfig.for_model(**model.config.to_hf_dict())
    with torch.device(model.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"transformers twin does not match our weights: missing {missing}, unexpected {unexpected}"
        )
    hf.config.eos_token_id = None
    hf.generation_config.eos_token_id = None
    return hf.eval()


def suite_prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """Chat-templated ids of n suite prompts; a model without a tokenizer borrows the
    bundled one (its ids are small, so they are valid in any larger vocabulary)."""
    if tokenizer is None:
        from ..io import load_metadata

        tokenizer = load_metadata(None)[1]
    return [encode_prompt(tokenizer, p) for p in bench_prompts(n)]


@writes_results
def run(args: argparse.Namespace) -> int:
    spec = args.model or args.model_pos
    model, tokenizer = load_model(spec, args.device, args.dtype, args.allow_nonfinite_weights)
    hf = hf_twin(model) if args.hf == "auto" else None
    dev = model.device
    bw_mib = args.bw_mib or (2048 if dev.type == "cuda" else 256)
    matmul_n = args.matmul_n or (8192 if dev.type == "cuda" else 1024)
    probe = MachineProbe(dev, model.dtype, bw_mib, matmul_n)
    prompts = suite_prompt_ids(tokenizer, max(1, args.prompts))
    fig: dict[str, Any] = {
        "model": spec or "bundled",
        "device": str(dev),
        "dtype": str(model.dtype).removeprefix("torch."),
        "parameters": model.num_parameters(),
        "threads": torch.get_num_threads(),
        "settings": {
            k: getattr(args, k)
            for k in ("repeats", "decode_rounds", "cache_len", "sizes", "new_tokens", "prompts")
        }
        | {"bw_mib": bw_mib, "matmul_n": matmul_n},
    }
    quantized = {k: m for k, m in quantized_models(model, args.quantized).items() if k is not None}
    fig |= forward_section(model, hf, probe, args, quantized)
    fig["ar_decode"] = ar_section(model, hf, prompts[0], args, quantized)
    if quantized:
        fig["quantized"] = quantized_section(fig, model, tokenizer, quantized, prompts[0], args)
    fig["refusion"] = refusion_section(model, tokenizer, prompts, args)
    fig["targets"] = targets(fig)
    print_report(fig)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(fig, f, indent=2)
    return 0
