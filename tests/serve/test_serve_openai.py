"""The OpenAI fields that change what a completion carries, through the official `openai`
client against a live server on the bundled model: log-probabilities (checked against an
independent forward over the returned tokens), several choices (`n`), and the penalties
and logit bias (which change the text, and keep lossless ReFusion equal to AR)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import torch  # noqa: E402
from served import forward_logprobs  # noqa: E402
from test_serve import LiveServer  # noqa: E402

import refusion  # noqa: E402
from refusion.decode import generate  # noqa: E402
from refusion.model.prompts import chat_ids  # noqa: E402
from refusion.serve import create_app  # noqa: E402
from refusion.settings.recommended import recommended_of  # noqa: E402

# the bundled model's shipped settings (lossless, greedy) and AR; the paper's rule beside them
LOSSLESS = {"ar": {"method": "ar"}, "refusion": {}}
NAME = "refusion-tiny"
PAPER = {"first_token_check": False, "ar_correction": False, "token_threshold": 0.3, "slot_size": 8}


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.fixture(scope="module")
def server(bundled):
    model, tok = bundled
    s = LiveServer(create_app(model, tok, model_name=NAME))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def examples(bundled):
    return list(recommended_of(bundled[0]).examples.values())


def ask(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def token_ids(tok, spelled: list[str]) -> list[int]:
    """The ids of tokens as the server spells them, one by one (the bundled vocabulary
    spells every id it generates differently; the test says so if not)."""
    by_text: dict[str, list[int]] = {}
    for i in range(len(tok)):
        by_text.setdefault(tok.decode([i]), []).append(i)
    ids = [by_text[t] for t in spelled]
    assert all(len(i) == 1 for i in ids), [t for t, i in zip(spelled, ids) if len(i) > 1]
    return [i[0] for i in ids]


# ---------------------------------------------------------------------------- log-probabilities
@pytest.mark.parametrize("method", sorted(LOSSLESS))
def test_chat_logprobs_are_the_models_over_the_returned_tokens(bundled, client, examples, method):
    """AR and the shipped (lossless) ReFusion settings report, for every token, the model's
    log-probability given exactly the tokens before it, as a plain forward computes it."""
    model, tok = bundled
    for prompt in examples:
        r = client.chat.completions.create(
            model=NAME,
            messages=ask(prompt),
            logprobs=True,
            top_logprobs=3,
            max_tokens=48,
            extra_body=LOSSLESS[method],
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        assert {c.model_extra["logprob_source"] for c in content} == {"model"}
        gen = token_ids(tok, [c.token for c in content])
        want = forward_logprobs(model, chat_ids(tok, ask(prompt)), gen)
        got = torch.tensor([c.logprob for c in content])
        assert torch.allclose(got, want.to(got.dtype), atol=1e-4, rtol=0), (got - want).abs().max()
        for c in content:
            tops = [t.logprob for t in c.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] >= c.logprob - 1e-6
            assert c.bytes == list(c.token.encode())


def test_streamed_logprobs_are_the_whole_responses_chunk_by_chunk(client, examples):
    body = dict(model=NAME, messages=ask(examples[0]), logprobs=True, top_logprobs=2, max_tokens=48)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    streamed, text = [], ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole]
    assert "".join(c.token for c in whole).startswith(text)


def test_completion_logprobs_are_the_legacy_lists(bundled, client, examples):
    """The completions route: an integer logprobs, parallel lists, offsets into the text."""
    r = client.completions.create(model=NAME, prompt=examples[1], logprobs=2, max_tokens=32, stream=False)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for top, v in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) <= 2 and max(top.values()) >= v - 1e-6
    assert set(lp.model_extra["logprob_source"]) == {"model"}


def test_the_papers_rule_labels_the_probabilities_that_decided_its_tokens(client, examples):
    """Without the lossless options a slot's first token is decided by the plan (MASKs in
    its context): its log-probability is that plan's, labelled "plan"."""
    r = client.chat.completions.create(
        model=NAME, messages=ask(examples[0]), logprobs=True, max_tokens=48, extra_body=PAPER
    )
    content = r.choices[0].logprobs.content
    assert "plan" in {c.model_extra["logprob_source"] for c in content}
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"logprobs": 99}, "logprobs"),
    ],
)
def test_bad_logprobs_are_400s_naming_the_field(client, path, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        if path == "chat":
            client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, extra_body=body)
        else:
            client.completions.create(model=NAME, prompt="hi", max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


# ---------------------------------------------------------------------------- penalties and bias
def test_penalties_change_the_text_and_keep_refusion_equal_to_ar(client, examples):
    def tokens(prompt: str, **fields) -> list[str]:
        r = client.chat.completions.create(
            model=NAME, messages=ask(prompt), logprobs=True, max_tokens=48, **fields
        )
        return [c.token for c in r.choices[0].logprobs.content]

    pen = {"frequency_penalty": 1.0, "presence_penalty": 1.0, "logit_bias": {"224": -5}}
    changed = 0
    for prompt in examples:
        ar = tokens(prompt, **pen, extra_body={"method": "ar"})
        assert tokens(prompt, **pen) == ar  # the shipped ReFusion settings
        changed += ar != tokens(prompt, extra_body={"method": "ar"})
    assert changed
    repeated = {"repetition_penalty": 3.0}  # vLLM's extra field
    ar = tokens(examples[0], extra_body=repeated | {"method": "ar"})
    assert tokens(examples[0], extra_body=repeated) == ar != tokens(examples[0], extra_body={"method": "ar"})


@pytest.mark.parametrize(
    "body,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_penalties_and_biases_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


# ---------------------------------------------------------------------------- several choices
def test_n_choices_sample_seed_plus_i_each_as_a_request_alone_would(bundled, client, examples):
    model, tok = bundled
    body = dict(model=NAME, messages=ask(examples[0]), max_tokens=40, temperature=3.0, seed=5)
    r = client.chat.completions.create(**body, n=3, extra_body={"method": "ar"})
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # their own seeds: not one answer three times
    cfg = recommended_of(model).decode_config(method="ar", gen_length=40, temperature=3.0)
    ids = chat_ids(tok, ask(examples[0]))
    want_out = generate(model, tok, [ids] * 3, [cfg.replace(seed=5 + i) for i in range(3)])
    assert texts == [o.text for o in want_out]
    assert r.usage.prompt_tokens == len(ids)  # the prompt counted once
    assert r.usage.completion_tokens == sum(
        len(o.token_ids) for o in generate(model, tok, [ids] * 3, [cfg.replace(seed=5 + i) for i in range(3)])
    )


def test_n_choices_stream_with_their_index(client, examples):
    body = dict(model=NAME, messages=ask(examples[2]), max_tokens=40, temperature=3.0, seed=7, n=3)
    whole = [c.message.content for c in client.chat.completions.create(**body).choices]
    streamed, finished = ["", "", ""], set()
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == whole and finished == {0, 1, 2}


def test_n_choices_of_several_prompts_come_prompt_after_prompt(client, examples):
    r = client.completions.create(model=NAME, prompt=examples[:2], n=2, max_tokens=24, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [
        client.completions.create(model=NAME, prompt=p, max_tokens=24).choices[0].text for p in examples[:2]
    ]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: n equal texts
    assert all(len(c.logprobs.tokens) > 0 for c in r.choices)


@pytest.mark.parametrize("n", [0, 17, 2.0, "3", True])
def test_bad_n_is_a_400(client, n):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, extra_body={"n": n})
    assert e.value.body["param"] == "n"


def test_n_times_the_prompts_is_bounded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=["hi"] * 9, n=16, max_tokens=4)
    assert e.value.body["param"] == "n" and "128" in e.value.body["message"]


# ---------------------------------------------------------------------------- best_of and echo
def test_best_of_returns_the_most_likely_of_its_rows(client, examples):
    """best_of 3 samples three rows (seeds s, s + 1, s + 2, as n would) and returns the one
    whose tokens' log-probabilities sum highest: the same text as the highest of those
    three requests made alone."""
    prompt, seed = examples[0], 11
    common = dict(model=NAME, prompt=prompt, max_tokens=32, temperature=1.5)
    best = client.completions.create(**common, best_of=3, seed=seed, extra_body={"chat_template": True})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    alone = [
        client.completions.create(
            **common, seed=seed + i, logprobs=0, extra_body={"chat_template": True}
        ).choices[0]
        for i in range(3)
    ]
    ranked = sorted(alone, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert best.choices[0].text == ranked[0].text
    assert len({c.text for c in alone}) > 1  # the rows differ, so the choice was a choice
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in alone)


def test_echo_begins_each_choice_with_its_prompt(client):
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=["ab", "cd"], max_tokens=4, echo=True, stream=stream)
        if stream:
            texts = {0: "", 1: ""}
            for chunk in r:
                for c in chunk.choices:
                    texts[c.index] += c.text
        else:
            texts = {c.index: c.text for c in r.choices}
        assert texts[0].startswith("ab") and texts[1].startswith("cd")
