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


def test_compiled_caches_come_in_powers_of_two(tiny_model):
    """With the compiled step, cache capacities are powers of two (new caches and grown
    ones), so prompts of many lengths share a few graphs."""
    from refusion.decode.engine import make_room, pow2

    assert [pow2(n) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]
    cache = make_room(tiny_model, None, [[1] * 70], 0, 30, reserve=2, bucket=True)
    assert cache.capacity == 128
    make_room(tiny_model, cache, [[1] * 90], 70, 30, reserve=2, bucket=True)  # needs 2 x 90 + 30 = 210
    assert cache.capacity == 256 and cache.batch_size == 2
    plain = make_room(tiny_model, None, [[1] * 70], 0, 30, reserve=2)
    assert plain.capacity == 100
