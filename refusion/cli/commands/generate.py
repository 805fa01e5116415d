"""`refusion generate [MODEL] "prompt" ...`: decode prompts and print the text (or JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ConfigError
from ..flags import (
    add_decode_arguments,
    add_model_arguments,
    check_mask_before_load,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
)
from ..progress import OnOutput, Progress, chained

EPILOG = (
    "The bundled model answers single-turn prompts of four families only: arithmetic word problems, "
    "list operations, word-list rewrites and short Python functions (arithmetic is its weakest). "
    "`refusion generate --examples` prints one prompt of each to try. Decoding settings not given "
    "as flags come from the checkpoint's decode_config.json (`refusion info` shows them)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="*",
        metavar="[MODEL] PROMPT",
        help="prompts; with two or more, the first is the model",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--prompt-file", type=Path, help="one prompt per line ('-' for stdin), decoded as one batch"
    )
    parser.add_argument(
        "--examples",
        action="store_true",
        help="print prompts the model answers (from its checkpoint) and exit",
    )
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument(
        "--json", action="store_true", help="print text and stats as JSON (one object per prompt)"
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print tokens, NFE, TPF, wall time and TPS (of a second decode: "
        "the first, untimed, pays the process's one-time setup and any compilation)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="print text as soon as a left-to-right prefix is final"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="FILE.html",
        help="write a page that replays the decoding step by step (plans, commits, corrections)",
    )
    add_decode_arguments(parser)


def split_inputs(args: argparse.Namespace) -> list[str]:
    """The prompts, after taking the model from the positionals if it was given there."""
    inputs = list(args.inputs)
    args.model_from_positional = len(inputs) >= 2 and args.model is None
    if args.model_from_positional:
        args.model = inputs.pop(0)
    if args.prompt_file is not None:
        text = sys.stdin.read() if str(args.prompt_file) == "-" else args.prompt_file.read_text()
        inputs += [line for line in text.splitlines() if line.strip()]
    if not inputs:
        raise ConfigError(
            'no prompt given: refusion generate [MODEL] "your prompt" (or --prompt-file FILE; '
            "--examples prints prompts to try)"
        )
    return inputs


def _load(args: argparse.Namespace):
    """The model and tokenizer (a method the checkpoint cannot decode refused before its
    weights load); a positional taken as the model that is none gets a hint."""
    try:
        check_mask_before_load(args)
        return load_from_args(args)
    except CheckpointError as e:
        if not getattr(args, "model_from_positional", False) or Path(args.model).exists():
            raise
        raise ConfigError(
            f"{e}. With two or more positionals the first is the model, and {args.model!r} is none: "
            "to decode several prompts with the bundled model, put them one per line in a file "
            "and pass --prompt-file FILE (or - for stdin)"
        ) from None


def print_examples(args: argparse.Namespace) -> int:
    """The checkpoint's example prompts, one command per line, ready to paste."""
    from ...io import describe

    examples = describe(args.model)["recommended"].get("examples") or {}
    if not examples:
        print(
            'this checkpoint lists no example prompts (its decode_config.json has no "examples")',
            file=sys.stderr,
        )
        return 1
    model = f" {shlex.quote(args.model)}" if args.model else ""
    width = max(map(len, examples))
    for label, prompt in examples.items():
        print(f"{label:<{width}}  refusion generate{model} {shlex.quote(prompt)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.examples:
        return _examples(args)
    prompts = split_inputs(args)
    decode_config_from_args(args)  # bad flags fail before the model loads
    engine_cfg = engine_config_from_args(args)
    model, tokenizer = _load(args)
    cfg = decode_config_from_args(args, model=model)
    prepared = _prepared(args, model, tokenizer, prompts, cfg)
    decode = _decoder(args, model, tokenizer, prepared, engine_cfg)
    if args.stats:
        _warm_up(decode, engine_cfg, prepared)
    outs = _with_progress(decode, prepared, "decoding", _streamer(args, len(prompts)))
    _print_outputs(args, prompts, outs, cfg)
    _write_trace(args, tokenizer, prompts, outs, cfg)
    return 0


def _examples(args: argparse.Namespace) -> int:
    """--examples: the model may come as the one positional."""
    if len(args.inputs) > 1 or (args.inputs and args.model):
        raise ConfigError("--examples takes at most a model: refusion generate [MODEL] --examples")
    args.model = args.model or (args.inputs[0] if args.inputs else None)
    return print_examples(args)


def _prepared(args: argparse.Namespace, model, tokenizer, prompts: list[str], cfg) -> list:
    """The prompts prepared once, each with its config: a length not asked for by number
    is lowered to fit the context, and said so."""
    from ...decode.admit import lowered_note
    from ...decode.api import prepare

    lower = args.gen_length is None  # a length asked for by number must fit as it is
    prepared = prepare(model, tokenizer, prompts, cfg, chat=not args.no_chat, lower=lower)
    note = lowered_note(prepared, model.config.max_position_embeddings, args.preset)
    if note:
        print(note, file=sys.stderr)
    return prepared


def _decoder(args: argparse.Namespace, model, tokenizer, prepared: list, engine_cfg) -> Callable[..., list]:
    """A decode of the prompts that can be repeated (--stats times the second one)."""
    from ...decode import generate

    def decode(callback=None):
        return generate(
            model,
            tokenizer,
            prepared,
            engine_config=engine_cfg,
            trace="steps" if args.trace is not None else False,
            on_output=callback,
        )

    return decode


def _with_progress(
    decode: Callable[..., list],
    prepared: list,
    label: str,
    streamer: OnOutput | None = None,
) -> list:
    """A decode with a live count of tokens and forwards on stderr once it runs long
    (`cli.progress`); not while its text streams, which shows the progress itself."""
    progress = None if streamer is not None else Progress(sum(p.cfg.gen_length for p in prepared), label)
    try:
        return decode(chained(streamer, progress))
    finally:
        if progress is not None:
            progress.close()


def _warm_up(decode: Callable[..., list], engine_cfg, prepared: list) -> None:
    """The first forwards of a process pay one-time setup (and compilation): a decode
    that the stats do not count."""
    if engine_cfg.compile:
        print(
            "compiling (a warm-up decode of the same prompts, not counted in the stats) ...",
            file=sys.stderr,
        )
    _with_progress(decode, prepared, "warm-up decode (not counted in the stats)")


def _streamer(args: argparse.Namespace, n_prompts: int) -> Callable[[int, Any], None] | None:
    """With --stream, a single prompt's text is printed as its prefixes become final."""
    if not (args.stream and not args.json and n_prompts == 1):
        return None

    def on_output(_i: int, out) -> None:
        print(out.delta, end="\n" if out.finished else "", flush=True)

    return on_output


def _print_outputs(args: argparse.Namespace, prompts: list[str], outs, cfg) -> None:
    """Each prompt's text (unless it was streamed) and stats, or one JSON object."""
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps(_as_json(prompt, out, cfg)))
            continue
        if not (args.stream and len(prompts) == 1):
            print(out.text)
        if args.stats:
            _print_stats(out.stats, cfg)


def _as_json(prompt: str, out, cfg) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stats": out.stats.as_dict(),
        "config": dataclasses.asdict(cfg),
    }


def _print_stats(s, cfg) -> None:
    print(
        f"[{cfg.method}] tokens={s.tokens} nfe={s.nfe} tpf={s.tpf:.2f} "
        f"time={s.wall_time:.3f}s tps={s.tps:.1f}",
        file=sys.stderr,
    )


def _write_trace(args: argparse.Namespace, tokenizer, prompts: list[str], outs, cfg) -> None:
    """--trace: the page that replays the decoding order, written by the main process."""
    from ...parallel import is_main

    if args.trace is None or not is_main():
        return
    from ...decode.trace import write_trace_html

    write_trace_html(args.trace, tokenizer, prompts, outs, cfg)
    print(f"trace written to {args.trace}", file=sys.stderr)
