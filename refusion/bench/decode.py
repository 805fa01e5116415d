"""`refusion bench decode [MODEL]`: AR vs ReFusion vs MDM on the same prompts, in one run.

Methods are interleaved round by round (this machine is shared and noisy) and each
figure is the median over rounds. Then a batch-size sweep: one set of prompts decoded
with at most 1, 4, 16 rows in flight, as tokens/s of the whole set. The set holds
several times the largest batch (`--sweep-prompts`): rows finish at different times and
continuous batching refills their places, so the figure is the steady-state throughput
of a full batch, not the tail of one batch waiting for its longest row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch

from ..cli.flags import (
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
)
from ..decode import DecodeConfig, EngineConfig, generate
from ..decode.grammar import requires_order
from ..errors import ConfigError
from ..timing import median_ratio, sync
from .decode_report import (
    ar_partner,
    print_agreement,
    print_ceilings,
    print_demand,
    print_file_agreement,
    print_forward_lead,
    print_grammar,
    print_summary,
    print_sweep,
    print_table,
    print_weights,
    print_widths,
)
from .flops import linear_flops, matmul_peak
from .results import add_results_argument, writes_results

DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "List five fruits and say what colour each one is.",
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Give me three tips for learning a new language.",
    "What is 12 plus 30? Show your working.",
    "Describe a sunrise over the sea.",
    "Sort these words alphabetically: pear, apple, fig, banana.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL")
    add_model_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="how many prompts (from the bundled suite if present; default: 8)",
    )
    parser.add_argument(
        "--prompts-from",
        metavar="FILE",
        help="take the prompts from a training-format JSON or JSONL file (each record's query or "
        "first user message, in order, repeated if fewer; held-out prompts of your own model) "
        "instead of the bundled suite",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved repeats; the median is reported (default: 3)"
    )
    parser.add_argument(
        "--methods",
        default="ar,refusion,mdm",
        help="comma-separated; a suffix runs a method with an engine setting changed, so both compare in "
        "one run: +c with --compile (ar+c, refusion+c), +f with fixed draft widths (refusion+f: "
        "--no-adaptive-drafts); +cf both",
    )
    parser.add_argument(
        "--quantized",
        default="",
        metavar="SCHEMES",
        help="also run every method on the model quantized with each scheme (comma-separated: int8,int4), "
        "as METHOD@SCHEME rows interleaved with the unquantized ones (docs/quantization.md)",
    )
    parser.add_argument(
        "--temperatures",
        default="",
        metavar="T,...",
        help="also run every method sampled at each temperature (comma-separated: 0.7,1.0), as METHOD~T "
        "rows interleaved with the others, each compared with AR at the same temperature "
        "(docs/algorithm.md#lossless-sampling)",
    )
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument(
        "--sweep-prompts",
        type=int,
        default=0,
        help="prompts in the batch-size sweep (default: 4 x the largest batch size)",
    )
    parser.add_argument(
        "--json", dest="json_out", default=None, help="also write the figures to this JSON file"
    )
    add_results_argument(parser, "speed.md")


def method_config(base: DecodeConfig, engine: EngineConfig, name: str) -> tuple[DecodeConfig, EngineConfig]:
    """The configs of a method name: `refusion`; `refusion+c` for the same compiled,
    `refusion+f` with fixed draft widths, `refusion+cf` both; `refusion~0.7` sampled at
    temperature 0.7; `refusion#g` under the grammar given (--grammar, --json-schema),
    which every other row leaves out; an `@int8` tail names the model (`model_of`), not a
    setting."""
    spec, hash_, _ = name.partition("@")[0].partition("#")
    spec, tilde, temperature = spec.partition("~")
    if tilde:
        try:
            base = base.replace(temperature=float(temperature))
        except ValueError:
            raise ConfigError(
                f"method {name!r}: a temperature is a number, as in --temperatures 0.7,1.0"
            ) from None
    base = base.replace(grammar=base.grammar if hash_ else None)
    method, plus, flags = spec.partition("+")
    if plus and (not flags or set(flags) - {"c", "f"}):
        raise ConfigError(
            f"method {name!r}: a suffix is +c (compiled), +f (fixed draft widths) or +cf, as in {method}+c"
        )
    return base.replace(method=method), engine.replace(
        compile=engine.compile or "c" in flags,
        adaptive_drafts=engine.adaptive_drafts and "f" not in flags,
    )


def model_of(models: dict[str | None, Any], name: str) -> Any:
    """The model a method name runs on: `refusion@int8` the int8 copy, `refusion` the
    model as loaded."""
    return models[name.partition("@")[2] or None]


def quantized_models(model, schemes: str) -> dict[str | None, Any]:
    """The loaded model (key None) and a quantized copy per scheme named (`--quantized`)."""
    from ..io.quantize import check_scheme, quantized_copy

    models: dict[str | None, Any] = {None: model}
    for s in filter(None, schemes.split(",")):
        if check_scheme(s) is None:
            raise ConfigError("--quantized takes int8 and/or int4 (the unquantized model always runs)")
        models[s] = quantized_copy(model, s)
    return models


def warm_up(
    models: dict[str | None, Any],
    tokenizer,
    base: DecodeConfig,
    engine: EngineConfig,
    methods: list[str],
    sizes: list[int],
    source: str | None = None,
) -> None:
    """Compile the graphs of the compiled methods before any timing (one row and several,
    one token and several), and time the forwards adaptive draft widths are chosen from
    (`calibrate_widths`): both are one-offs, not decoding speed."""
    for m in methods:
        cfg, ecfg = method_config(base, engine, m)
        calibrate_widths(
            model_of(models, m),
            tokenizer,
            bench_prompts(1, source),
            cfg,
            ecfg.replace(max_batch_size=max(sizes)),
        )
        if ecfg.compile and cfg.method != "mdm":
            print(f"warm-up: compiling {m}'s graphs (a minute or so at first use)", flush=True)
            for b in sorted({1, max(sizes)}):
                generate(
                    model_of(models, m),
                    tokenizer,
                    bench_prompts(min(b, 4), source),
                    cfg.for_max_tokens(min(cfg.gen_length, 32)),
                    engine_config=ecfg.replace(max_batch_size=b),
                )


def calibrate_widths(model, tokenizer, prompts: list, cfg: DecodeConfig, engine: EngineConfig) -> None:
    """For ReFusion with adaptive draft widths: a short decode, so that the forwards the
    widths are chosen from are timed (once per model, at first use) before any timing
    rather than inside the first timed run (docs/algorithm.md#adaptive-widths)."""
    if cfg.method == "refusion" and engine.adaptive_drafts:
        generate(
            model,
            tokenizer,
            prompts,
            cfg.for_max_tokens(min(cfg.gen_length, 16)),
            engine_config=engine,
        )


def bench_prompts(n: int, source: str | None = None) -> list[str]:
    """n prompts: those of a training-format file (`source`, in order, repeated when it has
    fewer), else held-out prompts of the bundled synthetic suite when it is installed, else
    generic ones."""
    if source is not None:
        from ..train.distill import file_prompts

        return repeated([p.text for p in file_prompts(source)], n)
    try:
        from ..tasks import load_test_items

        return [it.prompt for it in load_test_items()[:n]]
    except ImportError:
        return repeated(DEFAULT_PROMPTS, n)


def bench_answers(n: int, source: str) -> list[str | None]:
    """The answers a training-format file gives the n prompts `bench_prompts` takes from it
    (None where a record has none)."""
    from ..train.distill import file_prompts

    return repeated([p.answer for p in file_prompts(source)], n)


def repeated(items: list, n: int) -> list:
    """The first n of `items` repeated end to end."""
    return (items * (n // len(items) + 1))[:n]


def timed(model, tokenizer, prompts, cfg: DecodeConfig, engine: EngineConfig) -> dict[str, Any]:
    """Decode prompts with at most engine.max_batch_size rows in flight; figures for the whole set."""
    sync(model.device)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    t0 = time.perf_counter()
    outs = generate(model, tokenizer, prompts, cfg, engine_config=engine)
    sync(model.device)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(model.device) / 1e6 if cuda else 0.0
    tokens = sum(o.stats.tokens for o in outs)
    nfe = sum(o.stats.nfe for o in outs)
    # share of the time outside forward passes: the decoder's own per-step overhead (each
    # forward's time is split over the requests in it, so the shares add up to the forward time)
    overhead = 1.0 - sum(o.stats.forward_share for o in outs) / wall
    fed, logit_rows = sum(o.stats.fed for o in outs), sum(o.stats.logit_rows for o in outs)
    flops = linear_flops(model, fed, logit_rows)
    return {
        **draft_widths(outs),
        "tokens": tokens,
        "nfe": nfe,
        "tpf": tokens / max(nfe, 1),
        "wall": wall,
        "tps": tokens / wall,
        "overhead": overhead,
        "fed_per_token": fed / max(tokens, 1),
        "logit_rows_per_token": logit_rows / max(tokens, 1),
        "gflops": flops / wall / 1e9,
        "peak_mb": peak,  # the device's peak allocated memory during the run (a GPU only; 0 on a CPU)
        "_ids": [list(o.token_ids) for o in outs],  # not a figure: for `agreement`
    }


def draft_widths(outs) -> dict[str, float]:
    """ReFusion's draft widths over a set: the mean plan width (MASKs per slot) and
    infilling window of the steps that drafted, and the share of blocks decoded as AR
    decoding (docs/algorithm.md#adaptive-widths); zeros for other methods."""
    steps = sum(o.stats.draft_steps for o in outs)
    ar = sum(o.stats.ar_blocks for o in outs)
    return {
        "plan_width": sum(o.stats.plan_width_sum for o in outs) / max(steps, 1),
        "window": sum(o.stats.window_sum for o in outs) / max(steps, 1),
        "ar_block_share": ar / max(steps + ar, 1),
        # the grammar's own seconds per committed token (masking logits rows, following the prefix)
        "grammar_ms_per_token": 1e3
        * sum(o.stats.grammar_time for o in outs)
        / max(sum(o.stats.tokens for o in outs), 1),
    }


@writes_results
def run(args: argparse.Namespace) -> int:
    """On a split model every rank measures alongside (their forwards meet in each
    all-reduce); the first prints and writes the figures."""
    from ..parallel import is_main

    if is_main():
        return _run(args, report=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return _run(args, report=False)


def _run(args: argparse.Namespace, report: bool) -> int:
    args.model = args.model or args.model_pos
    decode_config_from_args(args)  # bad flags fail before the model loads
    model, tokenizer = load_from_args(args)
    base, engine = decode_config_from_args(args, model=model), engine_config_from_args(args)
    prompts = bench_prompts(args.prompts, args.prompts_from)
    methods = args.methods.split(",")
    methods += [
        f"{m}~{t}" for t in filter(None, args.temperatures.split(",")) for m in args.methods.split(",")
    ]
    if base.grammar is not None:  # every method that can take the grammar, also under it
        methods += [f"{m}#g" for m in methods if requires_order(method_config(base, engine, m)[0]) is None]
    for m in methods:
        method_config(base, engine, m)  # a bad name (or temperature) fails before any timing
    models = quantized_models(model, args.quantized)
    methods += [f"{m}@{q}" for q in models if q is not None for m in methods]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    warm_up(models, tokenizer, base, engine, methods, sizes, args.prompts_from)
    rows = one_row_rounds(models, tokenizer, prompts, base, engine, methods, args.rounds)
    table = {m: {**medians(rs), **paired_vs_ar(rows, m)} for m, rs in rows.items()}
    threads = f", {torch.get_num_threads()} CPU threads" if model.device.type == "cpu" else ""
    summary = print_summary(table, args.rounds)
    print_table(table, len(prompts), base.gen_length, args.rounds, threads, model.device.type == "cuda")
    grammar = print_grammar(table)
    figures: dict[str, Any] = {
        "summary": summary,
        "config": dataclasses.asdict(base),
        "engine": dataclasses.asdict(engine),
        "prompts": len(prompts),
        "prompts_from": args.prompts_from,
        "table": table,
        "grammar": grammar,
        "forward_lead": print_forward_lead(
            model, {m: r for m, r in table.items() if runs_eagerly(base, engine, m)}
        ),
        "agreement": print_agreement(rows),
        "file_agreement": args.prompts_from
        and print_file_agreement(
            rows,
            tokenizer,
            bench_answers(len(prompts), args.prompts_from),
            base.gen_length,
            args.prompts_from,
        ),
        "weight_bytes": print_weights(models),
    }
    n_sweep = args.sweep_prompts or 4 * max(sizes)
    full, n_sweep = batch_sweep(
        models, tokenizer, base, engine, methods, sizes, n_sweep, args.rounds, args.prompts_from
    )
    figures |= {"sweep_prompts": n_sweep, "sweep_detail": full}
    figures["sweep"] = print_sweep(full, methods, sizes, n_sweep, args.rounds)
    figures["matmul_peak_gflops"] = print_demand(full, methods, sizes)
    print_widths(full, methods, sizes)
    figures["ceiling"] = print_ceilings(model, full, methods, sizes)
    if args.json_out and report:
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def one_row_rounds(
    models: dict[str | None, Any],
    tokenizer,
    prompts: list[str],
    base: DecodeConfig,
    engine: EngineConfig,
    methods: list[str],
    rounds: int,
) -> dict[str, list[dict[str, Any]]]:
    """The first table's runs: every method on the prompts at batch size 1, round by round,
    the methods' order turning each round (`turn`)."""
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for i in range(rounds):
        for m in turn(methods, i):
            cfg, ecfg = method_config(base, engine, m)
            rows[m].append(
                timed(model_of(models, m), tokenizer, prompts, cfg, ecfg.replace(max_batch_size=1))
            )
    return rows


def runs_eagerly(base: DecodeConfig, engine: EngineConfig, name: str) -> bool:
    """Whether a method runs the loaded model's own eager forward (not compiled, not a
    quantized copy): the forward `print_forward_lead` times."""
    return "@" not in name and not method_config(base, engine, name)[1].compile


def batch_sweep(
    models: dict[str | None, Any],
    tokenizer,
    base: DecodeConfig,
    engine: EngineConfig,
    methods: list[str],
    sizes: list[int],
    n: int,
    rounds: int,
    source: str | None = None,
) -> tuple[dict[str, dict[int, dict[str, float]]], int]:
    """Per (method, batch size), the figures of `timed` for n prompts (median over rounds of
    each, and `paired_vs_ar`); within a round, each batch size runs every method one after
    the other, so that the figures a ratio compares are taken moments apart on a machine
    whose speed drifts, and the methods' order turns each round (`turn`), so that none
    always runs first. `peak_gflops` is the model-shape matmul rate measured next to each run.
    `source`: a file the prompts come from (`bench_prompts`)."""
    prompts = bench_prompts(n, source)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {m: {b: [] for b in sizes} for m in methods}
    for i in range(rounds):
        for b in sizes:
            for m in turn(methods, i):
                cfg, ecfg = method_config(base, engine, m)
                model = model_of(models, m)
                r = timed(model, tokenizer, prompts, cfg, ecfg.replace(max_batch_size=b))
                runs[m][b].append({**r, "peak_gflops": matmul_peak(models[None])})
    return {
        m: {b: {**medians(per[b]), **paired_vs_ar({k: runs[k][b] for k in runs}, m)} for b in sizes}
        for m, per in runs.items()
    }, len(prompts)


def turn(methods: list[str], i: int) -> list[str]:
    """The methods in round i's order: the list turned by i places."""
    k = i % max(len(methods), 1)
    return methods[k:] + methods[:k]


def paired_vs_ar(runs: dict[str, list[dict[str, Any]]], m: str) -> dict[str, float]:
    """{"vs_ar": the median over rounds of method m's tokens/s over AR's (at m's temperature:
    `ar~0.7` for `refusion~0.7`) in the same round (`median_ratio`), "vs_ar_low" and
    "vs_ar_high": the lowest and highest of those rounds' ratios (the noise a reader must
    weigh the median against)}, or {} when that AR was not run."""
    ar = ar_partner(m)
    if ar not in runs:
        return {}
    pairs = [(a["tps"], r["tps"]) for r, a in zip(runs[m], runs[ar])]
    each = [r / a for a, r in pairs]
    return {"vs_ar": median_ratio(pairs), "vs_ar_low": min(each), "vs_ar_high": max(each)}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each figure's median over the runs (keys starting with `_` are not figures)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if not k.startswith("_")}
