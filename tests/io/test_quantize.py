"""Weight-only quantization through torchao (`refusion.io.quantize`): quantized logits
against the unquantized model's, the engine unchanged above the linear layers (cache ==
recompute, batched == alone, tensor parallel), saving and loading without quantizing
again, the bytes `info` reports, and the refusals."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

import refusion
from refusion import DecodeConfig
from refusion.cli.dispatch import main
from refusion.errors import CheckpointError, ConfigError
from refusion.io import loading, save_pretrained
from refusion.io import quantize as q

pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed: scripts/setup.sh quant")

TOKENS = torch.tensor([[5, 17, 3, 99, 42, 7, 8, 120, 11, 2, 64, 33, 9, 14, 77, 21]])
PROMPTS = [
    "Sort these numbers from smallest to largest: 55, 25, 75, 93",
    "Reverse the order of these words: snow, ship, cake, moon, king",
    "Write a Python function run(n) that returns n * 3.",
]
# Largest error of the logits, relative to their largest magnitude, on the tiny random
# models (measured: int8 about 0.02, int4 about 0.3: random weights have no structure for
# 4 bits to keep); a quantization that did nothing would show 0, one that broke a layer
# far more.
BOUND = {"int8": 0.05, "int4": 0.6}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions).float()


def quantized_layers(model) -> dict[str, bool]:
    return {
        name: q.is_quantized(layer.weight)
        for name, layer in model.named_modules()
        if hasattr(layer, "weight")
    }


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_quantized_logits_stay_close_to_the_unquantized(family, make_hf_dir):
    path = make_hf_dir(family)
    base, _ = refusion.load(path)
    want = logits(base)
    errors = {}
    for scheme in q.SCHEMES:
        model, _ = refusion.load(path, quantize=scheme)
        got = logits(model)
        errors[scheme] = ((got - want).abs().max() / want.abs().max()).item()
        flags = quantized_layers(model)
        assert all(v for k, v in flags.items() if k.startswith("model.layers.") and k.endswith("_proj"))
        assert not flags["lm_head"] and not flags["model.embed_tokens"]
        assert model.dtype == (torch.bfloat16 if scheme == "int4" else torch.float32)
        assert model.quantization["scheme"] == scheme and model.quantization["unquantized"] == []
    assert 0 < errors["int8"] < BOUND["int8"] and errors["int8"] < errors["int4"] < BOUND["int4"], errors


def test_int8_kernels_compute_what_the_dequantized_weights_do(make_hf_dir):
    """The error is the weights' own: the model with each int8 weight de-quantised into
    a plain matrix gives the quantized model's logits."""
    base, _ = refusion.load(make_hf_dir("qwen3"))
    model = q.quantized_copy(base, "int8")
    for (_, layer), (_, qlayer) in zip(q.quantizable(base), q.quantizable(model)):
        layer.weight = torch.nn.Parameter(qlayer.weight.dequantize())
    torch.testing.assert_close(logits(model), logits(base), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", q.SCHEMES)
def test_the_cache_and_the_batch_change_nothing_on_a_quantized_model(scheme):
    model, tok = refusion.load(quantize=scheme)
    # cached forward in pieces == one forward of the whole sequence
    tokens = TOKENS % model.config.vocab_size
    whole = logits(model, tokens)
    cache = model.new_cache(1, 32)
    pos = torch.arange(tokens.shape[1])[None]
    pieces = [model(tokens[:, a:b], pos[:, a:b], cache).float() for a, b in ((0, 9), (9, 12), (12, 16))]
    # int4 runs in bfloat16, whose step at logits of 8 to 16 is 0.0625: two steps allowed
    tol = dict(atol=0.13, rtol=0) if scheme == "int4" else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, **tol)
    assert (torch.cat(pieces, 1).argmax(-1) == whole.argmax(-1)).all()
    # every method, batched together == each alone
    cfgs = [DecodeConfig(method=m, gen_length=48) for m in ("refusion", "ar", "mdm")]
    alone = [refusion.generate(model, tok, [p], c)[0].token_ids for p, c in zip(PROMPTS, cfgs)]
    together = [o.token_ids for o in refusion.generate(model, tok, PROMPTS, cfgs)]
    assert together == alone and all(alone)


@pytest.mark.parametrize("scheme", q.SCHEMES)
def test_greedy_refusion_equals_greedy_ar_on_the_quantized_bundled_model(scheme):
    """The shipped settings decode what AR decoding of the same weights does; quantized
    weights are the same weights to both."""
    model, tok = refusion.load(quantize=scheme)
    cfg = model.recommended.decode_config()
    rf = refusion.generate(model, tok, PROMPTS, cfg)
    ar = refusion.generate(model, tok, PROMPTS, cfg.replace(method="ar"))
    assert [o.token_ids for o in rf] == [o.token_ids for o in ar]


