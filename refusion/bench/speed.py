"""`refusion bench speed [MODEL]`: how far our forward and AR decode are from the machine
and from `transformers`, side by side in one run.

Four sections, every figure a median over interleaved rounds (the machine is shared, so
what is compared is measured in the same minute):

  a. the machine's floors on the model's device: copy bandwidth (GB/s) and the matmul rate
     (GFLOP/s) in the model's dtype;
  b. ms per forward of 1 and s tokens on a cache of `--cache-len` entries, ours against the
     floor max(bytes / bandwidth, flops / matmul rate) and against transformers' forward
     with a DynamicCache of the same length (both built from the same weights);
  c. greedy AR decode tokens/s, batch 1, a fixed number of new tokens (EOS ignored on both
     sides), ours against transformers' `generate`, with a token-for-token check;
  d. ReFusion against our AR on a few suite prompts, when the model has a MASK token.

MODEL is anything `refusion.load` takes, or `random:NAME` (a randomly initialised model of
one of RANDOM_SHAPES, for speed only). `--compile` adds the compiled forward
(`decode.forward.CompiledStep`) to sections b and c: its forwards against the same floors,
and its AR decode against `generate`, with its tokens checked against our eager decode.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cli.flags import (
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    engine_config_from_args,
)
from ..decode import DecodeConfig, EngineConfig, generate
from ..decode.forward import compiled_step
from ..model.prompts import encode_prompt, mask_id_of
from ..model.transformer import Transformer
from ..settings.model import ModelConfig
from ..timing import calibrate, median, time_ms
from .decode import (
    agreement,
    bench_prompts,
    calibrate_widths,
    paired_vs_ar,
    quantized_models,
    timed,
    turn,
)

# Shapes of randomly initialised models (`random:NAME`): speed does not depend on the values.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # the real Qwen3-0.6B config, plus a MASK token just past Qwen3's 151669 tokenizer ids
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        mask_token_id=151669,
    ),
    # the same family scaled down until a CPU runs the whole GPU check in minutes
    "small": dict(
        model_type="qwen3",
        vocab_size=32768,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        mask_token_id=32767,
    ),
}
TARGET_AR_VS_HF = 1.5  # speed target: our AR decode at least this many times transformers' tokens/s
TARGET_FORWARD_VS_FLOOR = 1.5  # speed target: a 1-token forward within this factor of the machine's floor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help=f"as --model, or random:{{{','.join(RANDOM_SHAPES)}}}"
    )
    add_model_arguments(parser)
    add_decode_arguments(parser)
    g = parser.add_argument_group("speed")
    g.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds of sections a and b; medians are reported"
    )
    g.add_argument("--decode-rounds", type=int, default=3, help="interleaved rounds of sections c and d")
    g.add_argument("--cache-len", type=int, default=200, help="cache entries before each timed forward")
    g.add_argument("--sizes", default="1,4,8,16,32", help="tokens per timed forward")
    g.add_argument(
        "--new-tokens", type=int, default=64, help="AR decode: tokens generated per run (EOS ignored)"
    )
    g.add_argument(
        "--prompts", type=int, default=4, help="ReFusion vs AR: how many suite prompts (default: 4)"
    )
    g.add_argument(
        "--sample-ms", type=float, default=25.0, help="a timed sample repeats the call for about this long"
    )
    g.add_argument(
        "--bw-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth floor (default 256 on cpu, 2048 on cuda)",
    )
    g.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="square matmul size for the rate floor (default 1024 cpu, 8192 cuda)",
    )
    g.add_argument(
        "--hf",
        choices=["auto", "off"],
        default="auto",
        help="compare with transformers (auto: when it is installed)",
    )
    g.add_argument(
        "--quantized",
        default="",
        metavar="SCHEMES",
        help="section e: the model quantized with each scheme (comma-separated: int8,int4), its forwards and "
        "AR decode interleaved with the unquantized model's, and each one's peak memory in a fresh process",
    )
    g.add_argument("--json", dest="json_out", default=None, help="also write every figure to this JSON file")


# ---------------------------------------------------------------------------- models
def random_model(
    name: str, device: str | torch.device, dtype: torch.dtype | None = None, seed: int = 0
) -> Transformer:
    """A randomly initialised model of RANDOM_SHAPES[name], built directly on the device
    (a 0.6B model initialised on a CPU first would take longer than the benchmark).
    Matrices are drawn as transformers initialises them (normal, std 0.02): near-uniform
    next-token distributions, so no decoder finds a shortcut that trained weights lack."""
    if name not in RANDOM_SHAPES:
        raise SystemExit(f"unknown random shape {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device), torch.no_grad():
        model = Transformer(ModelConfig(**RANDOM_SHAPES[name]))
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def load_model(
    spec: str | None, device: str, dtype: str | None, allow_nonfinite: bool = False
) -> tuple[Transformer, Any]:
    """(model, tokenizer) for a checkpoint path / hub id / None (bundled), or `random:NAME`
    (tokenizer None: prompts then come from the bundled tokenizer's ids)."""
    if spec and spec.startswith("random:"):
        from ..io import parse_dtype

        return random_model(spec.split(":", 1)[1], device, parse_dtype(dtype, torch.device(device))), None
    from ..io import load

    return load(spec, device=device, dtype=dtype, allow_nonfinite=allow_nonfinite)


def hf_twin(model: Transformer) -> Any:
    """The same weights in a `transformers` model (sdpa attention), or None when transformers
    is not installed. Built from our config and state dict, so one load serves both sides
    (a GGUF de-quantisation takes tens of seconds). EOS is removed from its generation
    config so that `generate` runs exactly the requested number of tokens, as ours does."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    config = AutoConfig.for_model(**model.config.to_hf_dict())
    with torch.device(model.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"transformers twin does not match our weights: missing {missing}, unexpected {unexpected}"
        )
    hf.config.eos_token_id = None
    hf.generation_config.eos_token_id = None
    return hf.eval()


def suite_prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """Chat-templated ids of n suite prompts; a model without a tokenizer borrows the
    bundled one (its ids are small, so they are valid in any larger vocabulary)."""
    if tokenizer is None:
        from ..io import load_metadata

        tokenizer = load_metadata(None)[1]
    return [encode_prompt(tokenizer, p) for p in bench_prompts(n)]


# ---------------------------------------------------------------------------- floors
def floor_ms(
    weight_bytes: float, kv_bytes: float, flops: float, bandwidth_gbs: float, matmul_gflops: float
) -> float:
    """The least time a forward can take on this machine: it must stream its weights and the
    KV entries it reads once, and do its flops at the best matmul rate; whichever is slower
    bounds it. Bandwidth in GB/s, rate in GFLOP/s, result in ms."""
    stream_s = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)
    compute_s = flops / (matmul_gflops * 1e9)
    return 1e3 * max(stream_s, compute_s)


@dataclass
class ForwardCost:
    """What one forward of `tokens` new tokens on a cache of `cache_len` entries must do."""

    tokens: int
    weight_bytes: int  # weights read once (the embedding table only when it is the tied lm_head)
    kv_bytes: int  # keys and values read by attention
    flops: float  # 2 x matmul parameters x tokens, plus attention's two products


def forward_cost(model: Transformer, cache_len: int, tokens: int) -> ForwardCost:
    """The floor's inputs for one forward, from the model's own shapes."""
    c, item = model.config, model.dtype.itemsize
    unique = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() for p in unique) * item
    if not c.tie_word_embeddings:  # an untied embedding table is only gathered from, not read whole
        weight_bytes -= (model.model.embed_tokens.weight.numel() - tokens * c.hidden_size) * item
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    seen = cache_len + tokens
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * seen * item
    attn_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seen * tokens
    return ForwardCost(tokens, weight_bytes, kv_bytes, 2.0 * sum(linear.values()) * tokens + attn_flops)


class MachineProbe:
    """The two floors, measured on the model's device with buffers allocated once."""

    def __init__(self, device: torch.device, dtype: torch.dtype, bw_mib: int, matmul_n: int) -> None:
        self.device = device
        n = bw_mib * 2**20 // 4
        self.src = torch.ones(n, dtype=torch.float32, device=device)
        self.dst = torch.empty_like(self.src)
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.a = torch.randn(matmul_n, matmul_n, generator=gen).to(device=device, dtype=dtype)
        self.b = torch.randn(matmul_n, matmul_n, generator=gen).to(device=device, dtype=dtype)
        self.bandwidth_gbs(), self.matmul_gflops()  # warm-up: first-touch pages, BLAS handles

    def bandwidth_gbs(self) -> float:
        """Copy bandwidth: bytes read plus bytes written, per second."""
        ms = time_ms(lambda: self.dst.copy_(self.src), self.device, 1)
        return 2 * self.src.numel() * 4 / (ms * 1e6)

    def matmul_gflops(self) -> float:
        ms = time_ms(lambda: torch.mm(self.a, self.b), self.device, 1)
        return 2 * self.a.shape[0] ** 3 / (ms * 1e6)


# ---------------------------------------------------------------------------- timing
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


# ---------------------------------------------------------------------------- sections
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
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, C + max(sizes)), generator=gen).to(dev)
    impls = {"ours": OurForward(model, ids[:, :C], max(sizes))}
    if hf is not None:
        impls["hf"] = HFForward(hf, ids[:, :C])
    if args.compile:
        impls["compiled"] = CompiledForward(model, ids[:, :C], max(sizes))
    for scheme, qmodel in (quantized or {}).items():
        impls[scheme] = OurForward(qmodel, ids[:, :C], max(sizes))
    calls: dict[tuple[str, int], Callable[[], Any]] = {}
    for s in sizes:
        toks, pos = ids[:, C : C + s], torch.arange(C, C + s, device=dev)[None]
        for name, impl in impls.items():
            calls[(name, s)] = lambda impl=impl, toks=toks, pos=pos: impl(toks, pos)
    inner = {key: calibrate(fn, dev, args.sample_ms) for key, fn in calls.items()}
    samples: dict[Any, list[float]] = {key: [] for key in calls} | {"bw": [], "mm": []}
    for _ in range(args.repeats):
        samples["bw"].append(probe.bandwidth_gbs())
        samples["mm"].append(probe.matmul_gflops())
        for key, fn in calls.items():
            samples[key].append(time_ms(fn, dev, inner[key]))
    bw, mm = median(samples["bw"]), median(samples["mm"])
    rows = []
    for s in sizes:
        cost = forward_cost(model, C, s)
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
        if hf is not None:
            row["hf_ms"] = median(samples[("hf", s)])
            row["hf_vs_floor"] = row["hf_ms"] / floor
            row["hf_vs_ours"] = row["hf_ms"] / row["ours_ms"]
        for scheme in quantized or {}:
            row[f"{scheme}_ms"] = median(samples[(scheme, s)])
        rows.append(row)
    floors = {
        "bandwidth_gbs": bw,
        "matmul_gflops": mm,
        "bandwidth_samples": samples["bw"],
        "matmul_samples": samples["mm"],
    }
    return {"floors": floors, "cache_len": C, "forward": rows}


