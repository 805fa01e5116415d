"""`refusion bench suite [MODEL]`: the paper's Table 1 and Figure 1 at laptop scale.

On the held-out items of the bundled synthetic suite (`refusion.tasks`), greedy, batch
size 1, one run decodes the same prompts with every row: the AR baseline model, ReFusion,
ReFusion left to right (one slot per block), MDM on the ReFusion weights, AR decoding of
the ReFusion weights, then ReFusion with each decoding option beyond the paper
(`ar_correction`, then with `first_token_check` too) and with the ReFusion checkpoint's
own settings. The machine is shared and noisy, so work is interleaved: items go in chunks
and every row decodes a chunk before the next one starts (in rotating order), so drift
touches all rows alike. Wall time is measured around `generate` only.

Then a sweep (Figure 1): ReFusion over slot x token thresholds, MDM over tokens per step
and confidence thresholds, the AR baseline as a point; accuracy against tokens/s and
against TPF, drawn to a PNG, and each method scored by AUP (`refusion.bench.aup`).

This module is the command and its rows; measuring and the figures are `suite_measure.py`,
the printed table, the sweep and the plot `suite_report.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cli.flags import (
    add_data_parallel_argument,
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
)
from ..decode import DecodeConfig, EngineConfig
from ..errors import CheckpointError, ConfigError
from ..settings.recommended import Recommended, recommended_of
from .results import add_results_argument, writes_results
from .suite_measure import Run, measure, sweep_points, table_rows
from .suite_report import plot_sweep, print_sweep, print_table, pyplot

DEFAULT_AR_MODEL = "bundled:ar-tiny"  # the bundled model's AR baseline, shipped beside it
# Settings that suit the bundled model (its answers are short); every one can be overridden by a flag.
SUITE_DEFAULTS = DecodeConfig(
    method="refusion", gen_length=128, slot_size=8, serial_blocks=4, slot_threshold=0.7, token_threshold=0.3
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="the ReFusion model (default: the bundled one)"
    )
    add_model_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument(
        "--ar-model",
        default=None,
        help="the AR baseline (`refusion train --objective ar`); "
        f"default: {DEFAULT_AR_MODEL}, the bundled model's (its row is skipped where it is not installed)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N held-out items (default: all 600)")
    parser.add_argument("--families", default=None, help="comma-separated task families (default: all)")
    parser.add_argument("--chunk", type=int, default=10, help="items per interleaving chunk")
    add_data_parallel_argument(
        parser, "share the chunks of items; one table, per-item timings as each replica ran them"
    )
    parser.add_argument("--out", default="runs/bench-suite", help="directory for the JSON and the PNG")
    parser.add_argument("--json", dest="json_out", default=None, help="JSON path (default: OUT/suite.json)")
    parser.add_argument("--plot", default=None, help="PNG path of the sweep (default: OUT/sweep.png)")
    parser.add_argument(
        "--rows",
        default=None,
        help="comma-separated keys of the table's rows to run (default: all; keys: ar_baseline, "
        "refusion, refusion_l2r, mdm, ar_refusion, refusion_corrected, refusion_checked, "
        "refusion_left_checked, refusion_recommended)",
    )
    g = parser.add_argument_group("sweep (Figure 1, AUP)")
    g.add_argument("--no-sweep", action="store_true", help="only the table")
    g.add_argument(
        "--sweep-limit", type=int, default=100, help="items in the sweep (the first N of those selected)"
    )
    g.add_argument("--sweep-slot", default="0.5,0.7,0.9", help="ReFusion slot thresholds")
    g.add_argument("--sweep-token", default="0.1,0.3,0.5", help="ReFusion token thresholds")
    g.add_argument(
        "--sweep-mdm-tokens-per-step", default="1,2,4", help="MDM: tokens fixed per step (top-k schedule)"
    )
    g.add_argument(
        "--sweep-mdm-threshold", default="0.9,0.7", help="MDM: confidence thresholds (Fast-dLLM style)"
    )
    add_results_argument(parser, "suite.md")


# ---------------------------------------------------------------------------- inputs
def parse_floats(text: str, name: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated numbers, got {text!r}") from None


def select_items(limit: int | None, families: str | None) -> list:
    """The held-out items, balanced across the chosen families."""
    from ..tasks import FAMILIES, load_test_items

    names = None
    if families:
        names = [f.strip() for f in families.split(",") if f.strip()]
        unknown = [f for f in names if f not in FAMILIES]
        if unknown:
            raise ConfigError(f"unknown task families {', '.join(unknown)}; families: {', '.join(FAMILIES)}")
    return load_test_items(limit, names)


def resolve_ar_model(given: str | None) -> tuple[str | None, str | None]:
    """(what to load for the AR baseline, or None with a note saying why it is skipped).
    A path the user names must exist: a typo should not silently drop the baseline row."""
    from ..io import BUNDLED_PREFIX, bundled_names

    if given is None:
        if DEFAULT_AR_MODEL[len(BUNDLED_PREFIX) :] in bundled_names():
            return DEFAULT_AR_MODEL, None
        return None, (
            f"note: AR baseline row skipped: {DEFAULT_AR_MODEL} is not installed "
            "(train one with `refusion train --objective ar` and pass --ar-model)"
        )
    if given.startswith(BUNDLED_PREFIX):
        return given, None  # `load` names what is shipped if this is not
    local = Path(given).expanduser()
    looks_local = (
        given.startswith((".", "/", "~")) or given.count("/") != 1 or Path(given.split("/")[0]).is_dir()
    )
    if looks_local and not local.exists():
        raise CheckpointError(
            f"AR baseline model not found: no directory at {given} "
            "(train one with `refusion train --objective ar`, or fix --ar-model)"
        )
    return given, None


def base_config(args: argparse.Namespace) -> DecodeConfig:
    """The user's flags over the suite's defaults; batch size 1 for every row. Flags the
    suite cannot honour are refused rather than silently ignored."""
    if args.method:
        raise ConfigError("the suite runs every method (its rows); drop --method")
    if args.max_batch_size not in (None, 1):
        raise ConfigError("the suite decodes at batch size 1 (as the paper's Table 1); drop --max-batch-size")
    for name in ("limit", "chunk", "sweep_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return decode_config_from_args(args, base=SUITE_DEFAULTS)


# the decoding options beyond the paper, each measured in a row of its own
PAPER_RULE = dict(ar_correction=False, first_token_check=False, left_check=False)
BEYOND_PAPER = [
    ("refusion_corrected", "ReFusion + AR correction", dict(ar_correction=True, first_token_check=False)),
    (
        "refusion_checked",
        "ReFusion + AR correction + first-token check",
        dict(ar_correction=True, first_token_check=True),
    ),
    (
        "refusion_left_checked",
        "ReFusion + AR correction + first-token check + left check",
        dict(ar_correction=True, first_token_check=True, left_check=True),
    ),
]


def table_runs(base: DecodeConfig, with_ar: bool) -> list[Run]:
    """Table 1's rows, in the paper's order, then the options beyond the paper."""
    paper = base.replace(method="refusion", **PAPER_RULE)
    l2r = paper.replace(serial_blocks=base.region_length // base.slot_size)
    runs = [
        Run("refusion", "ReFusion", "refusion", paper),
        Run("refusion_l2r", "ReFusion L2R (one slot per block)", "refusion", l2r),
        Run("mdm", "MDM", "refusion", base.replace(method="mdm")),
        Run("ar_refusion", "AR decoding of ReFusion weights", "refusion", base.replace(method="ar")),
        *(Run(key, label, "refusion", paper.replace(**options)) for key, label, options in BEYOND_PAPER),
    ]
    if with_ar:
        runs.insert(0, Run("ar_baseline", "AR baseline (AR decoding)", "ar", base.replace(method="ar")))
    return runs


# what a checkpoint's own decode_config.json may set for the row of its recommended settings
RECOMMENDED_FIELDS = (
    "slot_size",
    "serial_blocks",
    "slot_threshold",
    "token_threshold",
    "ar_correction",
    "first_token_check",
    "left_check",
    "infill_window",
)


def recommended_run(base: DecodeConfig, recommended: Recommended, runs: Sequence[Run]) -> Run | None:
    """A row for the ReFusion model's own recommended slot layout, thresholds and options
    (its decode_config.json; gen_length, sampling and stops stay the suite's): what
    `refusion generate` does with it. None when it recommends none of them (a checkpoint
    without the file), no ReFusion decoding, or settings a row already has."""
    own = recommended.decode_config()
    if own.method != "refusion" or not any(k in recommended.decode for k in RECOMMENDED_FIELDS):
        return None
    cfg = base.replace(method="refusion", **{k: getattr(own, k) for k in RECOMMENDED_FIELDS})
    if any(r.cfg == cfg for r in runs):
        return None
    shown = (
        f"slot {cfg.slot_size}, {cfg.serial_blocks} blocks, {cfg.slot_threshold:g}/{cfg.token_threshold:g}"
    )
    shown += " + AR correction" * cfg.ar_correction + " + first-token check" * cfg.first_token_check
    shown += " + left check" * cfg.left_check
    shown += f", infill window {cfg.infill_window}" * (cfg.infill_window is not None)
    return Run("refusion_recommended", f"ReFusion, the checkpoint's settings ({shown})", "refusion", cfg)


def sweep_runs(base: DecodeConfig, args: argparse.Namespace, with_ar: bool) -> list[Run]:
    """Figure 1's points: ReFusion thresholds (the paper's rule, then with AR correction and
    the first-token check, then with the left check as well), MDM steps and thresholds, the
    AR baseline."""
    runs = []
    for key, group, rule in (("refusion", "ReFusion", PAPER_RULE), BEYOND_PAPER[1], BEYOND_PAPER[2]):
        for ts in parse_floats(args.sweep_slot, "--sweep-slot"):
            for tt in parse_floats(args.sweep_token, "--sweep-token"):
                cfg = base.replace(method="refusion", slot_threshold=ts, token_threshold=tt, **rule)
                runs.append(Run(f"{key}:{ts}:{tt}", f"slot {ts:g}, token {tt:g}", "refusion", cfg, group))
    mdm = base.replace(method="mdm")
    span = -(-mdm.gen_length // mdm.mdm_block_length) * mdm.mdm_block_length
    for k in parse_floats(args.sweep_mdm_tokens_per_step, "--sweep-mdm-tokens-per-step"):
        cfg = mdm.replace(mdm_steps=max(1, int(span // k)), mdm_threshold=None)
        runs.append(Run(f"mdm:k{k:g}", f"{k:g} token/step", "refusion", cfg, "MDM"))
    for t in parse_floats(args.sweep_mdm_threshold, "--sweep-mdm-threshold"):
        cfg = mdm.replace(mdm_steps=None, mdm_threshold=t)
        runs.append(Run(f"mdm:t{t:g}", f"threshold {t:g}", "refusion", cfg, "MDM"))
    if with_ar:
        runs.append(Run("ar", "AR decoding", "ar", base.replace(method="ar"), "AR baseline"))
    return runs


# ---------------------------------------------------------------------------- the command
@writes_results
def run(args: argparse.Namespace) -> int:
    from ..parallel import is_main

    args.model = args.model or args.model_pos
    base, engine = base_config(args), engine_config_from_args(args)
    items = select_items(args.limit, args.families)
    ar_path, note = resolve_ar_model(args.ar_model)
    sweep = planned_sweep(base, args, ar_path is not None)
    json_path, plot_path = output_paths(args)
    models = load_models(args, ar_path)
    main = is_main()
    if note and main:
        print(note, file=sys.stderr)
    result = run_table(base, items, models, args, engine, ar_path)
    if sweep is not None:
        swept = run_sweep(sweep, items[: args.sweep_limit], models, args, engine, plot_path)
        if main:
            result["sweep"] = swept
    if main:
        write_json(json_path, result)
    return 0


def planned_sweep(base: DecodeConfig, args: argparse.Namespace, with_ar: bool) -> list[Run] | None:
    """The sweep's runs (None with --no-sweep). A missing plotting extra fails now, not
    after the table's minutes of decoding."""
    if args.no_sweep:
        return None
    sweep = sweep_runs(base, args, with_ar)
    pyplot()
    return sweep


