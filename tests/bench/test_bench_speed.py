"""`refusion bench speed`: the floor formula on hand numbers, the cost model on a hand-counted
model, and the command end to end on the bundled model with tiny repeats."""

from __future__ import annotations

import json
import re

import pytest
import torch

from refusion import ModelConfig, Transformer
from refusion.bench.floors import floor_ms, forward_cost
from refusion.bench.speed import random_model
from refusion.cli.dispatch import main

TINY_RUN = [
    "--repeats",
    "1",
    "--decode-rounds",
    "1",
    "--sizes",
    "1,4",
    "--new-tokens",
    "8",
    "--prompts",
    "1",
    "--gen-length",
    "16",
    "--slot-size",
    "8",
    "--bw-mib",
    "8",
    "--matmul-n",
    "64",
    "--sample-ms",
    "1",
]


def test_floor_is_the_slower_of_streaming_and_compute():
    # 1 GB of weights at 100 GB/s: 10 ms; 1 GFLOP at 1000 GFLOP/s: 1 ms
    assert floor_ms(1e9, 0, 1e9, 100, 1000) == pytest.approx(10.0)
    # the KV entries are streamed too: 2 GB -> 20 ms
    assert floor_ms(1e9, 1e9, 1e9, 100, 1000) == pytest.approx(20.0)
    # 1 TFLOP at 1000 GFLOP/s: compute-bound, 1000 ms
    assert floor_ms(1e9, 0, 1e12, 100, 1000) == pytest.approx(1000.0)


def _hand_model(tied: bool) -> Transformer:
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        return Transformer(config)


def test_forward_cost_counts_by_hand():
    # per layer, matrices: q 32x32, k 16x32, v 16x32, o 32x32, gate/up/down 64x32 -> 9216;
    # two layers + lm_head 64x32 -> 20480 matmul parameters. Norms: 2x(32+32+8+8) + 32 = 192.
    # One token on a cache of 10 sees 11 entries: attention 4*layers*heads*head_dim*11 = 2816 flops,
    # KV 2*layers*kv_heads*head_dim*11 floats = 2816 bytes.
    tied = forward_cost(_hand_model(tied=True), cache_len=10, tokens=1)
    assert tied.flops == 2 * 20480 + 2816
    assert tied.kv_bytes == 2816
    assert tied.weight_bytes == (20480 + 192) * 4  # the tied table is read whole, by lm_head
    untied = forward_cost(_hand_model(tied=False), cache_len=10, tokens=1)
    assert untied.flops == tied.flops
    assert untied.weight_bytes == (20480 + 192 + 32) * 4  # plus one gathered embedding row
    four = forward_cost(_hand_model(tied=True), cache_len=10, tokens=4)
    assert four.flops == 2 * 20480 * 4 + 4 * 2 * 4 * 8 * 14 * 4
    assert four.weight_bytes == tied.weight_bytes


def test_decode_ceiling_counts_each_shape_at_its_rate():
    # the hand model's shapes: q/o 32x32 (2 per layer), k/v 16x32 (2), gate/up 64x32 (2), down 32x64 (1);
    # lm_head 64x32 on logit rows only. Rates in GFLOP/s per shape.
    from refusion.bench.flops import ceiling_tps, linear_shapes

    model = _hand_model(tied=True)
    shapes = linear_shapes(model)
    assert shapes == {(32, 32): (4, 0), (16, 32): (4, 0), (64, 32): (4, 1), (32, 64): (2, 0)}
    rates = {(32, 32): 1.0, (16, 32): 2.0, (64, 32): 4.0, (32, 64): 8.0}
    fed, logit_rows = 3.0, 2.0  # per committed token
    seconds = (
        2 * 32 * 32 * 4 * fed / 1.0
        + 2 * 16 * 32 * 4 * fed / 2.0
        + 2 * 64 * 32 * (4 * fed + logit_rows) / 4.0
        + 2 * 32 * 64 * 2 * fed / 8.0
    ) / 1e9
    assert ceiling_tps(model, rates, 1.0, fed, logit_rows) == pytest.approx(1.0 / seconds)
    # twice the work per token: half the ceiling
    assert ceiling_tps(model, rates, 1.0, 2 * fed, 2 * logit_rows) == pytest.approx(0.5 / seconds)


def test_random_qwen3_shape_is_the_real_one():
    """Qwen3-0.6B has 596,049,920 parameters (tied embeddings); built on meta, no memory used."""
    model = random_model("qwen3-0.6b", "meta", torch.float32)
    assert model.num_parameters() == 596_049_920
    assert model.config.mask_token_id is not None


def _printed_row(out: str, tokens: int) -> list[str]:
    return next(line.split() for line in out.splitlines() if re.match(rf"\s*{tokens}\s+\d", line))


