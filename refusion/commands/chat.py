"""`refusion chat [MODEL]`: an interactive chat that streams each reply as it becomes final."""

from __future__ import annotations

import argparse
import sys

from ..flags import add_decode_arguments, add_model_arguments, decode_config_from_args, engine_config_from_args, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default: the bundled model)")
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--stats", action="store_true", help="print NFE, TPF and TPS after each reply")
    add_decode_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..decode import Engine
    from ..prompts import chat_ids

    args.model = args.model or args.model_pos
    cfg = decode_config_from_args(args)
    model, tokenizer = load_from_args(args)
    engine = Engine(model, tokenizer, engine_config_from_args(args))
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
        ids = chat_ids(tokenizer, history)
        # the reply gets what the context leaves after the conversation so far
        engine.add_request(ids, cfg.fit(model.config.max_position_embeddings - len(ids)))
        out = None
        while engine.has_unfinished():
            for out in engine.step():
                print(out.delta, end="", flush=True)
        print()
        if args.stats:
            s = out.stats
            print(f"[{cfg.method}] tokens={s.tokens} nfe={s.nfe} tpf={s.tpf:.2f} tps={s.tps:.1f}", file=sys.stderr)
        history.append({"role": "assistant", "content": out.text})
    return 0
