"""A request admitted once: `Admission.prepare` checks and fits it, and every driver (the
engine, `generate`, the CLI) prepares each prompt exactly once, trusting the result."""

from __future__ import annotations

import pytest

from refusion.decode import DecodeConfig, Engine, generate
from refusion.decode.admit import Admission, PreparedRequest, lowered_note
from refusion.errors import ConfigError, MissingMaskTokenError, PromptError
from refusion.settings.model import ModelConfig


def _config(context: int = 64, mask: int | None = 3) -> ModelConfig:
    return ModelConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=context,
        mask_token_id=mask,
        eos_token_id=2,
    )


def test_prepare_fits_as_given_lowers_when_asked_and_says_so():
    cfg = DecodeConfig(gen_length=48, slot_size=8)
    admission = Admission(_config(), None, cfg)
    p = admission.prepare([5] * 10, cfg)
    assert (p.ids, p.cfg, p.eos_ids, p.lowered) == (tuple([5] * 10), cfg, frozenset({2}), False)
    with pytest.raises(ConfigError):  # 48 does not fit after 20 tokens of a 64-position context
        admission.prepare([5] * 20, cfg)
    low = admission.prepare([5] * 20, cfg, lower=True)
    assert low.lowered and low.asked == 48 and low.cfg.region_length <= 64 - 20
    note = lowered_note([p, low], 64, None)
    assert note is not None and "lowered to 40" in note and "for 1 of 2 prompts" in note
    assert lowered_note([p], 64, None) is None
    asked = admission.prepare([5] * 20, cfg, length=16)  # a length asked for by number is taken as it is
    assert asked.cfg.gen_length == 16 and not asked.lowered


def test_prepare_refuses_with_typed_errors_before_any_compute():
    admission = Admission(_config(), None, DecodeConfig())
    with pytest.raises(PromptError) as e:
        admission.prepare([])
    assert e.value.code == "empty_prompt"
    with pytest.raises(PromptError) as e:
        admission.prepare([1, 32])
    assert e.value.code == "invalid_value" and "[0, 32)" in str(e.value)
    with pytest.raises(PromptError):
        admission.prepare([1], DecodeConfig(stop=("x",)))  # a stop string needs a tokenizer
    no_mask = Admission(_config(mask=None), None, DecodeConfig())
    with pytest.raises(MissingMaskTokenError):
        no_mask.prepare([1], DecodeConfig(method="refusion"))
    assert no_mask.prepare([1], DecodeConfig(method="ar", gen_length=4)).cfg.method == "ar"
    own = admission.prepare([1], DecodeConfig(gen_length=4, stop_token_ids=(7, 9)))
    assert own.eos_ids == frozenset({7, 9})


@pytest.fixture
def counted(monkeypatch):
    """How many times `Admission.prepare` ran."""
    calls = []
    real = Admission.prepare

    def prepare(self, prompt, *args, **kwargs):
        calls.append(prompt)
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Admission, "prepare", prepare)
    return calls


def test_generate_prepares_each_prompt_once(tiny_model, counted):
    cfg = DecodeConfig(method="ar", gen_length=4)
    outs = generate(tiny_model, None, [[5, 6], [7, 8, 9]], cfg)
    assert len(counted) == 2 and all(o.finished for o in outs)


def test_a_prepared_request_is_trusted_by_the_engine(tiny_model, counted):
    engine = Engine(tiny_model)
    prepared = engine.prepare([5, 6], DecodeConfig(method="ar", gen_length=4))
    assert isinstance(prepared, PreparedRequest)
    rid = engine.add_request(prepared)
    assert len(counted) == 1  # added as it is: not prepared again
    with pytest.raises(ConfigError):
        engine.add_request(prepared, DecodeConfig())  # it carries its own config
    while engine.has_unfinished():
        outs = engine.step()
    assert outs[-1].request_id == rid and len(outs[-1].token_ids) == 4
    assert generate(tiny_model, None, [prepared])[0].token_ids == outs[-1].token_ids
