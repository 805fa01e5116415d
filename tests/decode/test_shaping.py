"""What a request does with its logits (`decode/shaping.py`), through `generate` on the
bundled model: the log-probabilities it reports, and the penalties and bias it decodes
with (ReFusion with the lossless settings still equal to AR under them)."""

from __future__ import annotations

import pytest
import torch
from served import forward_logprobs

import refusion
from refusion.decode import DecodeConfig, Engine, generate
from refusion.settings.recommended import recommended_of


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.fixture(scope="module")
def shipped(bundled):
    """The bundled model's recommended settings (lossless) and its example prompts."""
    rec = recommended_of(bundled[0])
    return rec.decode_config(gen_length=48), list(rec.examples.values())


def test_sampled_lossless_refusion_reports_the_models_logprobs(bundled, shipped):
    """Sampled with speculative verification, each token's log-probability is still the
    model's at its position given the tokens before it (raw: before temperature)."""
    model, tok = bundled
    cfg, prompts = shipped
    engine = Engine(model, tok)
    for i, prompt in enumerate(prompts):
        ready = engine.prepare(prompt, cfg.replace(temperature=0.9, seed=i, logprobs=1))
        out = generate(model, tok, ready)[0]
        assert [t.token for t in out.logprobs] == out.token_ids
        assert {t.source for t in out.logprobs} == {"model"}
        got = torch.tensor([t.logprob for t in out.logprobs])
        want = forward_logprobs(model, list(ready.ids), out.token_ids)
        assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_logprobs_in_one_batch_of_mixed_settings_are_the_models(bundled, shipped):
    """Batched together: the shipped settings, AR under a penalty (its log-probabilities
    stay the raw model's), several slots per block with the left check (infilling forks),
    and sampled ReFusion."""
    model, tok = bundled
    cfg, prompts = shipped
    engine = Engine(model, tok)
    cfgs = [
        cfg.replace(logprobs=2),
        cfg.replace(method="ar", logprobs=2, frequency_penalty=0.5),
        cfg.replace(slot_size=8, serial_blocks=1, left_check=True, logprobs=1),
        cfg.replace(temperature=1.5, seed=3, logprobs=0),
    ]
    ready = [engine.prepare(p, c) for p, c in zip(prompts, cfgs)]
    for r, out in zip(ready, generate(model, tok, ready)):
        assert {t.source for t in out.logprobs} == {"model"}
        got = torch.tensor([t.logprob for t in out.logprobs])
        assert torch.allclose(got, forward_logprobs(model, list(r.ids), out.token_ids), atol=1e-4, rtol=0)


def test_mdm_labels_what_each_logprob_is(bundled, shipped):
    """MDM fixes a token from its MASK's prediction ("plan"); a token whose position a
    later step predicted from exactly the tokens before it has the model's own ("model",
    equal to a plain forward's)."""
    model, tok = bundled
    cfg, prompts = shipped
    mdm = DecodeConfig(method="mdm", gen_length=32, mdm_block_length=8, logprobs=2)
    ready = Engine(model, tok).prepare(prompts[0], mdm)
    out = generate(model, tok, ready)[0]
    assert len(out.logprobs) == len(out.token_ids) and {t.source for t in out.logprobs} == {"plan", "model"}
    assert all(len(t.top) == 2 and t.top[0][1] >= t.logprob for t in out.logprobs)
    want = forward_logprobs(model, list(ready.ids), out.token_ids)
    exact = [i for i, t in enumerate(out.logprobs) if t.source == "model"]
    got = torch.tensor([out.logprobs[i].logprob for i in exact])
    assert torch.allclose(got, want[exact], atol=1e-4, rtol=0)


def test_a_request_that_asks_for_nothing_has_no_shaping(bundled, shipped):
    model, tok = bundled
    cfg, prompts = shipped
    engine = Engine(model, tok)
    rid = engine.add_request(prompts[0], cfg)
    assert engine.requests[rid].shaping is None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.logprobs is None


PENALTIES = [
    {"frequency_penalty": 2.0},
    {"frequency_penalty": 1.0, "presence_penalty": 1.0, "logit_bias": {224: -5.0}},
    {"repetition_penalty": 3.0},
]


@pytest.mark.parametrize("pen", PENALTIES)
def test_penalties_change_the_text_and_lossless_refusion_stays_ar(bundled, shipped, pen):
    """The penalised distribution is what ReFusion drafts, verifies and corrects with, so
    its lossless settings (the shipped one slot per block, and several slots per block
    with the left check) still decode AR's tokens, one for one."""
    model, tok = bundled
    cfg, prompts = shipped
    plain = [o.token_ids for o in generate(model, tok, prompts, cfg.replace(method="ar"))]
    ar = [o.token_ids for o in generate(model, tok, prompts, cfg.replace(method="ar", **pen))]
    assert ar != plain
    for layout in ({}, {"slot_size": 8, "serial_blocks": 1, "left_check": True}):
        assert cfg.replace(**layout).lossless_now
        assert [o.token_ids for o in generate(model, tok, prompts, cfg.replace(**layout, **pen))] == ar


def test_a_bias_of_minus_100_bans_a_token(bundled, shipped):
    model, tok = bundled
    cfg, prompts = shipped
    first = generate(model, tok, prompts[0], cfg)[0].token_ids[0]
    out = generate(model, tok, prompts[0], cfg.replace(logit_bias={first: -100.0}))[0]
    assert first not in out.token_ids
