"""`refusion distill MODEL --out FILE`: training data made by the model itself, its own
greedy AR answers to prompts from files, the synthetic suite and its own requests
(`train/distill.py`); resumable, with a progress bar."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..flags import add_model_arguments

EPILOG = (
    "Run again with the same flags to go on where a stopped run ended: prompts already "
    "answered in --out are skipped. Then: refusion train --model CONVERTED --data FILE --out RUN"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="the model that answers (an AR or ReFusion checkpoint)"
    )
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="JSONL file the answers are appended to")
    parser.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE",
        help="a JSON or JSONL file of training records ({query} or {messages}): their prompts (repeatable)",
    )
    parser.add_argument("--suite", type=int, default=0, metavar="N", help="N prompts of the synthetic suite")
    parser.add_argument(
        "--self",
        dest="self_prompts",
        type=int,
        default=0,
        metavar="N",
        help="N requests the model writes itself from the opening of a user turn (sampled; "
        "duplicates dropped)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="an answer cut here is dropped (default: 256)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default: 16)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the suite, the model's requests and the order"
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ...errors import ConfigError
    from ...train.distill import DistillStats, distill, file_prompts, self_prompts, shuffled, unique
    from ..flags import load_from_args

    if not (args.prompts or args.suite or args.self_prompts):
        raise ConfigError("no prompts: give --prompts FILE, --suite N or --self N (or several)")
    prompts = [p for path in args.prompts for p in file_prompts(path)]
    if args.suite:
        prompts += _suite(args.suite, args.seed)
    args.model = args.model or args.model_pos
    model, tokenizer = load_from_args(args)
    if args.self_prompts:
        print(f"writing {args.self_prompts} requests with the model itself ...", flush=True)
        prompts += self_prompts(model, tokenizer, args.self_prompts, args.seed)
    prompts = shuffled(unique(prompts), args.seed)
    bar = tqdm(total=len(prompts), unit="prompt", desc="distill")

    def advance(s: DistillStats) -> None:
        bar.total = s.todo  # the prompts left once those answered before and those too long are out
        bar.update(1)
        bar.set_postfix(kept=s.answered, cut=s.cut)

    stats = distill(
        model,
        tokenizer,
        prompts,
        Path(args.out),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        on_answer=advance,
    )
    bar.close()
    sources = ", ".join(f"{k} {v}" for k, v in sorted(stats.by_source.items()))
    print(
        f"{args.out}: {stats.answered} answers added ({sources or 'none'}), "
        f"{stats.done_before} there before; "
        f"{stats.too_long} too long for the context skipped; "
        f"{stats.cut} cut at --max-new-tokens {args.max_new_tokens} and {stats.empty} empty dropped; "
        f"{stats.tokens} tokens in {stats.nfe} forwards"
    )
    return 0


def _suite(n: int, seed: int):
    from ...tasks import make_split
    from ...train.distill import Prompt

    return [Prompt(it.prompt, "suite") for it in make_split("train", n, seed=seed)]
