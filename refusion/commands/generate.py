"""`refusion generate [MODEL] "prompt" ...`: decode prompts and print the text (or JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..flags import add_decode_arguments, add_model_arguments, decode_config_from_args, engine_config_from_args, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="[MODEL] PROMPT", help="prompts; with two or more, the first is the model")
    add_model_arguments(parser)
    parser.add_argument("--prompt-file", type=Path, help="one prompt per line ('-' for stdin), decoded as one batch")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print text and stats as JSON (one object per prompt)")
    parser.add_argument("--stats", action="store_true", help="print tokens, NFE, TPF, wall time and TPS")
    parser.add_argument("--stream", action="store_true", help="print text as soon as a left-to-right prefix is final")
    parser.add_argument("--trace", type=Path, metavar="FILE.html", help="write a page that replays the decoding order")
    add_decode_arguments(parser)


def split_inputs(args: argparse.Namespace) -> list[str]:
    """The prompts, after taking the model from the positionals if it was given there."""
    inputs = list(args.inputs)
    if len(inputs) >= 2 and args.model is None:
        args.model = inputs.pop(0)
    if args.prompt_file is not None:
        text = sys.stdin.read() if str(args.prompt_file) == "-" else args.prompt_file.read_text()
        inputs += [line for line in text.splitlines() if line.strip()]
    if not inputs:
        raise ConfigError("no prompt given: refusion generate [MODEL] \"your prompt\" (or --prompt-file FILE)")
    return inputs


def run(args: argparse.Namespace) -> int:
    from ..decode import generate

    prompts = split_inputs(args)
    cfg = decode_config_from_args(args)
    engine_cfg = engine_config_from_args(args)
    model, tokenizer = load_from_args(args)
    on_output = None
    if args.stream and not args.json and len(prompts) == 1:
        def on_output(_i: int, out) -> None:
            print(out.delta, end="\n" if out.finished else "", flush=True)

    outs = generate(model, tokenizer, prompts, cfg, engine_config=engine_cfg, chat=not args.no_chat,
                    trace=args.trace is not None, on_output=on_output)
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "stats": out.stats.as_dict(), "config": dataclasses.asdict(cfg)}))
            continue
        if not (args.stream and len(prompts) == 1):
            print(out.text)
        if args.stats:
            s = out.stats
            print(f"[{cfg.method}] tokens={s.tokens} nfe={s.nfe} tpf={s.tpf:.2f} time={s.wall_time:.3f}s tps={s.tps:.1f}", file=sys.stderr)
    if args.trace is not None:
        from ..decode.trace import write_trace_html

        write_trace_html(args.trace, tokenizer, prompts, outs, cfg)
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
