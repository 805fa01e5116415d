"""`refusion bench speed`'s report: sections a to e as printed, and the two speed targets
(a 1-token forward within 1.5x the machine's floor, AR decode at 1.5x transformers'),
each with the figure it reads, so a run says plainly whether it met them."""

from __future__ import annotations

from typing import Any

from .speed_quantized import print_quantized

TARGET_AR_VS_HF = 1.5  # speed target: our AR decode at least this many times transformers' tokens/s
TARGET_FORWARD_VS_FLOOR = 1.5  # speed target: a 1-token forward within this factor of the machine's floor


def print_report(fig: dict[str, Any]) -> None:
    """Every section of a run's figures, in order, then the targets."""
    print(f"{fig['model']} on {fig['device']}, {fig['dtype']}, {fig['parameters'] / 1e6:.1f}M parameters")
    print_forwards(fig)
    print_ar_decode(fig["ar_decode"])
    print_refusion(fig["refusion"])
    if "quantized" in fig:
        print_quantized(fig["quantized"], fig)
    print("\nspeed targets (1-token forward vs floor, AR decode vs transformers):")
    for t in fig["targets"]:
        print(f"  {t['name']}: {t['value']:.2f} (want {t['want']}) {'met' if t['met'] else 'NOT met'}")


def print_forwards(fig: dict[str, Any]) -> None:
    """Sections a and b: the floors, then ms per forward against them (and transformers')."""
    f = fig["floors"]
    print(
        f"a. floors: copy bandwidth {f['bandwidth_gbs']:.1f} GB/s, matmul {f['matmul_gflops']:.1f} GFLOP/s "
        f"(median of {len(f['bandwidth_samples'])})"
    )
    has_hf = "hf_ms" in fig["forward"][0]
    print(f"\nb. ms per forward on a cache of {fig['cache_len']} entries (lm_head on every new token)")
    print(
        f"{'tokens':>6} {'floor':>8} {'ours':>8} {'/floor':>7}"
        + (f" {'hf':>8} {'/floor':>7} {'hf/ours':>8}" if has_hf else "")
    )
    for r in fig["forward"]:
        line = f"{r['tokens']:6d} {r['floor_ms']:8.3f} {r['ours_ms']:8.3f} {r['ours_vs_floor']:6.2f}x"
        if has_hf:
            line += f" {r['hf_ms']:8.3f} {r['hf_vs_floor']:6.2f}x {r['hf_vs_ours']:7.2f}x"
        print(line)
        if "compiled_ms" in r:
            vs_hf = f", hf/compiled {r['hf_ms'] / r['compiled_ms']:.2f}x" if has_hf else ""
            print(
                f"{'':6} compiled (--compile): {r['compiled_ms']:.3f} ms, "
                f"{r['compiled_vs_floor']:.2f}x the floor{vs_hf}"
            )


def print_ar_decode(a: dict[str, Any]) -> None:
    """Section c: our greedy AR decode against transformers' `generate`, outputs compared."""
    print(
        f"\nc. greedy AR decode, batch 1, {a['new_tokens']} new tokens "
        f"after {a['prompt_tokens']} prompt tokens (EOS ignored)"
    )
    print(f"ours {a['ours_tps']:.1f} tok/s", end="")
    if "hf_tps" in a:
        same = "identical" if a["equal"] else f"DIFFERENT from token {a['first_difference']}"
        print(
            f", transformers generate {a['hf_tps']:.1f} tok/s, ours/hf {a['ours_vs_hf']:.2f}x; outputs {same}"
        )
    else:
        print(" (transformers not compared)")
    if "compiled_tps" in a:
        same = "identical to ours eager" if a["compiled_equal"] else "DIFFERENT from ours eager"
        vs_hf = f", compiled/hf {a['compiled_vs_hf']:.2f}x" if "compiled_vs_hf" in a else ""
        print(f"ours compiled (--compile) {a['compiled_tps']:.1f} tok/s{vs_hf}; outputs {same}")


def print_refusion(d: dict[str, Any]) -> None:
    """Section d: ReFusion against our AR on suite prompts, or why it was skipped."""
    if "skipped" in d:
        print(f"\nd. ReFusion vs AR: skipped: {d['skipped']}")
        return
    print(f"\nd. ReFusion vs our AR, {d['prompts']} suite prompts, batch 1, gen_length {d['gen_length']}")
    print(f"{'method':10} {'tokens':>7} {'NFE':>6} {'TPF':>6} {'tok/s':>8} {'ms/fwd':>7} {'overhead':>9}")
    for m in ("ar", "refusion"):
        r = d[m]
        overhead = f"{r['overhead']:9.1%}" if "overhead" in r else f"{'-':>9}"
        print(
            f"{m:10} {r['tokens']:7.0f} {r['nfe']:6.0f} {r['tpf']:6.2f} {r['tps']:8.1f} "
            f"{1e3 * r['wall'] / r['nfe']:7.2f} {overhead}"
        )
    print("overhead: share of decode time outside forward passes (decoder logic, sampling, bookkeeping)")
    print(f"ReFusion / AR tokens/s: {d['refusion']['vs_ar']:.2f}x")


def targets(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The two speed targets (forward vs floor, AR decode vs transformers), each with the figure it reads."""
    out = []
    one = next((r for r in fig["forward"] if r["tokens"] == 1), None)
    if one is not None:
        for key, how in (("ours_vs_floor", ""), ("compiled_vs_floor", ", compiled")):
            if key in one:
                v = one[key]
                out.append(
                    {
                        "name": f"1-token forward / floor{how}",
                        "value": v,
                        "want": f"<= {TARGET_FORWARD_VS_FLOOR}",
                        "met": v <= TARGET_FORWARD_VS_FLOOR,
                    }
                )
    for key, how in (("ours_vs_hf", ""), ("compiled_vs_hf", ", compiled")):
        if key in fig["ar_decode"]:
            v = fig["ar_decode"][key]
            out.append(
                {
                    "name": f"AR decode tok/s, ours / transformers{how}",
                    "value": v,
                    "want": f">= {TARGET_AR_VS_HF}",
                    "met": v >= TARGET_AR_VS_HF,
                }
            )
    return out
