"""`refusion bench speed`'s timed sections: b, our forward (eager, and compiled with
`--compile`) against transformers' on the same cache, interleaved with the machine's
floors (a); c, greedy AR decode against transformers' `generate`; d, ReFusion against our
AR. Quantized copies (section e) are timed in b and c beside the model as loaded, so
their ratios compare samples of the same minute.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..cli.flags import decode_config_from_args, engine_config_from_args
from ..decode import DecodeConfig, EngineConfig, generate
from ..decode.forward import compiled_step
from ..model.prompts import mask_id_of
from ..model.transformer import Transformer
from ..timing import calibrate, median, time_ms
from .decode import calibrate_widths, paired_vs_ar, timed, turn
from .decode_report import agreement
from .floors import MachineProbe, floor_ms, forward_cost


class OurForward:
    """The decoder's eager forward (`Forward`'s: `packed_hidden` over the cache's packed
    layout) + `lm_head` on s new tokens against a cache of cache_len entries; the cache is
    not advanced, so every call sees the same cache."""

    def __init__(self, model: Transformer, prefix: torch.Tensor, max_new: int) -> None:  # prefix (1, C)
        self.model, self.C = model, prefix.shape[1]
        self.cache = model.new_cache(1, self.C + max_new)
        model.cached_hidden(prefix, torch.arange(self.C, device=model.device)[None], self.cache)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (1, s) each
        layout = self.cache.packed_write(tokens.tolist(), positions.tolist(), plan_runs=True)
        hidden = self.model.packed_hidden(
            *layout.tensors(), segments=layout.segments, masked=layout.masked
        )  # (s, hidden)
        return self.model.lm_head(hidden)


class CompiledForward(OurForward):
    """Our forward as the compiled graph (`--compile`): `decode.forward.CompiledStep`."""

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (1, s) each
        hidden = compiled_step()(
            self.model, tokens.tolist(), positions.tolist(), self.cache
        )  # (s, hidden); not advanced
        return self.model.lm_head(hidden)


class HFForward:
    """transformers' forward of s new tokens with a DynamicCache of cache_len entries,
    cropped back after each call."""

    def __init__(self, hf: Any, prefix: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.hf, self.cache = hf, DynamicCache(config=hf.config)
        # transformers 5.x renamed the argument; the old name still works, with a warning
        self.kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        hf(input_ids=prefix, use_cache=True, **{self.kw: self.cache})

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.hf(
            input_ids=tokens, position_ids=positions, use_cache=True, **{self.kw: self.cache}
        ).logits
        self.cache.crop(-tokens.shape[1])  # negative: remove that many (transformers 4.x and 5.x)
        return logits


@torch.inference_mode()
def forward_section(
    model: Transformer,
    hf: Any,
    probe: MachineProbe,
    args: argparse.Namespace,
    quantized: dict[str, Transformer] | None = None,
) -> dict[str, Any]:
    """Sections a and b: floors and forwards, interleaved round by round (with the
    quantized copies' forwards, for section e)."""
    dev, C = model.device, args.cache_len
    sizes = [int(s) for s in args.sizes.split(",")]
    calls = forward_calls(model, hf, args, sizes, quantized or {})
    inner = {key: calibrate(fn, dev, args.sample_ms) for key, fn in calls.items()}
    samples: dict[Any, list[float]] = {key: [] for key in calls} | {"bw": [], "mm": []}
    for _ in range(args.repeats):
        samples["bw"].append(probe.bandwidth_gbs())
        samples["mm"].append(probe.matmul_gflops())
        for key, fn in calls.items():
            samples[key].append(time_ms(fn, dev, inner[key]))
    bw, mm = median(samples["bw"]), median(samples["mm"])
    floors = {
        "bandwidth_gbs": bw,
        "matmul_gflops": mm,
        "bandwidth_samples": samples["bw"],
        "matmul_samples": samples["mm"],
    }
    rows = [forward_row(model, C, s, samples, bw, mm, list(quantized or {})) for s in sizes]
    return {"floors": floors, "cache_len": C, "forward": rows}


def forward_calls(
    model: Transformer,
    hf: Any,
    args: argparse.Namespace,
    sizes: list[int],
    quantized: dict[str, Transformer],
) -> dict[tuple[str, int], Callable[[], Any]]:
    """One call per (implementation, tokens): each forward of `tokens` random tokens after
    the same `--cache-len` random ones, its cache left as it was."""
    dev, C = model.device, args.cache_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, C + max(sizes)), generator=gen).to(dev)
    impls: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "ours": OurForward(model, ids[:, :C], max(sizes))
    }
    if hf is not None:
        impls["hf"] = HFForward(hf, ids[:, :C])
    if args.compile:
        impls["compiled"] = CompiledForward(model, ids[:, :C], max(sizes))
    for scheme, qmodel in quantized.items():
        impls[scheme] = OurForward(qmodel, ids[:, :C], max(sizes))
    calls: dict[tuple[str, int], Callable[[], Any]] = {}
    for s in sizes:
        toks, pos = ids[:, C : C + s], torch.arange(C, C + s, device=dev)[None]
        for name, impl in impls.items():
            calls[(name, s)] = functools.partial(impl, toks, pos)
    return calls