def ar_section(
    model: Transformer,
    hf: Any,
    prompt: list[int],
    args: argparse.Namespace,
    quantized: dict[str, Transformer] | None = None,
) -> dict[str, Any]:
    """Section c: greedy AR decode, batch 1, exactly args.new_tokens tokens on both sides
    (and by each quantized copy, for section e)."""
    n, dev = args.new_tokens, model.device
    cfg = DecodeConfig(method="ar", gen_length=n, stop_token_ids=())  # no token ends it
    one = EngineConfig(max_batch_size=1)

    def ours() -> list[int]:
        return generate(model, None, [prompt], cfg, engine_config=one)[0].token_ids

    def theirs() -> list[int]:
        x = torch.tensor([prompt], device=dev)
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

    def compiled() -> list[int]:
        return generate(model, None, [prompt], cfg, engine_config=one.replace(compile=True))[0].token_ids

    def ours_on(qmodel: Transformer) -> Callable[[], list[int]]:
        return lambda: generate(qmodel, None, [prompt], cfg, engine_config=one)[0].token_ids

    runs = (
        {"ours": ours}
        | ({"compiled": compiled} if args.compile else {})
        | ({"hf": theirs} if hf is not None else {})
        | {scheme: ours_on(qmodel) for scheme, qmodel in (quantized or {}).items()}
    )
    out: dict[str, list[int]] = {name: fn() for name, fn in runs.items()}  # warm-up, and the outputs compared
    tps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.decode_rounds):
        for name, fn in runs.items():
            ms = time_ms(fn, dev, 1)
            tps[name].append(len(out[name]) / (ms / 1e3))
    res: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "ours_tps": median(tps["ours"]),
        "ours_tokens": len(out["ours"]),
    }
    if args.compile:
        res["compiled_tps"] = median(tps["compiled"])
        res["compiled_equal"] = out["compiled"] == out["ours"]
    if hf is not None:
        res["hf_tps"] = median(tps["hf"])
        res["ours_vs_hf"] = res["ours_tps"] / res["hf_tps"]
        res["equal"] = out["ours"] == out["hf"]
        res["first_difference"] = next(
            (i for i, (a, b) in enumerate(zip(out["ours"], out["hf"])) if a != b), None
        )
        if args.compile:
            res["compiled_vs_hf"] = res["compiled_tps"] / res["hf_tps"]
    for scheme in quantized or {}:
        res[f"{scheme}_tps"] = median(tps[scheme])
        res[f"{scheme}_agreement"] = agreement([out[scheme]], [out["ours"]])[0]
    return res


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
    calibrate_widths(model, tokenizer, prompts, base.replace(method="refusion"), one)
    rows: dict[str, list[dict[str, Any]]] = {"ar": [], "refusion": []}
    for i in range(args.decode_rounds):
        for m in turn(list(rows), i):
            rows[m].append(timed(model, tokenizer, prompts, base.replace(method=m), one))
    table = {m: {k: median([r[k] for r in rs]) for k in rs[0]} for m, rs in rows.items()}
    table["refusion"].update(paired_vs_ar(rows, "refusion"))
    return {"prompts": len(prompts), "gen_length": base.gen_length, **table}


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


