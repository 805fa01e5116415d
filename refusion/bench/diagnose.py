"""`refusion bench diagnose [MODEL]`: where a decoding setting parts from greedy AR
decoding of the same weights, and which code path of the decoder made it part.

Decodes the held-out suite (the items `refusion bench suite` runs) with the setting,
traced, and with greedy AR decoding of the same weights. For every answer that differs,
it finds the first differing token and reads from the decoder's own trace how that token
was committed (docs/algorithm.md#provenance): the path that accepted it
(`request.HOW`), and whether everything to its left was final when it was decided.
Decoding runs in batches (a request decodes the same tokens alone and in any batch).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..cli.flags import (
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
)
from ..decode import DecodeConfig, EngineConfig, generate
from ..decode.request import RequestOutput, TraceEvent
from ..errors import ConfigError
from .results import add_results_argument, writes_results
from .suite import SUITE_DEFAULTS, select_items
from .suite_measure import score_item

# The first differing token's category: the code path that committed it, read in this order
# (docs/algorithm.md#provenance).
CATEGORIES = {
    "sampling": "a sampled draw (temperature > 0) that no score decided",
    "left-not-final": (
        "decided out of left-to-right order: a slot to its left was not final, or one to its right "
        "was already in the cache (committed before its own left neighbour was final)"
    ),
    "plan-first": "a slot's first token, passed by global verification on its plan confidence alone",
    "verify-threshold": "passed global verification's token threshold, though AR picks another token",
    "infill-first": "infilling's first not-yet-accepted token, passed although it failed the threshold",
    "infill-threshold": "passed an infilling verify pass's threshold, though AR picks another token",
    "ar-pick": "an AR prediction in the exact left context (floating-point order alone can part it)",
    "mdm": "masked diffusion decoding",
}
_BY_HOW = {
    "plan": "plan-first",
    "verify": "verify-threshold",
    "infill-first": "infill-first",
    "infill": "infill-threshold",
    "corrected": "ar-pick",
    "ar": "ar-pick",
    "mdm": "mdm",
}
_DRAWN = ("plan", "infill-first", "corrected")  # picked by the sampler, not decided by a score
OPTION_NAMES = (
    "ar_correction",
    "first_token_check",
    "left_check",
)  # the boolean options a setting line names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="the ReFusion model (default: the bundled one)"
    )
    add_model_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument(
        "--checkpoint-settings",
        action="store_true",
        help="start from the model's own decode_config.json instead of the suite's settings "
        "(the paper's rule: slot 8, 4 blocks, thresholds 0.7 / 0.3, gen_length 128)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N held-out items (default: all 600)")
    parser.add_argument("--families", default=None, help="comma-separated task families (default: all)")
    parser.add_argument(
        "--json", dest="json_out", default=None, help="write the table and every difference here"
    )
    add_results_argument(parser, "diagnose.md")


@dataclass
class Difference:
    """One answer that differs from greedy AR decoding of the same weights."""

    index: int  # position in the held-out list that was run
    family: str
    position: int  # offset of the first differing token in the generation
    token: int | None  # the setting's token there (None: its output ended before it)
    ar_token: int | None  # AR's token there
    how: str  # how the decoder accepted the setting's token (request.HOW), "" when it has none
    exact: bool  # everything to its left was final when it was decided
    category: str  # a key of CATEGORIES
    at_eos: bool  # one of the two tokens is an EOS: one output ends where the other goes on
    correct: bool
    ar_correct: bool
    text: str
    ar_text: str


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first offset where the two token lists differ (one ending counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def committed_at(trace: Sequence[TraceEvent], position: int) -> tuple[str, bool]:
    """(how, exact) of the commit that put a token at `position`; ("", True) if none did."""
    for ev in (e for e in trace if e.committed):  # a trace of the steps has notes too
        for (start, n), how, exact in zip(ev.spans, ev.how, ev.exact):
            if start <= position < start + n:
                return how[position - start], exact
    return "", True


def categorise(how: str, exact: bool, greedy: bool) -> str:
    """The category (CATEGORIES) of a first differing token, from its provenance."""
    if not greedy and how in _DRAWN:
        return "sampling"
    if how not in ("ar", "mdm") and not exact:
        return "left-not-final"
    return _BY_HOW.get(how, "ar-pick")


@dataclass
class Decoded:
    """One item decoded both ways, scored."""

    out: RequestOutput  # with the setting, traced
    ar: RequestOutput  # greedy AR, same weights
    correct: bool
    ar_correct: bool


def difference(index: int, item: Any, d: Decoded, cfg: DecodeConfig, eos_ids: set[int]) -> Difference | None:
    """The first difference of one answer from AR's, with its provenance; None if equal."""
    out, ar = d.out, d.ar
    a, b = out.token_ids, ar.token_ids
    pos = first_difference(a, b)
    if pos is None:
        return None
    tok = a[pos] if pos < len(a) else None
    ar_tok = b[pos] if pos < len(b) else None
    how, exact = committed_at(out.trace or [], pos) if tok is not None else ("", True)
    return Difference(
        index,
        item.family,
        pos,
        tok,
        ar_tok,
        how,
        exact,
        categorise(how, exact, cfg.greedy) if tok is not None else "ar-pick",
        tok in eos_ids or ar_tok in eos_ids,
        d.correct,
        d.ar_correct,
        out.text,
        ar.text,
    )


