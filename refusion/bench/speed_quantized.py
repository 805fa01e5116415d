"""`refusion bench speed --quantized`'s section e: each quantized copy against the model as
loaded: its weight bytes, its logits' error, the forwards and AR decode timed beside the
loaded model's in sections b and c, and the peak memory of a fresh process that loads the
saved checkpoint and decodes (what the checkpoint costs to run, free of this process's
own allocations).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..model.transformer import Transformer

# A fresh process that loads a saved checkpoint and decodes: its peak resident memory (and,
# on a GPU, the peak the allocator held) is what the checkpoint costs to run.
_PEAK_CHILD = """
import json, sys, torch
import refusion
from refusion.decode import DecodeConfig, EngineConfig, generate
path, device, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
cuda = device.startswith("cuda")
if path != "-":
    model, _ = refusion.load(path, device=device)
    cfg = DecodeConfig(method="ar", gen_length=n, stop_token_ids=())
    generate(model, None, [prompt], cfg, engine_config=EngineConfig(max_batch_size=1))
else:
    torch.ones(1, device=device)
peak = torch.cuda.max_memory_allocated(device) / 1e6 if cuda else 0.0
# VmHWM, not ru_maxrss: the latter carries the parent's peak across fork and exec
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rss_mb": hwm / 1024, "device_mb": peak}))
"""


def peak_memory(path: str, device: str, new_tokens: int, prompt: list[int]) -> dict[str, float]:
    """Peak memory of a fresh process that loads `path` ("-": loads nothing, the
    interpreter's and torch's own) and decodes new_tokens AR tokens."""
    import subprocess
    import sys

    argv = [sys.executable, "-c", _PEAK_CHILD, path, device, str(new_tokens), json.dumps(prompt)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the peak-memory process for {path} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def quantized_section(
    fig: dict[str, Any],
    model: Transformer,
    tokenizer: Any,
    quantized: dict[str, Transformer],
    prompt: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Section e: each quantized copy against the model as loaded: weight bytes, the
    forwards and AR decode timed in sections b and c (interleaved with the loaded
    model's), greedy agreement, and peak memory of a fresh process per checkpoint saved
    to a temporary directory (the loaded model saved too, so each loads the same way)."""
    import tempfile

    from ..io import save_pretrained
    from ..io.quantize import weight_bytes

    out: dict[str, Any] = {"weights": {"loaded": weight_bytes(model)}, "forward": {}, "peak": {}}
    out["logits"] = logit_errors(model, quantized, prompt)
    one = next(r for r in fig["forward"] if r["tokens"] == 1)
    many = fig["forward"][-1]
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tokenizer, f"{tmp}/loaded")
        out["peak"]["nothing loaded"] = peak_memory("-", str(model.device), 0, prompt)
        out["peak"]["loaded"] = peak_memory(f"{tmp}/loaded", str(model.device), args.new_tokens, prompt)
        for scheme, qmodel in quantized.items():
            out["weights"][scheme] = weight_bytes(qmodel)
            out["forward"][scheme] = {
                "one_ms": one[f"{scheme}_ms"],
                "one_vs_loaded": one["ours_ms"] / one[f"{scheme}_ms"],
                "tokens": many["tokens"],
                "many_ms": many[f"{scheme}_ms"],
                "many_vs_loaded": many["ours_ms"] / many[f"{scheme}_ms"],
                "ar_tps": fig["ar_decode"][f"{scheme}_tps"],
                "ar_vs_loaded": fig["ar_decode"][f"{scheme}_tps"] / fig["ar_decode"]["ours_tps"],
                "agreement": fig["ar_decode"][f"{scheme}_agreement"],
            }
            save_pretrained(qmodel, tokenizer, f"{tmp}/{scheme}")
            out["peak"][scheme] = peak_memory(f"{tmp}/{scheme}", str(model.device), args.new_tokens, prompt)
    return out


@torch.inference_mode()
def logit_errors(model: Transformer, quantized: dict[str, Transformer], prompt: list[int]) -> dict[str, Any]:
    """Each quantized copy's logits over the prompt against the loaded model's: max and
    mean absolute error, the loaded logits' mean magnitude, and the share of positions
    whose argmax is kept."""
    ids = torch.tensor([prompt], device=model.device)
    pos = torch.arange(len(prompt), device=model.device)[None]
    ref = model(ids, pos).float()
    out: dict[str, Any] = {"positions": len(prompt), "mean_abs_logit": ref.abs().mean().item()}
    for scheme, qmodel in quantized.items():
        got = qmodel(ids, pos).float()
        err = (got - ref).abs()
        out[scheme] = {
            "max": err.max().item(),
            "mean": err.mean().item(),
            "argmax_kept": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }
    return out


def print_quantized(e: dict[str, Any], fig: dict[str, Any]) -> None:
    """Section e as a table: a row per weights (the model as loaded first)."""
    from ..io.quantize import describe_bytes

    gpu = any(p["device_mb"] for p in e["peak"].values())
    one, many, a = fig["forward"][0], fig["forward"][-1], fig["ar_decode"]
    print(
        "\ne. quantized weights against the model as loaded "
        "(forwards as in b, AR decode as in c, interleaved with it)"
    )
    print(
        f"{'weights':8} {'MB':>7} {str(one['tokens']) + '-token ms':>11} {'x':>6} "
        f"{str(many['tokens']) + '-token ms':>11} {'x':>6} {'AR tok/s':>9} {'x':>6} {'same tokens':>12} "
        f"{'peak RSS MB':>12}" + (f" {'device MB':>9}" if gpu else "")
    )
    loaded = {
        "one_ms": one["ours_ms"],
        "one_vs_loaded": 1.0,
        "many_ms": many["ours_ms"],
        "many_vs_loaded": 1.0,
        "ar_tps": a["ours_tps"],
        "ar_vs_loaded": 1.0,
        "agreement": 1.0,
    }
    for name, f in [("loaded", loaded), *e["forward"].items()]:
        peak = e["peak"][name]
        print(
            f"{name:8} {sum(e['weights'][name].values()) / 1e6:7.1f} {f['one_ms']:11.3f} "
            f"{f['one_vs_loaded']:5.2f}x {f['many_ms']:11.3f} {f['many_vs_loaded']:5.2f}x {f['ar_tps']:9.1f} "
            f"{f['ar_vs_loaded']:5.2f}x {f['agreement']:12.1%} {peak['rss_mb']:12.0f}"
            + (f" {peak['device_mb']:9.0f}" if gpu else "")
        )
    print(
        "x: speed against the model as loaded; same tokens: of its greedy AR tokens in c; peak RSS: a fresh "
        f"process that loads the saved\ncheckpoint and decodes (one that loads nothing: "
        f"{e['peak']['nothing loaded']['rss_mb']:.0f} MB)"
    )
    for name, b in e["weights"].items():
        print(f"  {name}: {describe_bytes(b)}")
    lg = e["logits"]
    print(
        f"logits over the {lg['positions']}-token prompt against the model as loaded "
        f"(mean |logit| {lg['mean_abs_logit']:.3f}):"
    )
    for scheme in e["forward"]:
        r = lg[scheme]
        print(
            f"  {scheme}: max error {r['max']:.4f}, mean {r['mean']:.4f}, "
            f"argmax kept at {r['argmax_kept']:.1%}"
        )
