"""Structured outputs (`decode/grammar.py`) on the bundled model: every output of a grammar
is a sentence of it, AR decoding and ReFusion's lossless settings commit exactly the same
tokens under it (greedily), a batch decodes what each request decodes alone, and settings
that cannot enforce a grammar are refused before any compute."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest

import refusion
from refusion.decode import Engine, EngineConfig, generate
from refusion.decode.grammar import choice_grammar, json_object_grammar, json_schema_grammar, regex_grammar
from refusion.settings.fields import FieldError
from refusion.settings.recommended import recommended_of

# prompts the bundled model was never trained on, and one of each family it was
PROMPTS = [
    "Describe a person you admire, as JSON.",
    "What is the capital of France?",
    "Ella has 52 stickers. Ella buys 3 bags with 5 stickers in each. Ella sells 6. "
    "How many stickers does Ella have now?",
    "Sort these numbers from smallest to largest: 55, 25, 75, 93",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["kind", "tall", "funny"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["cm", "kg", "stickers"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "it depends"]
PATTERN = r"[0-9]{1,3}( (apples|pears))?"


def _valid_json(schema):
    def check(text):
        jsonschema.validate(json.loads(text), schema)

    return check


CASES = {
    "person schema": (json_schema_grammar(PERSON), _valid_json(PERSON)),
    "answer schema": (json_schema_grammar(ANSWER), _valid_json(ANSWER)),
    "choice": (choice_grammar(CHOICES), lambda text: CHOICES.index(text)),
    "regex": (regex_grammar(PATTERN), lambda text: re.fullmatch(PATTERN, text).group(0)),
}


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.fixture(scope="module")
def shipped(bundled):
    return recommended_of(bundled[0]).decode_config(gen_length=96)


@pytest.mark.parametrize("case", CASES)
def test_outputs_follow_the_grammar_and_refusion_equals_ar(bundled, shipped, case):
    """Greedy, the shipped ReFusion settings and AR give the same tokens under a grammar,
    and each output is a complete sentence of it (finished by EOS, not by length)."""
    model, tok = bundled
    grammar, check = CASES[case]
    outs = {
        method: generate(model, tok, PROMPTS, shipped.replace(method=method, grammar=grammar))
        for method in ("ar", "refusion")
    }
    for ar, rf in zip(outs["ar"], outs["refusion"]):
        assert rf.token_ids == ar.token_ids
        assert ar.finish_reason == "stop", ar.text
        check(ar.text)


def test_json_mode_gives_a_json_object(bundled, shipped):
    model, tok = bundled
    cfg = shipped.replace(grammar=json_object_grammar(), gen_length=64)
    for out in generate(model, tok, PROMPTS[:2], cfg):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # cut by length: still a prefix of a JSON object
            assert out.text.startswith("{")


def test_left_check_with_several_slots_equals_ar_under_a_grammar(bundled, shipped):
    """The other lossless layout (several slots per block, the left check) at temperature 0."""
    model, tok = bundled
    grammar = CASES["answer schema"][0]
    several = shipped.replace(slot_size=8, serial_blocks=2, left_check=True, grammar=grammar)
    assert several.slots_per_block > 1 and several.lossless_now
    ar = generate(model, tok, PROMPTS, several.replace(method="ar"))
    rf = generate(model, tok, PROMPTS, several)
    assert [o.token_ids for o in rf] == [o.token_ids for o in ar]


def test_a_batch_of_mixed_grammars_decodes_what_each_decodes_alone(bundled, shipped):
    model, tok = bundled
    cfgs = [
        shipped.replace(grammar=CASES["person schema"][0]),
        shipped.replace(method="ar", grammar=CASES["choice"][0]),
        shipped,
        shipped.replace(grammar=CASES["regex"][0], temperature=0.8, seed=3),
    ]
    together = generate(model, tok, PROMPTS, cfgs)
    alone = [generate(model, tok, [p], c)[0] for p, c in zip(PROMPTS, cfgs)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    # two places, the schema's row last: it joins running rows by its prompt alone
    # (`ReFusionRow.join_feed`), its first token committed under the grammar there
    joined = generate(model, tok, PROMPTS[::-1], cfgs[::-1], engine_config=EngineConfig(max_batch_size=2))
    assert [o.token_ids for o in joined] == [o.token_ids for o in alone[::-1]]


def test_sampled_outputs_follow_the_grammar(bundled, shipped):
    model, tok = bundled
    grammar, check = CASES["person schema"]
    for method in ("ar", "refusion"):
        cfg = shipped.replace(method=method, grammar=grammar, temperature=1.0)
        for seed in range(4):
            out = generate(model, tok, PROMPTS[:1], cfg.replace(seed=seed))[0]
            if out.finish_reason == "stop":
                check(out.text)


@pytest.mark.parametrize(
    "changes, says",
    [
        (dict(method="mdm"), "method mdm"),
        (dict(slot_size=8, serial_blocks=1), "these settings"),  # several slots, no left check
        (dict(ar_correction=False), "these settings"),  # the paper's rule
        (dict(slot_size=8, left_check=True, temperature=0.7), "left_check at temperature 0"),
    ],
)
def test_settings_that_cannot_enforce_a_grammar_are_refused(bundled, shipped, changes, says):
    model, tok = bundled
    cfg = shipped.replace(grammar=CASES["choice"][0], **changes)
    with pytest.raises(FieldError, match=says) as e:
        Engine(model, tok).prepare(PROMPTS[0], cfg)
    assert e.value.field == "grammar" and "method ar" in str(e.value)


def test_a_grammar_that_does_not_compile_is_refused_with_its_error(bundled, shipped):
    model, tok = bundled
    with pytest.raises(FieldError, match="does not compile.*unknown name") as e:
        Engine(model, tok).prepare(PROMPTS[0], shipped.replace(grammar="start: nowhere"))
    assert e.value.field == "grammar"


def test_sampled_refusion_draws_what_sampled_ar_draws_under_a_grammar(bundled, shipped, monkeypatch):
    """Seeded draws of the shipped settings and of AR at temperature 1.5 under a grammar of
    numbers, for the arithmetic prompts the model is sure of (and so drafts well): the
    answers in the same proportions (a two-sample chi-square), where the threshold
    verification that sampled rows had before speculative sampling is told apart."""
    from test_lossless_sampling import _two_sample, bound

    from refusion.decode.refusion import judge

    model, tok = bundled
    from refusion.tasks import load_test_items

    prompts = [it.prompt for it in load_test_items() if it.family == "arithmetic"][:2]
    cfg = shipped.replace(grammar=regex_grammar("[0-9]{1,4}"), temperature=1.5)
    n = 240

    def answers(c):
        every = prompts * n
        outs = generate(model, tok, every, [c.replace(seed=i) for i in range(len(every))])
        assert all(re.fullmatch("[0-9]{1,4}", o.text) for o in outs)
        return [Counter(o.text for o in outs[j::2]) for j in range(2)]

    ar = answers(cfg.replace(method="ar"))

    def verdict(counts):
        parts = [_two_sample(a, b) for a, b in zip(counts, ar)]
        return sum(s for s, _ in parts), sum(d for _, d in parts)

    stat, df = verdict(answers(cfg))
    assert df >= 4 and stat < bound(df), (stat, df)
    threshold = lambda c, sampler: judge.Threshold(sampler, c.token_threshold)  # noqa: E731
    monkeypatch.setattr("refusion.decode.refusion.row.judge_for", threshold)
    stat, df = verdict(answers(cfg))
    assert stat > bound(df), (stat, df)
