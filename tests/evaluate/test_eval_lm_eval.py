"""The lm-evaluation-harness plugin (skipped when lm-eval is not installed)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

import refusion
from refusion import ModelConfig, Transformer
from refusion.evaluate.lm_eval_plugin import ReFusionLM


@pytest.fixture
def lm_parts(tiny_tokenizer):
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval(), tiny_tokenizer


def request(*args):
    return SimpleNamespace(args=args)


@torch.no_grad()
def direct_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """One sequence, one forward, no batching or padding."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    tokens = torch.tensor([whole[:-1]])
    logprobs = F.log_softmax(model(tokens, torch.arange(tokens.shape[1])[None]), dim=-1)[0]
    target = torch.tensor(whole[n_ctx:])
    lp = logprobs[n_ctx - 1 :]
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def test_registered_under_the_name_refusion():
    from lm_eval.api.registry import get_model

    assert get_model("refusion") is ReFusionLM


def test_loglikelihood_batched_equals_one_sequence_at_a_time(lm_parts):
    model, tok = lm_parts
    pairs = [
        ("The cat sat on the", " mat"),
        ("Two plus three is", " five; five plus five is ten."),
        ("Hello", " world!"),
        ("A slot is a run of tokens decoded", " together"),
    ]
    lm = ReFusionLM(model=model, tokenizer=tok, batch_size=3)
    got = lm.loglikelihood([request(c, x) for c, x in pairs])
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = direct_loglikelihood(model, tok, context, continuation)
        assert ll == pytest.approx(want_ll, abs=1e-4) and greedy == want_greedy
        assert ll < 0


def test_loglikelihood_is_greedy_only_for_the_argmax_continuation(lm_parts):
    model, tok = lm_parts
    ids = tok.encode("Hello there", add_special_tokens=False)
    context = list(ids)
    with torch.no_grad():
        for _ in range(3):
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])
            ids.append(int(logits[0, -1].argmax()))
    greedy = ids[len(context) :]
    other = greedy[:2] + [(greedy[2] + 1) % len(tok)]
    lm = ReFusionLM(model=model, tokenizer=tok, batch_size=2)
    (ll_greedy, is_greedy), (ll_other, is_other) = lm._score([(context, greedy), (context, other)], True)
    assert is_greedy and not is_other and ll_greedy > ll_other


def test_rolling_loglikelihood_windows(lm_parts):
    model, tok = lm_parts
    text = "Two plus three is five; five plus five is ten. The cat sat on the mat."
    full = ReFusionLM(model=model, tokenizer=tok).loglikelihood_rolling([request(text)])[0]
    (one,) = ReFusionLM(model=model, tokenizer=tok).loglikelihood([request("", text)])
    assert full == pytest.approx(one[0], abs=1e-4)
    windowed = ReFusionLM(model=model, tokenizer=tok, max_length=8).loglikelihood_rolling([request(text)])[0]
    assert windowed < 0 and windowed != pytest.approx(full, abs=1e-3)  # less context, other value


def test_generate_until_gives_each_request_its_config_in_one_batch(lm_parts):
    model, tok = lm_parts
    calls = []

    def fake_generate(model_, tokenizer, prompts, cfgs, engine_config=None, chat=True, on_output=None):
        calls.append((list(prompts), list(cfgs), engine_config, chat))
        return [SimpleNamespace(text=f"answer to {p}", finished=True) for p in prompts]

    lm = ReFusionLM(model=model, tokenizer=tok, preset="gsm8k", batch_size=2, generate_fn=fake_generate)
    kwargs_a = {"until": ["Q:"], "max_gen_toks": 64, "do_sample": False}
    kwargs_b = {"until": "more", "temperature": 0.5}
    out = lm.generate_until([request("p1", kwargs_a), request("p2", kwargs_b), request("p3", kwargs_a)])
    assert out == ["answer to p1", "answer to p2", "answer to p3"]
    ((prompts, cfgs, engine, chat),) = calls  # one engine batch for every request, whatever its settings
    assert (
        prompts == ["p1", "p2", "p3"] and not chat
    )  # lm-eval formats (and chat-templates) the context itself
    assert engine.max_batch_size == 2
    cfg_a, cfg_b = cfgs[0], cfgs[1]
    # the preset's length wins over the task's max_gen_toks, as the authors generated 512 tokens for
    # every task
    assert (cfg_a.gen_length, cfg_a.temperature, cfg_a.slot_size, cfg_a.serial_blocks) == (512, 0.0, 32, 4)
    assert cfg_a.stop == ("Q:",) and cfgs[2] == cfg_a
    assert (cfg_b.temperature, cfg_b.gen_length, cfg_b.stop) == (0.5, 512, ("more",))