def output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(the JSON's path, the sweep plot's path): given, or in the output directory."""
    out = Path(args.out)
    json_path = Path(args.json_out) if args.json_out else out / "suite.json"
    plot_path = Path(args.plot) if args.plot else out / "sweep.png"
    return json_path, plot_path


def load_models(args: argparse.Namespace, ar_path: str | None) -> dict[str, tuple]:
    """(model, tokenizer) by weights: "refusion", and "ar" where the baseline is run."""
    models = {"refusion": load_from_args(args)}
    if ar_path is not None:
        from ..io import load

        models["ar"] = load(
            ar_path,
            device=args.device,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size or 1,
            allow_nonfinite=args.allow_nonfinite_weights,
            quantize=args.quantize,  # the baseline quantized as the model is
        )
    return models


def all_table_runs(base: DecodeConfig, models: dict[str, tuple], with_ar: bool) -> list[Run]:
    """The table's rows, then the ReFusion checkpoint's own settings where they differ."""
    runs = table_runs(base, with_ar)
    own = recommended_run(base, recommended_of(models["refusion"][0]), runs)
    return runs + ([own] if own else [])


def chosen_rows(runs: list[Run], rows: str | None) -> list[Run]:
    """The rows `--rows` names (all without it); an unknown key is refused."""
    if rows is None:
        return runs
    keys = [k.strip() for k in rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in {r.key for r in runs}]
    if unknown or not keys:
        raise ConfigError(
            f"--rows: unknown row(s) {', '.join(unknown) or '(none given)'}; rows of this run: "
            + ", ".join(r.key for r in runs)
        )
    return [r for r in runs if r.key in keys]


def run_table(
    base: DecodeConfig,
    items: Sequence,
    models: dict[str, tuple],
    args: argparse.Namespace,
    engine: EngineConfig,
    ar_path: str | None,
) -> dict[str, Any]:
    """The table measured (collective, as `measure`); the result so far, with the table's
    rows, printed, on the first process: it reports, the others take part in measuring only."""
    runs = chosen_rows(all_table_runs(base, models, ar_path is not None), args.rows)
    records = measure(runs, items, models, args.chunk, "table", engine)
    result = run_settings(args, ar_path, items, base)
    if records is not None:  # the first process
        result["table"] = table_rows(runs, records)
        print_table(result["table"], items, base, args.device)
    return result


def run_settings(
    args: argparse.Namespace, ar_path: str | None, items: Sequence, base: DecodeConfig
) -> dict[str, Any]:
    """What the JSON records before the figures: the models, the machine, the items and
    the base config."""
    return {
        "models": {"refusion": args.model or "bundled", "ar": ar_path},
        "device": args.device,
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size or 1,
        "items": len(items),
        "families": sorted({it.family for it in items}),
        "chunk": args.chunk,
        "config": dataclasses.asdict(base),
    }


def run_sweep(
    sweep: Sequence[Run],
    items: Sequence,
    models: dict[str, tuple],
    args: argparse.Namespace,
    engine: EngineConfig,
    plot_path: Path,
) -> dict[str, Any] | None:
    """The sweep measured, printed and plotted; its JSON part on the first process (None
    on the others, which take part in measuring only). Collective, as `measure`."""
    records = measure(sweep, items, models, args.chunk, "sweep", engine)
    if records is None:  # not the first process
        return None
    points, aups, y_max = sweep_points(sweep, records)
    print_sweep(points, aups, len(items))
    plot_sweep(points, aups, plot_path, f"held-out suite, {len(items)} items, batch size 1, {args.device}")
    print(f"figure: {plot_path}")
    return {"items": len(items), "points": points, "aup": aups, "y_max": y_max, "plot": str(plot_path)}


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"figures and per-item records: {path}")
