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
from ..decode.forward import Forward
from ..errors import ConfigError
from ..timing import median_ratio, sync, time_ms

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


def method_config(base: DecodeConfig, engine: EngineConfig, name: str) -> tuple[DecodeConfig, EngineConfig]:
    """The configs of a method name: `refusion`; `refusion+c` for the same compiled,
    `refusion+f` with fixed draft widths, `refusion+cf` both; an `@int8` tail names the
    model (`model_of`), not a setting."""
    method, plus, flags = name.partition("@")[0].partition("+")
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
) -> None:
    """Compile the graphs of the compiled methods before any timing (one row and several,
    one token and several), and time the forwards adaptive draft widths are chosen from
    (`calibrate_widths`): both are one-offs, not decoding speed."""
    for m in methods:
        cfg, ecfg = method_config(base, engine, m)
        calibrate_widths(
            model_of(models, m), tokenizer, bench_prompts(1), cfg, ecfg.replace(max_batch_size=max(sizes))
        )
        if ecfg.compile and cfg.method != "mdm":
            print(f"warm-up: compiling {m}'s graphs (a minute or so at first use)", flush=True)
            for b in sorted({1, max(sizes)}):
                generate(
                    model_of(models, m),
                    tokenizer,
                    bench_prompts(min(b, 4)),
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
            bench_prompts(1),
            cfg.for_max_tokens(min(cfg.gen_length, 16)),
            engine_config=engine,
        )


