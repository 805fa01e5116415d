"""The fixed-shape one-token step (`Transformer.fixed_step`) and its compiled form
(`DecodeConfig.compile`): the same logits and cache entries as the ragged forward, and
the same AR decodings, token for token."""

import pytest
import torch
from conftest import randomise_

from refusion import ModelConfig, Transformer
from refusion.commands._common import add_decode_arguments, decode_config_from_args
from refusion.decode import DecodeConfig, engine, generate


def _model(kind: str) -> Transformer:
    gqa = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = ModelConfig(model_type=kind, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         qk_norm=kind == "qwen3", attention_bias=kind == "qwen2", max_position_embeddings=256,
                         eos_token_id=1, **gqa)
    model = Transformer(config)
    randomise_(model, seed=3)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_fixed_step_equals_the_ragged_forward(kind):
    """Three rows of different lengths in a cache with spare storage rows: one token per
    row through `fixed_step` on all storage rows gives each row's logits and KV entry as
    the ragged forward does; the spare rows' garbage is read by no real row."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2]
    cache = model.new_cache(3, 24, reserve=5)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in lengths]
    for b, p in enumerate(prompts):  # fill row b alone (a one-row view of the same storage)
        single = model.new_cache(1, 24)
        model.hidden(torch.tensor([p]), torch.arange(len(p))[None], single)
        for layer in range(model.config.num_hidden_layers):
            cache.k[layer][b] = single.k[layer][0]
            cache.v[layer][b] = single.v[layer][0]
    cache.lengths = list(lengths)
    k_store, v_store, _, _ = cache.storage()
    for t in k_store + v_store:
        t[3:] = 1e3  # spare rows hold garbage
    ref_cache = cache.select(range(3), capacity=24)  # the ragged forward's copy
    new = [7, 11, 13]
    logits_ref = model(torch.tensor(new)[:, None], torch.tensor(lengths)[:, None], ref_cache, n_new=1)[:, 0]

    R = cache.reserved_rows
    toks = torch.tensor(new + [0] * (R - 3))[:, None]
    pos = torch.tensor(lengths + [0] * (R - 3))[:, None]
    logits = model.fixed_step(toks, pos, torch.tensor(lengths + [0] * (R - 3)), *cache.storage())[:3]
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.num_hidden_layers):
        for b, n in enumerate(lengths):
            torch.testing.assert_close(cache.k[layer][b, :, : n + 1], ref_cache.k[layer][b, :, : n + 1])
            torch.testing.assert_close(cache.v[layer][b, :, : n + 1], ref_cache.v[layer][b, :, : n + 1])
    for b, (n, t) in enumerate(zip(lengths, new)):
        assert cache.tokens[b, n] == t and cache.positions[b, n] == n


def test_compiled_ar_decodes_what_eager_decodes(monkeypatch):
    """AR with the compiled step, five prompts of different lengths through two places
    (rows leave and join; joins prefill eagerly): the same tokens as eager AR, and the
    same forward counts."""
    model = _model("qwen3")
    prompts = [[5, 6, 7], [9] * 11, [3, 4], list(range(10, 30)), [40, 41, 42, 43]]
    cfg = DecodeConfig(method="ar", gen_length=12, max_batch_size=2, eos_id=1)
    eager = generate(model, None, prompts, cfg)
    steps = []
    call = engine.CompiledStep.__call__
    monkeypatch.setattr(engine.CompiledStep, "__call__", lambda self, *a: steps.append(a[1].shape[0]) or call(self, *a))
    compiled = generate(model, None, prompts, cfg.replace(compile=True))
    assert len(steps) > 20 and set(steps) == {1, 2}  # the compiled step ran, on one row and on two
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert [o.stats.nfe for o in compiled] == [o.stats.nfe for o in eager]
    assert [o.stats.fed for o in compiled] == [o.stats.fed for o in eager]


def test_compile_flag_reaches_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    assert decode_config_from_args(parser.parse_args(["--compile"])).compile is True
    assert decode_config_from_args(parser.parse_args([])).compile is False


def _steps(step, model: Transformer, shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step through `step` on caches of each (rows, capacity), each row holding a few
    entries; returns (logits, the same step by eager `fixed_step` on a copy) per shape."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for rows, capacity in shapes:
        cache = model.new_cache(rows, capacity)
        n = torch.randint(1, 6, (rows,), generator=gen).tolist()
        model.hidden(torch.randint(2, 64, (rows, max(n)), generator=gen), torch.arange(max(n)).expand(rows, -1), cache, n_new=n, lengths=n)
        twin = cache.select(range(rows), capacity)
        toks, pos = torch.randint(2, 64, (rows, 1), generator=gen), torch.tensor(n)[:, None]
        ref = model.fixed_step(toks, pos, torch.tensor(n), *twin.storage())
        out.append((step(model, toks, pos, cache), ref))
        assert cache.lengths == [m + 1 for m in n]
    return out


@torch.inference_mode()
def test_one_graph_serves_every_capacity():
    """Dynamic shapes: ten capacities and two row counts, more shapes than dynamo's
    recompile limit, all through the compiled graph (no eager fallback, whose warning
    would fail this test), each equal to the eager step."""
    import warnings

    model = _model("llama")
    shapes = [(1, 40 + 37 * i) for i in range(10)] + [(3, 50), (3, 333), (5, 64)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for got, ref in _steps(engine.CompiledStep(), model, shapes):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_past_the_recompile_limit_steps_run_eagerly():
    """At dynamo's recompile limit a fullgraph compile fails hard; the step warns once and
    runs `fixed_step` eagerly instead: the same logits, the cache advanced once."""
    model = _model("qwen2")
    step = engine.CompiledStep()
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning, match="recompile_limit"):
        results = _steps(step, model, [(1, 30), (4, 30), (2, 90)])
    assert step.warned
    for got, ref in results:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
