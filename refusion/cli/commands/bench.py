"""`refusion bench <what>`: dispatch to `refusion/bench/<what>.py`, imported only when it runs."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "decode": "AR vs ReFusion vs MDM on the same prompts, with a batch-size sweep",
    "train": "training tokens/s: ReFusion objective vs plain next-token training",
    "speed": "forward and AR decode against the machine's floors and transformers, side by side",
    "suite": "Table 1 and Figure 1 on the held-out suite: accuracy, tokens/s, TPF, NFE, AUP",
    "curve": (
        "a training run's learning curve: held-out accuracy and TPF of ReFusion decoding, "
        "and the losses, per checkpoint"
    ),
    "diagnose": (
        "where a setting's answers part from greedy AR decoding of the same weights, and which "
        "code path of the decoder committed the first differing token"
    ),
    "served": (
        "the server at one client (adaptive draft widths) against the engine with fixed widths, "
        "the same prompts interleaved: forwards and tokens/s"
    ),
    "load": "load a random Qwen3-8B-shaped checkpoint (bf16, sharded): time and peak memory, TP=1 and TP=2",
}


def add_arguments(parser: argparse.ArgumentParser, chosen: str | None = None) -> None:
    """Every benchmark's name; the flags of `chosen` only (its module loads torch)."""
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, help_text in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(f"refusion.bench.{name}").add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(f"refusion.bench.{args.bench}").run(args)