@pytest.mark.parametrize("scheme", q.SCHEMES)
def test_saved_quantized_model_loads_without_quantizing_again(scheme, tmp_path, monkeypatch, capsys):
    out = tmp_path / scheme
    assert main(["convert", "bundled:refusion-tiny", str(out), "--quantize", scheme]) == 0
    assert f"{scheme} weights" in capsys.readouterr().out
    fresh, _ = refusion.load(quantize=scheme)
    monkeypatch.setattr(loading, "quantize_model", lambda *a: pytest.fail("quantized again"))
    loaded, tok = refusion.load(out)
    assert not (out / "model.safetensors").exists() and (out / q.WEIGHTS_FILE).exists()
    assert loaded.quantization == fresh.quantization
    assert torch.equal(logits(loaded, TOKENS % 800), logits(fresh, TOKENS % 800))
    w_saved = loaded.model.layers[1].mlp.down_proj.weight
    assert type(w_saved) is type(fresh.model.layers[1].mlp.down_proj.weight) and q.is_quantized(w_saved)
    assert loaded.recommended.decode_config() == fresh.recommended.decode_config()
    # and it decodes: the recommended settings, through the CLI
    assert main(["generate", "-m", str(out), PROMPTS[0], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["tokens"] > 0


def test_info_reports_weight_bytes_per_dtype(tmp_path, capsys):
    assert main(["info", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    params = plain["parameters"]  # tied: the embedding counted once, as stored
    assert plain["weight_bytes"] == {"float32": params * 4} and plain["quantization"] is None
    out = tmp_path / "int8"
    assert main(["convert", "bundled:refusion-tiny", str(out), "--quantize", "int8"]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    model, _ = refusion.load()
    linear = sum(m.weight.numel() for _, m in q.quantizable(model))
    assert linear <= info["weight_bytes"]["int8"] <= 1.01 * linear  # a byte per weight (and per channel)
    assert info["weight_bytes"]["float32"] < (params - linear) * 4 + linear  # the rest, plus the scales
    assert info["quantization"]["scheme"] == "int8"
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8 weights of the blocks' linear layers" in text and "int8 " in text.split("weights", 1)[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quantize="int3"), "choose one of int8, int4"),
        (dict(quantize="int4", dtype="float32"), "--dtype bfloat16"),
        (dict(quantize="int4", dtype="float16"), "--dtype bfloat16"),
    ],
)
def test_unsupported_requests_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        refusion.load(**kwargs)
    assert "\n" not in str(e.value)


def test_a_saved_quantized_checkpoint_loads_as_saved(tmp_path):
    out = tmp_path / "int4"
    model, tok = refusion.load(quantize="int4")
    save_pretrained(model, tok, out)
    with pytest.raises(ConfigError, match="already quantized"):
        refusion.load(out, quantize="int8")
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        refusion.load(out, dtype="float32")
    from refusion.parallel import spawn

    assert "loads whole" in spawn(2, _split_load_error, str(out))
    refusion.load(out, quantize="int4", dtype="bfloat16")  # what it is: accepted
    config = json.loads((out / "config.json").read_text())
    config[q.QUANT_KEY]["packed_for"] = "cuda"  # as if packed on a GPU: this CPU cannot read it
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="packed for cuda"):
        refusion.load(out)


def _split_load_error(path: str) -> str:
    try:
        refusion.load(path, tensor_parallel_size=2)
    except ConfigError as e:
        return str(e)
    return "loaded"


class _Boom:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:1000]), "not a readable quantized state dict"),
        (lambda f: f.write_bytes(pickle.dumps(_Boom())), "not a readable quantized state dict"),
        (lambda f: torch.save([1, 2], f), "does not hold a state dict"),
        (lambda f: f.unlink(), "has no model.torchao.pt"),
    ],
)
def test_a_damaged_quantized_checkpoint_is_refused(damage, message, tmp_path, capsys):
    out = tmp_path / "int8"
    model, tok = refusion.load(quantize="int8")
    save_pretrained(model, tok, out)
    damage(out / q.WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=message):
        refusion.load(out)
    assert "code ran" not in capsys.readouterr().out  # the unpickler runs no code of the file's
    assert main(["info", str(out)]) == 2


def _decode(path, scheme, size):
    model, tok = refusion.load(path, tensor_parallel_size=size, quantize=scheme)
    cfgs = [DecodeConfig(method="ar", gen_length=32), DecodeConfig(gen_length=32)]
    return [list(o.token_ids) for o in refusion.generate(model, tok, PROMPTS[:2], cfgs)]


@pytest.mark.parametrize("scheme", q.SCHEMES)
def test_tensor_parallel_ranks_quantize_their_shares(scheme):
    """Each rank quantizes its share after the split (groups and channels lie within a
    share), and the split model decodes as the whole one does."""
    from refusion.parallel import spawn

    assert spawn(2, _decode, None, scheme, 2) == _decode(None, scheme, 1)


def test_bench_decode_runs_quantized_rows_beside_the_loaded_model(capsys, tmp_path):
    report = tmp_path / "bench.json"
    argv = ["bench", "decode", "--prompts", "2", "--rounds", "1", "--batch-sizes", "1,2", "--methods", "ar"]
    assert main([*argv, "--quantized", "int8", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "ar@int8" in out and "weights read per forward" in out and "greedy agreement" in out
    fig = json.loads(report.read_text())
    assert set(fig["sweep"]) == {"ar", "ar@int8"}
    assert fig["weight_bytes"]["int8"]["int8"] > 0 and "int8" not in fig["weight_bytes"]["loaded"]
    assert 0.5 <= fig["agreement"]["ar@int8"]["tokens"] <= 1
    assert main([*argv, "--quantized", "fp8"]) == 2


def test_the_server_serves_a_quantized_model(tmp_path):
    """`refusion serve --quantize int4` answers a chat request with what `generate` gives
    the same quantized model."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from served import Process

    from refusion.io.resolve import BUNDLED_DIR

    model, tok = refusion.load(quantize="int4")
    want = refusion.generate(model, tok, [PROMPTS[0]])[0].text
    server = Process(BUNDLED_DIR, "--quantize", "int4", "--log-level", "warning")
    try:
        body = {"model": "refusion-tiny", "messages": [{"role": "user", "content": PROMPTS[0]}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        server.kill()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
