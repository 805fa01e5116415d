"""`refusion bench load` on the tiny shape: it writes a sharded bf16 checkpoint, loads it
whole and split, and reports each process's memory against the weights."""

from __future__ import annotations

import json

import torch

from refusion.bench.load import SHAPES, write_random_checkpoint
from refusion.cli.dispatch import main
from refusion.io import load
from refusion.settings.model import ModelConfig


def test_random_checkpoint_is_sharded_bf16_and_loads(tmp_path):
    config = ModelConfig(**SHAPES["tiny"], eos_token_id=2, torch_dtype="bfloat16")
    total = write_random_checkpoint(tmp_path, config, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total and len(set(index["weight_map"].values())) > 2
    model, _ = load(tmp_path)
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() * 2 for p in model.parameters()) == total


def test_bench_load_reports_every_rank(tmp_path, capfd):
    assert (
        main(["bench", "load", "--shape", "tiny", "--tokens", "3", "--json", "--dir", str(tmp_path / "ckpt")])
        == 0
    )
    report = json.loads(capfd.readouterr().out)
    (whole,), split = (r["ranks"] for r in report["runs"])
    assert whole["held_bytes"] == report["weight_bytes"] and whole["tokens"] == 3
    assert len(split) == 2 and all(r["held_bytes"] < report["weight_bytes"] for r in split)
    assert sum(r["held_bytes"] for r in split) >= report["weight_bytes"]  # replicated parts counted twice
