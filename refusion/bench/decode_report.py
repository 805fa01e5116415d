"""What `refusion bench decode` prints after its first table: the batch-size sweep, what
the sweep asks of the machine, the draft widths chosen, the ceilings, why a method leads
AR at batch size 1, and how far quantized copies follow the loaded model. Each printer
returns the figures it printed, for the JSON."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..decode.forward import Forward
from .flops import ceiling_tps, shape_rates

Sweep = dict[str, dict[int, dict[str, float]]]  # method -> batch size -> figures


def ar_partner(method: str) -> str:
    """The AR row a method is compared with: AR at its temperature and under its grammar
    (`ar~0.7#g` for `refusion+c~0.7#g`), else `ar`."""
    spec = method.partition("@")[0]
    cut = min((i for i in (spec.find("~"), spec.find("#")) if i >= 0), default=len(spec))
    return "ar" + spec[cut:]


MIN_ROUNDS = 3  # fewer rounds cannot show how far one round's ratio strays
MAX_SPREAD = 0.25  # per-round ratios spread wider than this share of their median: a noisy run


def print_summary(table: dict[str, dict[str, Any]], rounds: int) -> list[str]:
    """The line the output leads with: the first method compared with AR, its speed-up at
    batch size 1, its TPF against AR's and the rounds' spread; then a warning when the
    rounds are too few, or spread too wide, for the ratio to be trusted. Returns the lines."""
    lead = next((m for m, r in table.items() if "vs_ar" in r and m != ar_partner(m)), None)
    if lead is None:
        m, r = next(iter(table.items()))
        lines = [f"{m}: TPF {r['tpf']:.2f} at batch size 1 (no AR row to compare tokens/s with)"]
    else:
        r, ar = table[lead], table[ar_partner(lead)]
        lines = [
            f"{lead}: {r['vs_ar']:.2f}x AR's tokens/s at batch size 1 (TPF {r['tpf']:.2f} vs "
            f"{ar['tpf']:.2f}), median of {rounds} round{'s' * (rounds > 1)}, "
            f"per-round ratios {r['vs_ar_low']:.2f}x-{r['vs_ar_high']:.2f}x"
        ]
        lines += noise_warnings(r, rounds)
    for line in lines:
        print(line)
    print()
    return lines


def noise_warnings(r: dict[str, float], rounds: int) -> list[str]:
    """Why a tokens/s ratio may be noise: too few rounds to see the spread, or a spread too
    wide. TPF counts forwards, which noise does not move."""
    if rounds < MIN_ROUNDS:
        return [
            f"warning: {rounds} round{'s' * (rounds > 1)} only: on a shared machine one round's ratio "
            f"can be off by 2x or more; use --rounds {MIN_ROUNDS} or more (TPF is not noisy)"
        ]
    spread = (r["vs_ar_high"] - r["vs_ar_low"]) / r["vs_ar"]
    if spread > MAX_SPREAD:
        return [
            f"warning: the per-round ratios spread over {spread:.0%} of their median: the machine's speed "
            "varied during the run; use more --rounds or a quieter machine (TPF is not noisy)"
        ]
    return []


def print_table(
    table: dict[str, dict[str, Any]], n_prompts: int, gen_length: int, rounds: int, threads: str, gpu: bool
) -> None:
    """The first table: every method at batch size 1, medians of interleaved rounds."""
    print(
        f"{n_prompts} prompts, batch size 1, gen_length {gen_length}, "
        f"median of {rounds} interleaved rounds{threads}; vs AR: the median of each round's ratio"
    )
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


def print_grammar(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For the rows under a grammar (`#g`): what the grammar itself costs per committed
    token (masking the logits rows, following the prefix), against that row's time per
    token, and the row's speed against the same method without it. Returns the figures."""
    rows = {m: r for m, r in table.items() if "#g" in m}
    if not rows:
        return {}
    print(
        "\nunder the grammar (#g): its own time per committed token, and the rows without it (batch size 1)"
    )
    print(
        f"{'method':20} {'grammar ms/tok':>14} {'share':>7} {'tok/s':>8} {'without':>8} "
        f"{'TPF':>6} {'without':>8}"
    )
    out = {}
    for m, r in rows.items():
        plain = table.get(m.replace("#g", ""), {})
        ms_per_token = 1e3 / r["tps"] if r["tps"] else 0.0
        share = r["grammar_ms_per_token"] / ms_per_token if ms_per_token else 0.0
        out[m] = {"grammar_ms_per_token": r["grammar_ms_per_token"], "share": share}
        print(
            f"{m:20} {r['grammar_ms_per_token']:14.3f} {share:7.1%} {r['tps']:8.1f} "
            f"{plain.get('tps', 0.0):8.1f} {r['tpf']:6.2f} {plain.get('tpf', 0.0):8.2f}"
        )
    return out