def test_generation_length_model_args_then_preset_then_task(lm_parts):
    model, tok = lm_parts
    kwargs = {"until": [], "max_gen_toks": 64}

    def length(**model_args):
        return ReFusionLM(model=model, tokenizer=tok, **model_args)._config(kwargs)

    # gen_length=task: the task's max_gen_toks is cut at 64 tokens; the region is whole slots in 4 blocks
    # of 32
    task = length(preset="gsm8k", gen_length="task")
    assert (task.gen_length, task.region_length) == (64, 128)
    assert length(preset="gsm8k").gen_length == 512
    assert length(preset="gsm8k", gen_length=96).gen_length == 96
    assert length().gen_length == 64  # no preset: the task's
    from refusion.errors import ConfigError

    with pytest.raises(ConfigError, match="'task'"):
        length(gen_length="all")


def test_paper_protocol_generates_in_full_then_cuts_as_the_authors_did(lm_parts):
    model, tok = lm_parts
    seen = []

    def fake_generate(model_, tokenizer, prompts, cfgs, engine_config=None, chat=True, on_output=None):
        seen.extend(cfgs)
        ids = tok.encode("The answer is 5.\nQ: next<|im_end|>", add_special_tokens=False)
        return [SimpleNamespace(text="ignored", token_ids=ids, finished=True) for _ in prompts]

    lm = ReFusionLM(model=model, tokenizer=tok, preset="gsm8k", protocol="paper", generate_fn=fake_generate)
    (out,) = lm.generate_until([request("p", {"until": ["Q:", "<|im_end|>"], "max_gen_toks": 64})])
    assert out == "The answer is 5.\n" and seen[0].stop == () and seen[0].gen_length == 512
    rendered = lm.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "```python\n"}],
        add_generation_prompt=False,
    )
    assert rendered.endswith("<|im_start|>assistant\n```python\n")


def test_generate_until_caps_outputs_at_max_gen_toks_and_stops(lm_parts):
    """Through the real engine: max_gen_toks caps the tokens, `until` cuts the text."""
    model, tok = lm_parts
    lm = ReFusionLM(model=model, tokenizer=tok, method="ar")
    free, capped = lm.generate_until(
        [
            request("The cat", {"until": [], "max_gen_toks": 12}),
            request("The cat", {"until": [], "max_gen_toks": 3}),
        ]
    )
    assert len(tok.encode(capped, add_special_tokens=False)) <= 3 and free.startswith(capped)
    stop = free[len(capped) :][:2] if len(free) > len(capped) + 2 else None
    if stop:
        (cut,) = lm.generate_until([request("The cat", {"until": [stop], "max_gen_toks": 12})])
        assert cut == free[: free.index(stop)]


def test_unknown_model_args_are_refused(lm_parts):
    from refusion.errors import ConfigError

    model, tok = lm_parts
    with pytest.raises(ConfigError, match="slot_sise.*accepted.*slot_size"):
        ReFusionLM(model=model, tokenizer=tok, slot_sise=8)


def test_lm_eval_runs_a_tiny_local_task(lm_parts, tmp_path, monkeypatch):
    """lm-eval's own evaluator drives the plugin: a multiple-choice task (loglikelihood)
    and a generation task (generate_until) from local JSONL files."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from refusion.settings.decode import DecodeConfig

    monkeypatch.setattr(refusion, "DecodeConfig", DecodeConfig, raising=False)
    model, tok = lm_parts
    docs = [
        {
            "question": f"What is {i} plus {i}?",
            "choices": [str(2 * i), str(2 * i + 1)],
            "label": 0,
            "answer": str(2 * i),
        }
        for i in range(1, 5)
    ]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
    )
    (tmp_path / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
        'doc_to_target: answer\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n'
        "metric_list:\n  - metric: exact_match\n"
    )

    def oracle(
        model_, tokenizer, prompts, cfgs, engine_config=None, chat=True, on_output=None
    ):  # answers every question right
        texts = [str(2 * int(p.split("What is ")[1].split(" ")[0])) + "\nand more" for p in prompts]
        return [
            SimpleNamespace(text=t.split(c.stop[0])[0]) for t, c in zip(texts, cfgs)
        ]  # the engine cuts at stop strings

    lm = ReFusionLM(model=model, tokenizer=tok, batch_size=4, generate_fn=oracle)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    assert results["results"]["tiny_gen"]["exact_match,none"] == 1.0
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
