"""`refusion bench load`: loading a big checkpoint, measured.

Writes a random checkpoint of Qwen3-8B's shapes (bf16, in shards of at most 5 GB with an
index, one tensor in memory at a time) to a temporary folder, then, each in a fresh
process, loads it whole (TP=1) and split over two processes (TP=2), and reports the load
time and the peak resident memory of each process above its baseline (the interpreter
and libraries, measured before loading) against the bytes of the weights, then decodes a
few tokens with it. `--shape tiny` runs the same in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .results import add_results_argument, writes_results

if TYPE_CHECKING:
    from ..settings.model import ModelConfig

# keyword arguments of ModelConfig, by --shape
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-8B's config.json (the released model's shapes)
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "tiny": dict(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", choices=list(SHAPES), default="qwen3-8b", help="model shapes (default qwen3-8b)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the shape's (a quicker run)"
    )
    parser.add_argument(
        "--tensor-parallel",
        default="1,2",
        dest="splits",
        help="comma-separated tensor-parallel sizes to load with (default 1,2)",
    )
    parser.add_argument("--tokens", type=int, default=4, help="tokens to decode after loading (default 4)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write the checkpoint (default: a temporary folder, removed)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_results_argument(parser, "parallel.md")


@writes_results
def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    splits = [int(x) for x in str(args.splits).split(",") if x.strip()]
    if not splits or min(splits) < 1:
        raise ConfigError(f"--tensor-parallel takes sizes like 1,2; got {args.splits!r}")
    work = args.dir or Path(tempfile.mkdtemp(prefix="refusion-bench-load-"))
    try:
        t0 = time.perf_counter()
        index = work / "model.safetensors.index.json"
        if index.is_file() and json.loads((work / "config.json").read_text()) == _config(args).to_hf_dict():
            print(f"reusing the checkpoint in {work}", file=sys.stderr)
            weight_bytes, written = json.loads(index.read_text())["metadata"]["total_size"], None
        else:
            weight_bytes = write_random_checkpoint(work, _config(args))
            written = time.perf_counter() - t0
        results = [measure(work, n, args.tokens) for n in splits]
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "shape": args.shape,
        "layers": _config(args).num_hidden_layers,
        "weight_bytes": weight_bytes,
        "write_s": written,
        "runs": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _config(args: argparse.Namespace) -> ModelConfig:
    from ..settings.model import ModelConfig

    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return ModelConfig(**shape, eos_token_id=2, torch_dtype="bfloat16")


def write_random_checkpoint(directory: Path, config, max_shard_bytes: int | None = None) -> int:
    """config.json and random bf16 weights in shards, one tensor made at a time; returns
    the weights' bytes."""
    import torch
    from safetensors.torch import save_file

    from ..io import MAX_SHARD_BYTES, shard_plan, write_index
    from ..model.transformer import Transformer, stored_shapes

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    shapes = stored_shapes(Transformer.meta(config))
    sizes = {name: 2 * int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    shards = shard_plan(sizes, max_shard_bytes or MAX_SHARD_BYTES)
    gen = torch.Generator().manual_seed(0)
    for file, names in shards:
        tensors = {}
        for name in names:
            norm = "norm" in name
            tensors[name] = (
                torch.randn(shapes[name], generator=gen) * (1.0 if norm else 0.02) + float(norm)
            ).to(torch.bfloat16)
        save_file(tensors, directory / file, metadata={"format": "pt"})
        del tensors
    write_index(directory, shards, sizes)
    return sum(sizes.values())


def measure(directory: Path, tensor_parallel_size: int, tokens: int) -> dict:
    """Load (and decode with) the checkpoint in a fresh process, or `tensor_parallel_size`
    of them; each rank's figures."""
    cmd = [
        sys.executable,
        "-m",
        "refusion.bench.load",
        "--probe",
        str(directory),
        str(tensor_parallel_size),
        str(tokens),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if out.returncode != 0:
        raise RuntimeError(
            f"loading with tensor-parallel size {tensor_parallel_size} failed:\n{out.stderr[-2000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak) of this process in bytes."""
    from ..model.sizing import process_memory_kib

    kib = process_memory_kib()
    return kib[field] * 1024 if kib else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _probe_rank(directory: str, tensor_parallel_size: int, tokens: int) -> dict:
    """In one process: baseline peak RSS, load, peak RSS, a short greedy decode."""
    import torch

    from ..decode.api import generate
    from ..io import load
    from ..settings.decode import DecodeConfig

    torch.ones(8, 8, dtype=torch.bfloat16) @ torch.ones(
        8, 8, dtype=torch.bfloat16
    )  # the libraries' own memory
    baseline = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    model, _ = load(directory, dtype="bfloat16", tensor_parallel_size=tensor_parallel_size)
    load_s = time.perf_counter() - t0
    loaded = _rss_bytes("VmHWM")
    held = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    t0 = time.perf_counter()
    (out,) = generate(
        model, None, [[11, 12, 13, 14, 15, 16, 17, 18]], DecodeConfig(method="ar", gen_length=tokens)
    )
    decode_s = time.perf_counter() - t0
    return {
        "baseline_rss": baseline,
        "peak_rss": loaded,
        "load_peak_above_baseline": loaded - baseline,
        "held_bytes": held,
        "load_s": load_s,
        "decode_s": decode_s,
        "tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
    }


def _gather(directory: str, tensor_parallel_size: int, tokens: int) -> list[dict]:
    import torch.distributed as dist

    mine = _probe_rank(directory, tensor_parallel_size, tokens)
    everyone: list[dict] = [{} for _ in range(dist.get_world_size())]  # each replaced by a rank's
    dist.all_gather_object(everyone, mine)
    return everyone


def _probe(directory: str, tensor_parallel_size: int, tokens: int) -> None:
    if tensor_parallel_size == 1:
        ranks = [_probe_rank(directory, 1, tokens)]
    else:
        import importlib

        from ..parallel import spawn

        here = importlib.import_module(
            "refusion.bench.load"
        )  # by its name: run as __main__ it would not pickle
        ranks = spawn(tensor_parallel_size, here._gather, directory, tensor_parallel_size, tokens)
    print(json.dumps({"tensor_parallel_size": tensor_parallel_size, "ranks": ranks}))


def format_report(report: dict) -> str:
    gb = report["weight_bytes"] / 1e9
    written = "reused" if report["write_s"] is None else f"written in {report['write_s']:.0f} s"
    lines = [
        f"random {report['shape']} checkpoint ({report['layers']} layers, bf16): "
        f"weights {gb:.2f} GB, {written}"
    ]
    lines.append(
        f"{'TP':>3} {'rank':>4} {'load s':>7} {'peak RSS above baseline':>24} {'x weights':>9} "
        f"{'held':>9} {'decode':>14}"
    )
    for run_ in report["runs"]:
        for r, x in enumerate(run_["ranks"]):
            ratio = x["load_peak_above_baseline"] / report["weight_bytes"]
            lines.append(
                f"{run_['tensor_parallel_size']:>3} {r:>4} {x['load_s']:>7.1f} "
                f"{x['load_peak_above_baseline'] / 1e9:>21.2f} GB {ratio:>9.2f} "
                f"{x['held_bytes'] / 1e9:>6.2f} GB "
                f"{x['tokens']} tok {x['decode_s']:>5.1f} s"
            )
    lines.append(
        "peak RSS: the process's peak resident memory (VmHWM) after loading, less its resident memory "
        "before (interpreter and libraries); held: the weights the process keeps"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        _probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: refusion bench load (this module's --probe is the benchmark's own)")