# ---------------------------------------------------------------------------- report
def print_report(fig: dict[str, Any]) -> None:
    f = fig["floors"]
    print(f"{fig['model']} on {fig['device']}, {fig['dtype']}, {fig['parameters'] / 1e6:.1f}M parameters")
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
    a = fig["ar_decode"]
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
    d = fig["refusion"]
    if "skipped" in d:
        print(f"\nd. ReFusion vs AR: skipped: {d['skipped']}")
    else:
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
    if "quantized" in fig:
        print_quantized(fig["quantized"], fig)
    print("\nspeed targets (1-token forward vs floor, AR decode vs transformers):")
    for t in fig["targets"]:
        print(f"  {t['name']}: {t['value']:.2f} (want {t['want']}) {'met' if t['met'] else 'NOT met'}")


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


def run(args: argparse.Namespace) -> int:
    spec = args.model or args.model_pos
    model, tokenizer = load_model(spec, args.device, args.dtype, args.allow_nonfinite_weights)
    hf = hf_twin(model) if args.hf == "auto" else None
    dev = model.device
    bw_mib = args.bw_mib or (2048 if dev.type == "cuda" else 256)
    matmul_n = args.matmul_n or (8192 if dev.type == "cuda" else 1024)
    probe = MachineProbe(dev, model.dtype, bw_mib, matmul_n)
    prompts = suite_prompt_ids(tokenizer, max(1, args.prompts))
    fig: dict[str, Any] = {
        "model": spec or "bundled",
        "device": str(dev),
        "dtype": str(model.dtype).removeprefix("torch."),
        "parameters": model.num_parameters(),
        "threads": torch.get_num_threads(),
        "settings": {
            k: getattr(args, k)
            for k in ("repeats", "decode_rounds", "cache_len", "sizes", "new_tokens", "prompts")
        }
        | {"bw_mib": bw_mib, "matmul_n": matmul_n},
    }
    quantized = {k: m for k, m in quantized_models(model, args.quantized).items() if k is not None}
    fig |= forward_section(model, hf, probe, args, quantized)
    fig["ar_decode"] = ar_section(model, hf, prompts[0], args, quantized)
    if quantized:
        fig["quantized"] = quantized_section(fig, model, tokenizer, quantized, prompts[0], args)
    fig["refusion"] = refusion_section(model, tokenizer, prompts, args)
    fig["targets"] = targets(fig)
    print_report(fig)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(fig, f, indent=2)
    return 0
