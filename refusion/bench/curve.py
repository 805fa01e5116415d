"""`refusion bench curve RUN`: how much ReFusion training a converted model needs.

A `refusion train` run keeps a checkpoint every --save-every steps. This decodes the
held-out suite (`refusion.tasks`) with ReFusion (or `--method`'s decoding) at every
`--every`-th one (and at the run's base model, step 0, and its final model), greedy,
batch size 1, at fixed draft widths, with the settings `bench suite` uses (decoding flags
on top), and reads
the held-out AR and MDM parts of the loss from the run's log. Printed as a table,
written as JSON, and drawn: accuracy per family, tokens per forward and the two losses
against training steps, with the base model's own AR decoding as the line to reach. Run
again as training goes on, it decodes only the checkpoints its JSON does not hold yet
(same settings). With --prompts-from it decodes a file's prompts instead (a real model's
held-out prompts), and a point's score is the share of greedy outputs identical to the
file's answers: for answers `refusion distill` wrote, how close the model stays to the one
it was trained from.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..cli.flags import add_decode_arguments, decode_config_from_args
from ..decode import DecodeConfig, RequestOutput
from ..errors import CheckpointError, ConfigError
from .decode_report import same_as_answer
from .reach import EVERY, OFFSETS, draft_reach, summarise_reach
from .results import add_results_argument, writes_results
from .suite import SUITE_DEFAULTS, select_items
from .suite_measure import decode_item, summarise
from .suite_report import pyplot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN", help="a `refusion train` output directory (its checkpoints/ and log.jsonl)"
    )
    parser.add_argument(
        "--every",
        type=int,
        default=500,
        help="decode every checkpoint whose step is a multiple of this (default: 500)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="the model step 0 is (default: the run's --model, from its trainer state)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N held-out items (default: all 600)")
    parser.add_argument("--families", default=None, help="comma-separated task families (default: all)")
    parser.add_argument(
        "--prompts-from",
        metavar="FILE",
        help="decode the prompts of a training-format JSON or JSONL file instead of the suite (held-out "
        "prompts of a real model, such as a split of what `refusion distill` wrote); a point's score is "
        "then the share of greedy outputs identical to the file's answers",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", default=None, help="JSON path (default: RUN/curve.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: RUN/curve.png)")
    add_decode_arguments(parser, engine=False)
    add_results_argument(parser, "learning-curve.md")


def checkpoints(run: Path, every: int) -> list[tuple[int, Path]]:
    """(step, directory) of the run's checkpoints at multiples of `every`, and its final
    model (the run's directory) where no checkpoint holds its last step, in step order."""
    found = {}
    for d in sorted((run / "checkpoints").glob("step-*")):
        m = re.fullmatch(r"step-(\d+)", d.name)
        if m and (d / "config.json").is_file() and int(m.group(1)) % every == 0:  # config.json: written last
            found[int(m.group(1))] = d
    final = _final_step(run)
    if (run / "config.json").is_file() and final is not None and final not in found:
        found[final] = run
    if not found:
        raise CheckpointError(
            f"{run} holds no checkpoints at multiples of {every} steps and no final model: "
            "point at a `refusion train --out` directory, or lower --every"
        )
    return sorted(found.items())


def _final_step(run: Path) -> int | None:
    """The step the run's own directory holds: that of the trainer's last `end` record."""
    ends = [r["step"] for r in _log(run) if r.get("event") == "end"]
    return ends[-1] if ends else None


def _log(run: Path) -> list[dict[str, Any]]:
    path = run / "log.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            continue
    return out


def losses(run: Path) -> list[dict[str, float]]:
    """The held-out losses the trainer logged, by step (the last record of a step wins: a
    resumed run logs its steps again)."""
    by_step = {r["step"]: r for r in _log(run) if "eval_ar_loss" in r}
    return [
        {"step": s, "ar": by_step[s]["eval_ar_loss"], "mdm": by_step[s]["eval_mdm_loss"]}
        for s in sorted(by_step)
    ]


def base_model(run: Path, given: str | None) -> str | None:
    """What step 0 is: --base, else the --model the run was started from (none given: the
    bundled model; a run from --init-config has no step 0). None, with a note, when it
    cannot be found from here."""
    from ..io import load_metadata

    if given:
        return given
    states = sorted((run / "checkpoints").glob("step-*/trainer_state.json"))
    if not states:
        return None
    config = json.loads(states[0].read_text()).get("config", {})
    if config.get("init_config"):
        return None
    model = config.get("model") or "bundled:refusion-tiny"
    try:
        load_metadata(model)
    except Exception as e:  # a relative path from another directory, a hub id offline
        print(
            f"note: no step 0: the run's base model {model!r} is not readable from here ({e}); pass --base",
            file=sys.stderr,
        )
        return None
    return model


def _fingerprint(path: Path | str) -> int | None:
    """When a checkpoint directory was written (its config.json, written last): a point
    decoded from an older run of the same --out is not reused."""
    try:
        return (Path(path) / "config.json").stat().st_mtime_ns
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class FileItem:
    """A prompt of a --prompts-from file, scored by whether the output is the file's answer."""

    prompt: str
    answer: str | None
    family: str = "same"


def file_items(path: str, limit: int | None) -> list[FileItem]:
    from ..train.distill import file_prompts

    items = [FileItem(p.text, p.answer) for p in file_prompts(path)][:limit]
    if not items:
        raise ConfigError(f"{path} holds no prompts: give a file of {{query, response}} or chat records")
    return items


def same_as_file(item: FileItem, index: int, out: RequestOutput, gen_length: int) -> bool:
    cut = len(out.token_ids) >= gen_length
    return item.answer is not None and same_as_answer(out.text, item.answer, cut)


def decode_all(path: str | Path, items, cfg, device: str, dtype: str | None, desc: str) -> dict[str, Any]:
    """A point's figures: each item decoded alone and scored, and how far the model's MASK
    drafts reach along its own greedy AR answer (`reach.draft_reach`): the decoded text
    where the settings are lossless, else an AR decoding of the item."""
    from ..decode import EngineConfig, generate
    from ..decode.api import prepare
    from ..io import load

    model, tokenizer = load(path, device=device, dtype=dtype)
    # Fixed widths: the curve follows what the drafts are worth, which adaptive widths would
    # hide behind AR blocks while they lose (docs/algorithm.md#adaptive-widths).
    engine = EngineConfig(max_batch_size=1, adaptive_drafts=False)
    score = None
    if items and isinstance(items[0], FileItem):
        score = functools.partial(same_as_file, gen_length=cfg.gen_length)
    records, reaches = [], []
    bar = tqdm(items, desc=desc, unit="item", file=sys.stderr, mininterval=1.0, leave=False)
    for i, it in enumerate(bar):
        record, out = decode_item(model, tokenizer, it, i, cfg, engine, score)
        records.append(record)
        if model.config.mask_token_id is None:
            continue
        if not cfg.lossless_now:
            out = generate(model, tokenizer, [it.prompt], cfg.replace(method="ar"), engine_config=engine)[0]
        prompt = prepare(model, tokenizer, [it.prompt], cfg)[0].ids
        reaches.append(draft_reach(model, prompt, out.token_ids))
    return summarise(records) | {"reach": summarise_reach(reaches)}


@writes_results
def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if args.every < 1:
        raise ConfigError(f"--every takes a positive number of steps, got {args.every}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be a positive integer, got {args.limit}")
    # bench suite's settings; --method: another decoding's curve
    cfg = decode_config_from_args(args, base=SUITE_DEFAULTS)
    if args.prompts_from and args.families:
        raise ConfigError("--families picks suite items; with --prompts-from the file's prompts are decoded")
    if args.prompts_from:
        items: Sequence = file_items(args.prompts_from, args.limit)
    else:
        items = select_items(args.limit, args.families)
    points: Sequence[tuple[int, Path | str]] = checkpoints(run_dir, args.every)
    base = base_model(run_dir, args.base)
    if base is not None:
        points = [(0, base)] + [p for p in points if p[0] != 0]
    pyplot()  # a missing extra fails before the decoding
    out = Path(args.out) if args.out else run_dir / "curve.json"
    plot = Path(args.plot) if args.plot else run_dir / "curve.png"
    settings = {
        "run": str(run_dir),
        "items": len(items),
        "families": args.families,
        "prompts_from": args.prompts_from,
        "widths": "fixed",
        "config": dataclasses.asdict(cfg),
        "device": args.device,
        "dtype": args.dtype,
    }
    known = _earlier(out, settings)
    reference = known.get(("ar", str(base)))
    if base is not None and reference is None:
        reference = {
            "model": str(base),
            **decode_all(base, items, cfg.replace(method="ar"), args.device, args.dtype, "base, AR"),
        }
    partial = {**settings, "ar_reference": reference, "losses": []}
    rows = decode_points(
        points, known, items, cfg, args, lambda rows: _write(out, partial | {"points": rows})
    )
    curve = {**settings, "ar_reference": reference, "points": rows, "losses": losses(run_dir)}
    print_curve(curve)
    plot_curve(curve, plot)
    _write(out, curve)
    print(f"figure: {plot}\nfigures: {out}")
    return 0


def decode_points(
    points: Sequence[tuple[int, Path | str]],
    known: dict[Any, dict[str, Any]],
    items: Sequence,
    cfg: DecodeConfig,
    args: argparse.Namespace,
    save: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """Each checkpoint's figures, in step order: an earlier run's point where its checkpoint
    is unchanged (and kept where it has been pruned since), else decoded now; `save` gets
    the points so far after each one, so a curve stopped part-way keeps what it decoded."""
    rows = {p["step"]: p for p in known.values() if "step" in p}
    for step, path in tqdm(points, desc="checkpoints", unit="ckpt", file=sys.stderr):
        row = known.get((step, str(path)))
        if row is None or row.get("fingerprint") != _fingerprint(path):
            try:
                row = {
                    "step": step,
                    "model": str(path),
                    "fingerprint": _fingerprint(path),
                    **decode_all(path, items, cfg, args.device, args.dtype, f"step {step}"),
                }
            except (CheckpointError, OSError) as e:  # pruned by the trainer since it was listed
                print(f"note: step {step} skipped: {e}", file=sys.stderr)
                continue
        rows[step] = row
        save([rows[k] for k in sorted(rows)])
    return [rows[k] for k in sorted(rows)]


def _write(out: Path, curve: dict[str, Any]) -> None:
    """Written after every point (and atomically), so a curve stopped part-way keeps what it decoded."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(curve, indent=1))
    tmp.replace(out)


def _earlier(out: Path, settings: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """The points an earlier run of the same settings wrote to `out`, by (step, model),
    and its AR reference under ("ar", model): a curve re-run as training goes on decodes
    only the new checkpoints."""
    try:
        before = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    if any(before.get(k) != json.loads(json.dumps(v)) for k, v in settings.items()):
        return {}
    known: dict[Any, dict[str, Any]] = {(p["step"], p["model"]): p for p in before.get("points", [])}
    if before.get("ar_reference"):
        known[("ar", before["ar_reference"]["model"])] = before["ar_reference"]
    return known


def print_curve(curve: dict[str, Any]) -> None:
    rows = curve["points"]
    source = curve.get("prompts_from")
    families = [] if source else list(rows[0]["per_family"])
    print(
        f"{_items_name(curve)}, {curve['items']} items, {curve['config']['method']} decoding "
        "(greedy, batch size 1) at each checkpoint"
    )
    if source:
        print(f"same%: greedy outputs identical to the answers in {source} (the start of them, where cut)")
    print(
        "draft@k: the share of MASK drafts equal to the model's own greedy AR token k tokens past the "
        f"known text (every {EVERY}th token of each answer); run: equal drafts in a row from the first"
    )
    print(
        f"{'step':>6} {'same%' if source else 'acc%':>6}"
        + "".join(f" {f[:6]:>6}" for f in families)
        + f" {'TPF':>5} {'tok/s':>7}"
        + "".join(f" {f'draft@{k}':>7}" for k in range(1, OFFSETS + 1))
        + f" {'run':>5}"
    )
    ref = curve["ar_reference"]
    if ref:
        print(
            f"{'AR':>6} {100 * ref['accuracy']:6.1f}"
            + "".join(f" {100 * ref['per_family'][f]:6.1f}" for f in families)
            + f" {ref['tpf']:5.2f} {ref['tokens_per_s']:7.1f}"
            + _reach_columns(ref)
            + "   (the base model, AR decoding)"
        )
    for r in rows:
        print(
            f"{r['step']:6d} {100 * r['accuracy']:6.1f}"
            + "".join(f" {100 * r['per_family'][f]:6.1f}" for f in families)
            + f" {r['tpf']:5.2f} {r['tokens_per_s']:7.1f}"
            + _reach_columns(r)
        )
    if curve["losses"]:
        print(
            "held-out loss (the trainer's): "
            + ", ".join(f"{x['step']}: AR {x['ar']:.4f} MDM {x['mdm']:.4f}" for x in curve["losses"])
        )


def _reach_columns(point: dict[str, Any]) -> str:
    reach = point.get("reach") or {}
    if not reach.get("points"):
        return ""
    return "".join(f" {100 * m:6.1f}%" for m in reach["match"]) + f" {reach['run']:5.2f}"


def _items_name(curve: dict[str, Any]) -> str:
    source = curve.get("prompts_from")
    return f"held-out prompts of {Path(source).name}" if source else "held-out suite"


def plot_curve(curve: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows, ref = curve["points"], curve["ar_reference"]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    ax.plot(steps, [100 * r["accuracy"] for r in rows], color="black", marker="o", label="all")
    for f in [] if curve.get("prompts_from") else rows[0]["per_family"]:
        ax.plot(steps, [100 * r["per_family"][f] for r in rows], marker=".", alpha=0.7, label=f)
    if ref:
        ax.axhline(
            100 * ref["accuracy"],
            color="black",
            linestyle="--",
            label=f"AR decoding of step 0 ({100 * ref['accuracy']:.1f}%)",
        )
    score = "identical to the file's answers" if curve.get("prompts_from") else "held-out accuracy"
    ax.set_ylabel(f"{score} (%)")
    ax.legend(fontsize=8)
    axes[1].plot(steps, [r["tpf"] for r in rows], color="tab:red", marker="o")
    axes[1].set_ylabel(f"tokens per forward ({curve['config']['method']})")
    if curve["losses"]:
        ls = curve["losses"]
        axes[2].plot([x["step"] for x in ls], [x["ar"] for x in ls], marker="o", label="AR part")
        axes[2].plot([x["step"] for x in ls], [x["mdm"] for x in ls], marker="o", label="MDM part")
        axes[2].set_yscale("log")
        axes[2].legend(fontsize=8)
    axes[2].set_ylabel("held-out loss")
    reached = [r for r in rows if (r.get("reach") or {}).get("points")]
    for k in range(OFFSETS):
        axes[3].plot(
            [r["step"] for r in reached],
            [100 * r["reach"]["match"][k] for r in reached],
            marker="o",
            label=f"{k + 1} past the known text",
        )
    axes[3].set_ylabel("MASK drafts equal to greedy AR's token (%)")
    axes[3].set_ylim(0, 100)
    axes[3].legend(fontsize=8)
    for a in axes:
        a.set_xlabel("ReFusion training steps")
        a.grid(alpha=0.3)
    fig.suptitle(f"{curve['run']}: {_items_name(curve)}, {curve['items']} items, greedy, batch size 1")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
