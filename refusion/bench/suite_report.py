"""`refusion bench suite`'s output: Table 1 and the sweep as printed, and Figure 1's
shape drawn (accuracy against tokens/s and against tokens per forward, each method's
trade-off curve through its undominated points). `pyplot` is shared with `bench curve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..decode import DecodeConfig
from ..errors import MissingExtraError


def print_table(rows: list[dict[str, Any]], items: Sequence, base: DecodeConfig, device: str) -> None:
    families = list(dict.fromkeys(it.family for it in items))
    counts = ", ".join(f"{f} {sum(it.family == f for it in items)}" for f in families)
    decoding = "greedy" if base.greedy else f"temperature {base.temperature:g}"
    print(
        f"held-out suite: {len(items)} items ({counts}); {decoding}, batch size 1, {device}, "
        "one interleaved run"
    )
    print(
        f"gen_length {base.gen_length}; ReFusion slot_size {base.slot_size}, "
        f"serial_blocks {base.serial_blocks}, "
        f"slot_threshold {base.slot_threshold:g}, token_threshold {base.token_threshold:g}; "
        f"MDM block {base.mdm_block_length}, steps {base.mdm_steps or 'one token each'}"
        + (f", threshold {base.mdm_threshold:g}" if base.mdm_threshold is not None else "")
    )
    fam_heads = "".join(f" {f[:6]:>6}" for f in families)
    print(
        f"{'method':34} {'acc%':>6}{fam_heads} {'tok/s':>8} {'vs AR':>6} {'TPF':>5} {'NFE':>7} {'NFE/it':>7}"
    )
    for r in rows:
        fam = "".join(f" {100 * r['per_family'].get(f, 0.0):6.1f}" for f in families)
        ratio = f"{r['vs_ar']:.2f}x" if r["vs_ar"] is not None else "-"
        print(
            f"{r['label']:34} {100 * r['accuracy']:6.1f}{fam} {r['tokens_per_s']:8.1f} {ratio:>6} "
            f"{r['tpf']:5.2f} {r['nfe']:7d} {r['nfe_per_item']:7.1f}"
        )


def print_sweep(points: list[dict[str, Any]], aups: dict[str, float], n_items: int) -> None:
    print(f"\nsweep on {n_items} items: accuracy against throughput (AUP over TPF, d3LLM definition)")
    print(f"{'method':12} {'setting':22} {'acc%':>6} {'tok/s':>8} {'TPF':>5}")
    for p in points:
        print(
            f"{p['method']:12} {p['label']:22} {100 * p['accuracy']:6.1f} "
            f"{p['tokens_per_s']:8.1f} {p['tpf']:5.2f}"
        )
    print("AUP: " + ", ".join(f"{g} {v:.1f}" for g, v in aups.items()))


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(
            "the sweep plot needs matplotlib: pip install 'refusion[plot]', "
            "or scripts/setup.sh plot in a checkout (or pass --no-sweep)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def frontier(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes, left to right (the trade-off curve)."""
    best, out = float("-inf"), []
    for x, y in sorted(pts, key=lambda p: (-p[0], -p[1])):
        if y > best:
            out.append((x, y))
            best = y
    return out[::-1]


def plot_sweep(points: list[dict[str, Any]], aups: dict[str, float], path: Path, title: str) -> None:
    """Figure 1's shape: accuracy against tokens/s (left) and against TPF (right)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for g, color in zip(aups, ("tab:red", "tab:orange", "tab:blue", "tab:gray", "tab:green")):
        mine = [p for p in points if p["method"] == g]
        for ax, x in zip(axes, ("tokens_per_s", "tpf")):
            pts = [(p[x], 100 * p["accuracy"]) for p in mine]
            marker = "*" if len(pts) == 1 else "o"
            ax.scatter(
                *zip(*pts),
                color=color,
                marker=marker,
                s=160 if marker == "*" else 30,
                label=f"{g} (AUP {aups[g]:.1f})",
                zorder=3,
            )
            if len(pts) > 1:
                ax.plot(*zip(*frontier(pts)), color=color, alpha=0.6)
    axes[0].set_xlabel("throughput (tokens / s)")
    axes[1].set_xlabel("parallelism (tokens per forward)")
    for ax in axes:
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[1].legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