def test_command_prints_and_writes_consistent_figures(tmp_path, capsys):
    path = tmp_path / "speed.json"
    assert main(["bench", "speed", *TINY_RUN, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    fig = json.loads(path.read_text())
    floors = fig["floors"]
    assert floors["bandwidth_gbs"] > 0 and floors["matmul_gflops"] > 0
    assert [r["tokens"] for r in fig["forward"]] == [1, 4]
    for r in fig["forward"]:
        expected = floor_ms(
            r["weight_bytes"], r["kv_bytes"], r["flops"], floors["bandwidth_gbs"], floors["matmul_gflops"]
        )
        assert r["floor_ms"] == pytest.approx(expected)
        assert r["ours_vs_floor"] == pytest.approx(r["ours_ms"] / r["floor_ms"])
        assert r["hf_vs_ours"] == pytest.approx(r["hf_ms"] / r["ours_ms"])
        # the printed row: tokens, floor, ours, ours/floor, hf, hf/floor, hf/ours
        cells = _printed_row(out, r["tokens"])
        floor, ours, ratio = float(cells[1]), float(cells[2]), float(cells[3].rstrip("x"))
        assert ratio == pytest.approx(ours / floor, abs=0.01 + 0.01 * ratio)
        assert floor == pytest.approx(r["floor_ms"], abs=1e-3)
    ar = fig["ar_decode"]
    assert ar["ours_tokens"] == ar["new_tokens"] == 8  # EOS ignored: exactly the requested count
    assert ar["equal"] is True and ar["first_difference"] is None
    assert ar["ours_vs_hf"] == pytest.approx(ar["ours_tps"] / ar["hf_tps"])
    assert "outputs identical" in out
    rf = fig["refusion"]  # the bundled model has a MASK token
    for m in ("ar", "refusion"):
        assert rf[m]["tpf"] == pytest.approx(rf[m]["tokens"] / rf[m]["nfe"])
    assert rf["refusion"]["vs_ar"] == pytest.approx(rf["refusion"]["tps"] / rf["ar"]["tps"])
    names = {t["name"]: t for t in fig["targets"]}
    assert names["1-token forward / floor"]["value"] == fig["forward"][0]["ours_vs_floor"]
    assert names["AR decode tok/s, ours / transformers"]["met"] == (ar["ours_vs_hf"] >= 1.5)


def test_without_transformers_or_mask_the_report_says_so(tmp_path, capsys, make_hf_dir):
    """A tiny Hugging Face checkpoint without a MASK token, --hf off: sections c and d and
    the targets say what they left out."""
    path = tmp_path / "speed.json"
    assert (
        main(["bench", "speed", str(make_hf_dir("qwen3")), *TINY_RUN, "--hf", "off", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    fig = json.loads(path.read_text())
    assert "hf_ms" not in fig["forward"][0] and "hf_tps" not in fig["ar_decode"]
    assert "transformers not compared" in out
    assert "skipped" in fig["refusion"] and "d. ReFusion vs AR: skipped" in out
    assert [t["name"] for t in fig["targets"]] == ["1-token forward / floor"]


def test_compile_adds_the_compiled_step_and_decode(tmp_path, capsys, make_hf_dir):
    """--compile: every forward row gains the compiled forward's time against the same
    floor, and section c the compiled AR decode, whose tokens equal the eager decode's."""
    path = tmp_path / "speed.json"
    assert (
        main(
            [
                "bench",
                "speed",
                str(make_hf_dir("qwen3")),
                *TINY_RUN,
                "--hf",
                "off",
                "--compile",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    fig = json.loads(path.read_text())
    for row in fig["forward"]:  # 1 and 4 tokens
        assert row["compiled_ms"] > 0 and row["compiled_vs_floor"] == pytest.approx(
            row["compiled_ms"] / row["floor_ms"]
        )
    ar = fig["ar_decode"]
    assert ar["compiled_equal"] is True and ar["compiled_tps"] > 0
    assert out.count("compiled (--compile): ") == 2 and "outputs identical to ours eager" in out
    names = {t["name"] for t in fig["targets"]}
    assert "1-token forward / floor, compiled" in names


def test_quantized_adds_section_e_beside_the_loaded_model(tmp_path, capsys):
    """--quantized int8,int4: each copy's forwards and AR decode are timed with the loaded
    model's, its weight bytes are what it holds, and a fresh process per saved checkpoint
    gives a peak memory above that of one that loads nothing."""
    pytest.importorskip("torchao", reason="the quant extra is not installed")
    path = tmp_path / "speed.json"
    argv = ["bench", "speed", *TINY_RUN, "--hf", "off", "--quantized", "int8,int4", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    e = json.loads(path.read_text())["quantized"]
    assert "e. quantized weights" in out and set(e["forward"]) == {"int8", "int4"}
    for scheme, row in e["forward"].items():
        assert row["one_ms"] > 0 and row["ar_tps"] > 0 and 0 <= row["agreement"] <= 1
        assert scheme in ("int8", "int4") and e["weights"][scheme]
    assert e["weights"]["int8"]["int8"] > 0 and e["weights"]["int4"]["uint8"] > 0
    assert 0 < e["logits"]["int8"]["mean"] < e["logits"]["int4"]["mean"] < e["logits"]["mean_abs_logit"]
    assert (
        sum(e["weights"]["int4"].values())
        < sum(e["weights"]["int8"].values())
        < sum(e["weights"]["loaded"].values())
    )
    assert all(
        p["rss_mb"] > e["peak"]["nothing loaded"]["rss_mb"]
        for k, p in e["peak"].items()
        if k != "nothing loaded"
    )