def bench_prompts(n: int) -> list[str]:
    """Held-out prompts of the bundled synthetic suite when it is installed, else generic ones."""
    try:
        from ..tasks import load_test_items

        return [it.prompt for it in load_test_items()[:n]]
    except ImportError:
        return (DEFAULT_PROMPTS * (n // len(DEFAULT_PROMPTS) + 1))[:n]


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
    }


def linear_flops(model, fed: int, logit_rows: int) -> float:
    """FLOPs of the linear layers for `fed` tokens through the body and `logit_rows` through
    the vocabulary projection (attention left out: small next to them at these lengths)."""
    return sum(
        2.0 * o * i * (body * fed + head * logit_rows)
        for (o, i), (body, head) in linear_shapes(model).items()
    )


def linear_rate(model, out_f: int, in_f: int, rows: int, inner: int) -> float:
    """GFLOP/s of a (rows x in_f) by (in_f -> out_f) matmul in the model's dtype and device,
    best of 5 samples of `inner` calls."""

    x = torch.randn(rows, in_f, device=model.device, dtype=model.dtype)
    w = torch.randn(out_f, in_f, device=model.device, dtype=model.dtype)
    best_ms = min(time_ms(lambda: torch.nn.functional.linear(x, w), model.device, inner) for _ in range(5))
    return 2.0 * rows * in_f * out_f / best_ms / 1e6


def matmul_peak(model, rows: int = 512) -> float:
    """GFLOP/s of one matmul of the model's own shapes (rows x hidden by hidden x
    intermediate), best of a few: what a batch's linear layers could reach at most."""
    c = model.config
    return linear_rate(model, c.intermediate_size, c.hidden_size, rows, 10)


def linear_shapes(model) -> dict[tuple[int, int], tuple[int, int]]:
    """(out, in) of each distinct linear shape -> (layers of that shape in the body, in the
    vocabulary projection): the weights one fed token, or one logit row, goes through."""
    shapes: dict[tuple[int, int], tuple[int, int]] = {}
    for m in model.model.modules():
        if isinstance(m, torch.nn.Linear):
            body, head = shapes.get(tuple(m.weight.shape), (0, 0))
            shapes[tuple(m.weight.shape)] = (body + 1, head)
    body, head = shapes.get(tuple(model.lm_head.weight.shape), (0, 0))
    shapes[tuple(model.lm_head.weight.shape)] = (body, head + 1)
    return shapes


def shape_rates(model, rows: int = 512) -> dict[tuple[int, int], float]:
    """GFLOP/s of each linear shape with `rows` input rows, best of a few (an upper bound
    on what a batch's forwards get from that shape)."""
    return {(out_f, in_f): linear_rate(model, out_f, in_f, rows, 5) for out_f, in_f in linear_shapes(model)}


def ceiling_tps(
    model, rates: dict[tuple[int, int], float], tokens: float, fed: float, logit_rows: float
) -> float:
    """Tokens/s if every linear layer ran at its shape's best rate and nothing else (attention,
    norms, sampling, bookkeeping) took any time: what no batch size can beat on this machine
    for this many fed tokens and logit rows per committed token."""
    seconds = 0.0
    for (out_f, in_f), (body, head) in linear_shapes(model).items():
        seconds += 2.0 * out_f * in_f * (body * fed + head * logit_rows) / (rates[(out_f, in_f)] * 1e9)
    return tokens / seconds if seconds > 0 else float("inf")


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
    prompts = bench_prompts(args.prompts)
    methods = args.methods.split(",")
    for m in methods:
        method_config(base, engine, m)  # a bad name fails before any timing
    models = quantized_models(model, args.quantized)
    methods += [f"{m}@{q}" for q in models if q is not None for m in methods]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    warm_up(models, tokenizer, base, engine, methods, sizes)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for i in range(args.rounds):
        for m in turn(methods, i):
            cfg, ecfg = method_config(base, engine, m)
            rows[m].append(
                timed(model_of(models, m), tokenizer, prompts, cfg, ecfg.replace(max_batch_size=1))
            )
    table = {m: {**medians(rs), **paired_vs_ar(rows, m)} for m, rs in rows.items()}
    threads = f", {torch.get_num_threads()} CPU threads" if model.device.type == "cpu" else ""
    print(
        f"{len(prompts)} prompts, batch size 1, gen_length {base.gen_length}, "
        f"median of {args.rounds} interleaved rounds{threads}; vs AR: the median of each round's ratio"
    )
    gpu = model.device.type == "cuda"
    print(
        f"{'method':20} {'tokens':>7} {'NFE':>6} {'TPF':>6} {'tok/s':>8} {'vs AR':>6} {'overhead':>9}"
        + (f" {'peak MB':>8}" if gpu else "")
    )
    for m, r in table.items():
        ratio = f"{r['vs_ar']:.2f}x" if "vs_ar" in r else "-"
        print(
            f"{m:20} {r['tokens']:7.0f} {r['nfe']:6.0f} {r['tpf']:6.2f} {r['tps']:8.1f} "
            f"{ratio:>6} {r['overhead']:8.1%}" + (f" {r['peak_mb']:8.0f}" if gpu else "")
        )
    print(
        "overhead: share of decode time spent outside forward passes (decoder logic, sampling, bookkeeping)"
    )
    lead = print_forward_lead(model, {m: r for m, r in table.items() if runs_eagerly(base, engine, m)})
    agreed = print_agreement(rows)
    weights = print_weights(models)
    full, n_sweep = batch_sweep(
        models, tokenizer, base, engine, methods, sizes, args.sweep_prompts or 4 * max(sizes), args.rounds
    )
    sweep = {m: {b: r["tps"] for b, r in per.items()} for m, per in full.items()}
    print(
        f"\nbatch-size sweep: {n_sweep} prompts, at most b rows in flight (refilled as rows finish), "
        f"tokens/s of the whole set, median of {args.rounds} interleaved rounds"
    )
    print(f"{'method':20} " + " ".join(f"{'b=' + str(b):>9}" for b in sizes) + f" {'max/b1':>7}")
    for m in methods:
        print(
            f"{m:20} "
            + " ".join(f"{sweep[m][b]:9.1f}" for b in sizes)
            + f" {max(sweep[m].values()) / sweep[m][sizes[0]]:6.2f}x"
        )
    if "ar" in methods:
        for m in methods:
            if m != "ar":
                print(f"{m + ' / ar':20} " + " ".join(f"{full[m][b]['vs_ar']:8.2f}x" for b in sizes))
        print(
            "ratios: the median of each round's ratio; at each batch size the methods run one after "
            "the other, their order turning round by round"
        )
    peak = statistics.median(r["peak_gflops"] for per in full.values() for r in per.values())
    print(
        "\nwhat the sweep asks of the machine: tokens fed per token committed, "
        "and the linear layers' GFLOP/s; "
        f"a matmul of the model's shapes reaches {peak:.1f} GFLOP/s in this run"
    )
    for m in methods:
        print(f"{m:20} fed/token " + " ".join(f"{full[m][b]['fed_per_token']:9.2f}" for b in sizes))
        print(f"{'':20} GFLOP/s   " + " ".join(f"{full[m][b]['gflops']:9.1f}" for b in sizes))
    print_widths(full, methods, sizes)
    ceilings = print_ceilings(model, full, methods, sizes)
    if args.json_out and report:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "config": dataclasses.asdict(base),
                    "engine": dataclasses.asdict(engine),
                    "prompts": len(prompts),
                    "table": table,
                    "sweep_prompts": n_sweep,
                    "sweep": sweep,
                    "sweep_detail": full,
                    "matmul_peak_gflops": peak,
                    "ceiling": ceilings,
                    "forward_lead": lead,
                    "weight_bytes": weights,
                    "agreement": agreed,
                },
                f,
                indent=2,
            )
    return 0