def forward_row(
    model: Transformer,
    cache_len: int,
    s: int,
    samples: dict[Any, list[float]],
    bw: float,
    mm: float,
    schemes: list[str],
) -> dict[str, Any]:
    """Section b's row for forwards of s tokens: the floor's inputs and the floor, and each
    implementation's median ms with its ratios (a quantized copy's, of `schemes`, without)."""
    cost = forward_cost(model, cache_len, s)
    floor = floor_ms(cost.weight_bytes, cost.kv_bytes, cost.flops, bw, mm)
    row = {
        "tokens": s,
        "weight_bytes": cost.weight_bytes,
        "kv_bytes": cost.kv_bytes,
        "flops": cost.flops,
        "floor_ms": floor,
        "ours_ms": median(samples[("ours", s)]),
    }
    row["ours_vs_floor"] = row["ours_ms"] / floor
    if ("compiled", s) in samples:
        row["compiled_ms"] = median(samples[("compiled", s)])
        row["compiled_vs_floor"] = row["compiled_ms"] / floor
    if ("hf", s) in samples:
        row["hf_ms"] = median(samples[("hf", s)])
        row["hf_vs_floor"] = row["hf_ms"] / floor
        row["hf_vs_ours"] = row["hf_ms"] / row["ours_ms"]
    for scheme in schemes:
        row[f"{scheme}_ms"] = median(samples[(scheme, s)])
    return row


def ar_section(
    model: Transformer,
    hf: Any,
    prompt: list[int],
    args: argparse.Namespace,
    quantized: dict[str, Transformer] | None = None,
) -> dict[str, Any]:
    """Section c: greedy AR decode, batch 1, exactly args.new_tokens tokens on both sides
    (and by each quantized copy, for section e)."""
    runs = ar_runs(model, hf, prompt, args, quantized or {})
    out: dict[str, list[int]] = {name: fn() for name, fn in runs.items()}  # warm-up, and the outputs compared
    tps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.decode_rounds):
        for name, fn in runs.items():
            ms = time_ms(fn, model.device, 1)
            tps[name].append(len(out[name]) / (ms / 1e3))
    res: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "ours_tps": median(tps["ours"]),
        "ours_tokens": len(out["ours"]),
    }
    if "compiled" in runs:
        res["compiled_tps"] = median(tps["compiled"])
        res["compiled_equal"] = out["compiled"] == out["ours"]
    if "hf" in runs:
        res["hf_tps"] = median(tps["hf"])
        res["ours_vs_hf"] = res["ours_tps"] / res["hf_tps"]
        res["equal"] = out["ours"] == out["hf"]
        res["first_difference"] = next(
            (i for i, (a, b) in enumerate(zip(out["ours"], out["hf"])) if a != b), None
        )
        if "compiled" in runs:
            res["compiled_vs_hf"] = res["compiled_tps"] / res["hf_tps"]
    for scheme in quantized or {}:
        res[f"{scheme}_tps"] = median(tps[scheme])
        res[f"{scheme}_agreement"] = agreement([out[scheme]], [out["ours"]])[0]
    return res


def ar_runs(
    model: Transformer,
    hf: Any,
    prompt: list[int],
    args: argparse.Namespace,
    quantized: dict[str, Transformer],
) -> dict[str, Callable[[], list[int]]]:
    """Section c's decoders by name, each returning its new tokens: ours, compiled (with
    `--compile`), transformers' `generate` (when compared), and each quantized copy."""
    n = args.new_tokens
    cfg = DecodeConfig(method="ar", gen_length=n, stop_token_ids=())  # no token ends it
    one = EngineConfig(max_batch_size=1)

    def ours_on(m: Transformer, engine: EngineConfig) -> Callable[[], list[int]]:
        return lambda: generate(m, None, [prompt], cfg, engine_config=engine)[0].token_ids

    def theirs() -> list[int]:
        x = torch.tensor([prompt], device=model.device)
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
        return y[0, x.shape[1] :].tolist()

    return (
        {"ours": ours_on(model, one)}
        | ({"compiled": ours_on(model, one.replace(compile=True))} if args.compile else {})
        | ({"hf": theirs} if hf is not None else {})
        | {scheme: ours_on(qmodel, one) for scheme, qmodel in quantized.items()}
    )


def refusion_section(
    model: Transformer, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Section d: ReFusion against our AR (EOS honoured: real decoding), batch 1."""
    if mask_id_of(model.config, tokenizer) is None:
        return {"skipped": "the model has no MASK token (run `refusion convert`, then train)"}
    base, one = (
        decode_config_from_args(args, model=model),
        engine_config_from_args(args).replace(max_batch_size=1),
    )
    calibrate_widths(model, tokenizer, prompts[:1], base.replace(method="refusion"), one)
    rows: dict[str, list[dict[str, Any]]] = {"ar": [], "refusion": []}
    for i in range(args.decode_rounds):
        for m in turn(list(rows), i):
            rows[m].append(timed(model, tokenizer, prompts, base.replace(method=m), one))
    table = {m: {k: median([r[k] for r in rs]) for k in rs[0]} for m, rs in rows.items()}
    table["refusion"].update(paired_vs_ar(rows, "refusion"))
    return {"prompts": len(prompts), "gen_length": base.gen_length, **table}
