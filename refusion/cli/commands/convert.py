"""`refusion convert BASE OUT`: prepare an AR checkpoint for ReFusion training by adding `<|mask|>`
(with --quantize, its linear layers' weights saved quantized)."""

from __future__ import annotations

import argparse

from ...settings.model import DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", help="the AR model: directory, hub id or .gguf file")
    parser.add_argument("out", help="directory to write the ReFusion checkpoint to")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_NAMES],
        help="dtype to save in (default: the base model's)",
    )
    parser.add_argument("--device", default="cpu", help="device to load the model on (default: cpu)")
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="save the linear layers' weights quantized (torchao, weight only; int4 packed for --device, "
        "bfloat16): the saved model loads without quantizing again",
    )


def run(args: argparse.Namespace) -> int:
    from ...io import convert, load_metadata

    had_mask = load_metadata(args.base)[0].mask_token_id is not None
    mask_id = convert(
        args.base,
        args.out,
        device=args.device,
        dtype=args.dtype,
        overwrite=args.force,
        quantize=args.quantize,
    )
    quantized = f", {args.quantize} weights" if args.quantize else ""
    print(f"wrote {args.out} (MASK token <|mask|> = id {mask_id}{quantized})")
    if had_mask:
        print(
            "The base already had <|mask|>: its weights are copied as they are. If it was trained with "
            "ReFusion it decodes with ReFusion at once; if not, train it first: "
            f"refusion train --model {args.out} ..."
        )
    else:
        print(
            "It decodes as it is with --method ar. ReFusion and MDM decoding need ReFusion training first: "
            f"refusion train --model {args.out} --data FILE --out RUN"
        )
    return 0