def runs_eagerly(base: DecodeConfig, engine: EngineConfig, name: str) -> bool:
    """Whether a method runs the loaded model's own eager forward (not compiled, not a
    quantized copy): the forward `print_forward_lead` times."""
    return "@" not in name and not method_config(base, engine, name)[1].compile


def print_forward_lead(model, table: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Why a method leads AR by what it does at batch size 1: a forward's seconds grow with
    the tokens it feeds (timed here at one row, on the loaded model, eagerly), and a method
    that feeds F tokens per forward (prompts included) at TPF T spends t(F) / T a token, so
    forward cost alone predicts its lead over AR decoding (or over one-token forwards where
    AR is not run); the decoder's own overhead comes on top. Printed, with the
    forward-cost curve it is read from, for the methods in `table`: those that run this
    forward (`runs_eagerly`)."""
    fed = {m: r["fed_per_token"] * r["tpf"] for m, r in table.items()}
    sizes = sorted({1, 8, 32, 64, *(max(1, round(f)) for f in fed.values())})
    fwd = Forward(model=model, pad_id=0)
    seconds = dict(zip(sizes, fwd.time_shapes([(1, n, 64) for n in sizes], repeats=10)))
    print(
        "\nforward cost at one row (64 cached entries): "
        + ", ".join(f"{n} token{'s' * (n > 1)} {seconds[n] * 1e3:.2f} ms" for n in (1, 8, 32, 64))
    )
    per_token = {m: seconds[max(1, round(fed[m]))] / r["tpf"] for m, r in table.items()}  # s a token
    unit = per_token.get("ar", seconds[1])
    out: dict[str, Any] = {"ms_by_tokens_fed": {n: seconds[n] * 1e3 for n in sizes}, "methods": {}}
    for m, r in table.items():
        pred = unit / per_token[m]
        out["methods"][m] = {"fed_per_forward": fed[m], "predicted_lead": pred}
        print(f"{m:20} feeds {fed[m]:5.1f} tokens a forward at TPF {r['tpf']:5.2f}: predicted {pred:.2f}x AR")
    print(
        "predicted: t(tokens fed a forward) / TPF against AR's, the lead forward cost alone allows at batch "
        "size 1 (decoder overhead aside): a wider forward is not free on this device"
    )
    return out


def print_widths(full: dict[str, dict[int, dict[str, float]]], methods: list[str], sizes: list[int]) -> None:
    """The draft widths each ReFusion method chose per batch size: mean plan width / mean
    infilling window of the steps that drafted, and the share of blocks decoded as AR."""
    drafting = [
        m for m in methods if any(full[m][b]["plan_width"] or full[m][b]["ar_block_share"] for b in sizes)
    ]
    if not drafting:
        return
    print("\ndraft widths per batch size: plan width / infill window (mean of drafting steps), blocks as AR")
    for m in drafting:
        cells = [
            f"{full[m][b]['plan_width']:.0f}/{full[m][b]['window']:.0f} {full[m][b]['ar_block_share']:4.0%}"
            for b in sizes
        ]
        print(f"{m:20} " + " ".join(f"{c:>12}" for c in cells))


def print_ceilings(
    model, full: dict[str, dict[int, dict[str, float]]], methods: list[str], sizes: list[int]
) -> dict[str, Any]:
    """The most any batch size could reach: each method's fed tokens and logit rows per
    committed token (at the largest batch) through linear layers at their shapes' best
    measured rates, everything else free. Printed next to the sweep's b=1 and best figures."""
    rates = shape_rates(model)
    out: dict[str, Any] = {"shape_gflops": {f"{o}x{i}": r for (o, i), r in rates.items()}}
    print(
        "\nceiling: tokens/s if every linear layer ran at its shape's best rate here (512 rows) "
        "and attention, norms,\n"
        "sampling and bookkeeping took no time; no batch size can beat it "
        "for this many tokens fed per token committed"
    )
    print(f"{'method':20} {'ceiling':>9} {'/ b=1':>7} {'best b':>7} {'share':>6}")
    for m in methods:
        big = full[m][sizes[-1]]
        ceil = ceiling_tps(model, rates, 1.0, big["fed_per_token"], big["logit_rows_per_token"])
        best = max(r["tps"] for r in full[m].values())
        b1 = full[m][sizes[0]]["tps"]
        out[m] = {"ceiling_tps": ceil, "ceiling_vs_b1": ceil / b1, "best_share_of_ceiling": best / ceil}
        print(f"{m:20} {ceil:9.1f} {ceil / b1:6.2f}x {best:7.1f} {best / ceil:6.1%}")
    return out


def print_weights(models: dict[str | None, Any]) -> dict[str, dict[str, int]]:
    """Each model's weight bytes per dtype, printed when quantized copies run beside the
    loaded model."""
    from ..io.quantize import describe_bytes, weight_bytes

    out = {q or "loaded": weight_bytes(m) for q, m in models.items()}
    if len(models) > 1:
        print("\nweights read per forward: " + "; ".join(f"{k}: {describe_bytes(v)}" for k, v in out.items()))
    return out


def batch_sweep(
    models: dict[str | None, Any],
    tokenizer,
    base: DecodeConfig,
    engine: EngineConfig,
    methods: list[str],
    sizes: list[int],
    n: int,
    rounds: int,
) -> tuple[dict[str, dict[int, dict[str, float]]], int]:
    """Per (method, batch size), the figures of `timed` for n prompts (median over rounds of
    each, and `paired_vs_ar`); within a round, each batch size runs every method one after
    the other, so that the figures a ratio compares are taken moments apart on a machine
    whose speed drifts, and the methods' order turns each round (`turn`), so that none
    always runs first. `peak_gflops` is the model-shape matmul rate measured next to each run."""
    prompts = bench_prompts(n)
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
    """{"vs_ar": the median over rounds of method m's tokens/s over AR's in the same round
    (`median_ratio`)}, or {} when AR was not run."""
    if "ar" not in runs:
        return {}
    return {"vs_ar": median_ratio((a["tps"], r["tps"]) for r, a in zip(runs[m], runs["ar"]))}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each figure's median over the runs (keys starting with `_` are not figures)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if not k.startswith("_")}


def agreement(ids: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """Greedy agreement of two decodings of the same prompts: the share of the reference's
    tokens matched at the same position, and the share of outputs identical in full."""
    same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(ids, ref))
    total = sum(max(len(x), len(y)) for x, y in zip(ids, ref))
    return same / max(total, 1), sum(x == y for x, y in zip(ids, ref)) / max(len(ref), 1)


def print_agreement(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """How far each quantized method's greedy tokens follow the same method unquantized."""
    out = {}
    for m, rs in rows.items():
        base = m.partition("@")[0]
        if "@" in m and base in rows:
            tokens, whole = agreement(rs[-1]["_ids"], rows[base][-1]["_ids"])
            out[m] = {"tokens": tokens, "outputs": whole}
    if out:
        print(
            "greedy agreement with the same method unquantized: "
            "tokens at the same position, outputs identical"
        )
        for m, a in out.items():
            print(f"{m:20} {a['tokens']:8.1%} {a['outputs']:8.1%}")
    return out