def decode_all(model, tokenizer, items: Sequence, cfg: DecodeConfig, engine: EngineConfig) -> list[Decoded]:
    """Every item decoded with `cfg` (traced) and with greedy AR, a batch at a time."""
    ar_cfg = cfg.replace(method="ar", temperature=0.0)
    chunk, decoded = engine.max_batch_size, []
    with tqdm(total=len(items), desc="diagnose", unit="item", file=sys.stderr, mininterval=1.0) as bar:
        for i in range(0, len(items), chunk):
            batch = items[i : i + chunk]
            prompts = [it.prompt for it in batch]
            outs = generate(model, tokenizer, prompts, cfg, engine_config=engine, trace=True)
            ars = generate(model, tokenizer, prompts, ar_cfg, engine_config=engine)
            for k, (it, out, ar) in enumerate(zip(batch, outs, ars), start=i):
                decoded.append(Decoded(out, ar, score_item(it, k, out.text), score_item(it, k, ar.text)))
            bar.update(len(batch))
    return decoded


def family_rows(
    items: Sequence, decoded: Sequence[Decoded], diffs: Sequence[Difference]
) -> list[dict[str, Any]]:
    """One row per family, then "all": items, accuracy of both, answers that differ, and
    how many of those each category explains."""
    families = list(dict.fromkeys(it.family for it in items)) + ["all"]
    rows = []
    for fam in families:
        mine = [k for k, it in enumerate(items) if fam in ("all", it.family)]
        ds = [d for d in diffs if fam in ("all", d.family)]
        tokens = sum(decoded[k].out.stats.tokens for k in mine)
        nfe = sum(decoded[k].out.stats.nfe for k in mine)
        rows.append(
            {
                "family": fam,
                "items": len(mine),
                "accuracy": sum(decoded[k].correct for k in mine) / max(len(mine), 1),
                "ar_accuracy": sum(decoded[k].ar_correct for k in mine) / max(len(mine), 1),
                "tpf": tokens / nfe if nfe else 0.0,
                "differ": len(ds),
                "differ_wrong": sum(not d.correct for d in ds),
                "at_eos": sum(d.at_eos for d in ds),
                "categories": {c: sum(d.category == c for d in ds) for c in CATEGORIES},
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]], cfg: DecodeConfig, n_items: int) -> None:
    print(f"held-out suite: {n_items} items; against greedy AR decoding of the same weights")
    print(_setting(cfg))
    shown = [c for c in CATEGORIES if any(r["categories"][c] for r in rows)] or ["left-not-final"]
    heads = "".join(f" {c:>16}" for c in shown)
    print(
        f"{'family':10} {'items':>5} {'acc%':>6} {'AR acc%':>7} {'TPF':>5} {'differ':>6} "
        f"{'wrong':>5} {'EOS':>4}{heads}"
    )
    for r in rows:
        counts = "".join(f" {r['categories'][c]:16d}" for c in shown)
        print(
            f"{r['family']:10} {r['items']:5d} {100 * r['accuracy']:6.1f} {100 * r['ar_accuracy']:7.1f} "
            f"{r['tpf']:5.2f} {r['differ']:6d} {r['differ_wrong']:5d} {r['at_eos']:4d}{counts}"
        )
    print("categories of the first differing token: " + "; ".join(f"{c}: {CATEGORIES[c]}" for c in shown))


def _setting(cfg: DecodeConfig) -> str:
    text = f"setting: method {cfg.method}, gen_length {cfg.gen_length}"
    if cfg.method == "refusion":
        text += (
            f", slot_size {cfg.slot_size}, serial_blocks {cfg.serial_blocks} "
            f"({cfg.slots_per_block} slot(s) per block), slot_threshold {cfg.slot_threshold:g}, "
            f"token_threshold {cfg.token_threshold:g}"
        )
        text += "".join(f", {name}" for name in OPTION_NAMES if getattr(cfg, name))
        text += f", infill_window {cfg.infill_window}" * (cfg.infill_window is not None)
    return text + ("" if cfg.greedy else f", temperature {cfg.temperature:g}")


@writes_results
def run(args: argparse.Namespace) -> int:
    args.model = args.model or args.model_pos
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be a positive integer, got {args.limit}")
    items = select_items(args.limit, args.families)
    model, tokenizer = load_from_args(args)
    base = None if args.checkpoint_settings else SUITE_DEFAULTS
    cfg = decode_config_from_args(args, base=base, model=model)
    decoded = decode_all(model, tokenizer, items, cfg, engine_config_from_args(args))
    eos = _eos_ids(model, tokenizer, cfg)
    diffs = [d for k, it in enumerate(items) if (d := difference(k, it, decoded[k], cfg, eos)) is not None]
    rows = family_rows(items, decoded, diffs)
    print_table(rows, cfg, len(items))
    if args.json_out:
        write_json(Path(args.json_out), args, cfg, rows, diffs)
    return 0


def _eos_ids(model, tokenizer, cfg: DecodeConfig) -> set[int]:
    from ..model.prompts import eos_ids_of

    return set(cfg.stop_token_ids) if cfg.stop_token_ids is not None else eos_ids_of(model.config, tokenizer)


def write_json(
    path: Path, args: argparse.Namespace, cfg: DecodeConfig, rows: Sequence[dict], diffs: Sequence[Difference]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "model": args.model or "bundled",
        "config": asdict(cfg),
        "categories": CATEGORIES,
        "table": list(rows),
        "differences": [asdict(d) for d in diffs],
    }
    path.write_text(json.dumps(result, indent=1))
    print(f"table and every difference: {path}")