def print_sweep(
    full: Sweep, methods: list[str], sizes: list[int], n_sweep: int, rounds: int
) -> dict[str, dict[int, float]]:
    """The batch-size sweep's tokens/s, and each method's paired ratio to AR; returns the
    tokens/s by method and batch size."""
    sweep = {m: {b: r["tps"] for b, r in per.items()} for m, per in full.items()}
    print(
        f"\nbatch-size sweep: {n_sweep} prompts, at most b rows in flight (refilled as rows finish), "
        f"tokens/s of the whole set, median of {rounds} interleaved rounds"
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
            if m != ar_partner(m):
                print(
                    f"{m + ' / ' + ar_partner(m):20} "
                    + " ".join(f"{full[m][b]['vs_ar']:8.2f}x" for b in sizes)
                )
        print(
            "ratios: the median of each round's ratio; at each batch size the methods run one after "
            "the other, their order turning round by round"
        )
    return sweep


def print_demand(full: Sweep, methods: list[str], sizes: list[int]) -> float:
    """Tokens fed per token committed and the linear layers' GFLOP/s, per method and batch
    size, beside the matmul rate measured next to the runs; returns that rate (median)."""
    peak = statistics.median(r["peak_gflops"] for per in full.values() for r in per.values())
    print(
        "\nwhat the sweep asks of the machine: tokens fed per token committed, "
        "and the linear layers' GFLOP/s; "
        f"a matmul of the model's shapes reaches {peak:.1f} GFLOP/s in this run"
    )
    for m in methods:
        print(f"{m:20} fed/token " + " ".join(f"{full[m][b]['fed_per_token']:9.2f}" for b in sizes))
        print(f"{'':20} GFLOP/s   " + " ".join(f"{full[m][b]['gflops']:9.1f}" for b in sizes))
    return peak


def _between(seconds: dict[int, float], f: float) -> float:
    """A forward's cost at a mean of f tokens fed: linear between the whole sizes around it."""
    lo, hi = math.floor(f), math.ceil(f)
    return seconds[lo] + (f - lo) * (seconds[hi] - seconds[lo])


def print_forward_lead(model, table: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Why a method leads AR by what it does at batch size 1: a forward's seconds grow with
    the tokens it feeds (timed here at one row, on the loaded model, eagerly), and a method
    that feeds F tokens per forward (prompts included) at TPF T spends t(F) / T a token, so
    forward cost alone predicts its lead over AR decoding (or over one-token forwards where
    AR is not run); the decoder's own overhead comes on top. Printed, with the
    forward-cost curve it is read from, for the methods in `table`: those that run this
    forward (`runs_eagerly`)."""
    fed = {m: max(1.0, r["fed_per_token"] * r["tpf"]) for m, r in table.items()}
    # each mean is read between the whole sizes around it: a method whose forwards feed one
    # token but for a prompt's prefill feeds 1.5 on average, which rounding would price as
    # two tokens a forward (a forward's cost is close to affine in the tokens it feeds, and
    # for affine costs the mean's cost is the mean cost)
    sizes = sorted({1, 8, 32, 64, *(n for f in fed.values() for n in (math.floor(f), math.ceil(f)))})
    fwd = Forward(model=model, pad_id=0)
    seconds = dict(zip(sizes, fwd.time_shapes([(1, n, 64) for n in sizes], repeats=10)))
    print(
        "\nforward cost at one row (64 cached entries): "
        + ", ".join(f"{n} token{'s' * (n > 1)} {seconds[n] * 1e3:.2f} ms" for n in (1, 8, 32, 64))
    )
    cost = {m: _between(seconds, f) for m, f in fed.items()}
    per_token = {m: cost[m] / r["tpf"] for m, r in table.items()}  # s a token
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


def print_widths(full: Sweep, methods: list[str], sizes: list[int]) -> None:
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


def print_ceilings(model, full: Sweep, methods: list[str], sizes: list[int]) -> dict[str, Any]:
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


def agreement(ids: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """Greedy agreement of two decodings of the same prompts: the share of the reference's
    tokens matched at the same position, and the share of outputs identical in full."""
    same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(ids, ref))
    total = sum(max(len(x), len(y)) for x, y in zip(ids, ref))
    return same / max(total, 1), sum(x == y for x, y in zip(ids, ref)) / max(len(ref), 1)


def same_as_answer(text: str, answer: str, cut: bool) -> bool:
    """Whether a decoded text is a file's answer: the whole of it, or, for an output `cut`
    at gen_length, its start. Texts are compared, not tokens: the file holds text."""
    text, answer = text.strip(), answer.strip()
    return answer.startswith(text) if cut else text == answer


def print_file_agreement(
    rows: dict[str, list[dict[str, Any]]], tokenizer, answers: list[str | None], gen_length: int, source: str
) -> dict[str, float]:
    """The share of each greedy method's outputs that are the answers the prompts' file
    gives: for a file `refusion distill` wrote, the greedy AR answers of the model it ran
    on, so this is how far training has moved the model from it. An output cut at
    gen_length counts as identical when the answer starts with it. Texts are compared,
    not tokens: the file holds text."""
    out: dict[str, float] = {}
    for m, rs in rows.items() if tokenizer is not None else ():
        pairs = [(ids, a) for ids, a in zip(rs[-1]["_ids"], answers) if a is not None]
        if "~" in m or not pairs:
            continue
        same = sum(
            same_as_answer(tokenizer.decode(ids, skip_special_tokens=True), answer, len(ids) >= gen_length)
            for ids, answer in pairs
        )
        out[m] = same / len(pairs)
    if out:
        print(
            f"greedy outputs identical to the answers in {source} (cut at {gen_length} tokens): "
            + ", ".join(f"{m} {v:.0%}" for m, v in out.items())
        )
    return out


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
