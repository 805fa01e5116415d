"""Write task data and the tokenizer from the command line.

python -m refusion.tasks data train 100000 train.jsonl [--seed 0] [--fmt query]
python -m refusion.tasks data test 600 test.jsonl       # the fixed held-out set
python -m refusion.tasks tokenizer out_dir [--vocab-size 1024]
"""

from __future__ import annotations

import argparse

from .splits import TEST_SEED, load_test_items, make_split, write_jsonl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m refusion.tasks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    data = sub.add_parser("data", help="write a split as JSONL")
    data.add_argument("split", choices=("train", "test"))
    data.add_argument("n", type=int)
    data.add_argument("out")
    data.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"default: 0 for train; the fixed held-out set ({TEST_SEED}) for test",
    )
    data.add_argument("--fmt", choices=("messages", "query"), default="messages")
    tok = sub.add_parser("tokenizer", help="train the default tokenizer and save it")
    tok.add_argument("out_dir")
    tok.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)

    if args.cmd == "data":
        if args.split == "test" and args.seed is None:
            items = load_test_items(args.n)
            if len(items) < args.n:
                items = make_split("test", args.n, seed=TEST_SEED)
        else:
            items = make_split(args.split, args.n, seed=args.seed or 0)
        # test data carries answers so that it can be checked after reloading
        path = write_jsonl(items, args.out, fmt=args.fmt, with_answer=args.split == "test")
        print(f"wrote {len(items)} {args.split} items to {path}")
    else:
        from .tokenizer import build_default_tokenizer

        t = build_default_tokenizer(args.out_dir, vocab_size=args.vocab_size)
        print(f"saved tokenizer ({len(t)} tokens) to {args.out_dir}")


if __name__ == "__main__":
    main()
