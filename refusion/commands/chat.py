"""`refusion chat [MODEL]`: an interactive chat that streams each reply as it becomes final."""

from __future__ import annotations

import argparse
import sys

from ..decode import TextDeltas, generate
from ._common import add_decode_arguments, add_model_arguments, decode_config_from_args, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default: the bundled model)")
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--stats", action="store_true", help="print NFE, TPF and TPS after each reply")
    add_decode_arguments(parser)


def run(args: argparse.Namespace) -> int:
    args.model = args.model or args.model_pos
    cfg = decode_config_from_args(args)
    model, tokenizer = load_from_args(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("refusion chat: an empty line or Ctrl-D ends the session.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        history.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(ids, add_special_tokens=False)["input_ids"])
        deltas = TextDeltas(tokenizer)
        out = generate(model, tokenizer, [ids], cfg, on_prefix=lambda _i, p, done: print(deltas.update(p, final=done), end="", flush=True))[0]
        print()
        if args.stats:
            s = out.stats
            print(f"[{cfg.method}] tokens={s.tokens} nfe={s.nfe} tpf={s.tpf:.2f} tps={s.tps:.1f}", file=sys.stderr)
        history.append({"role": "assistant", "content": out.text})
    return 0
