"""The model bundled with the package: it loads with no argument (ours and transformers'),
ReFusion decoding on it commits more than one token per forward, and the evaluator runs
end to end on it offline."""

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


def test_both_bundled_models_ship_and_fit_the_package_budget():
    assert bundled_names() == ["ar-tiny", "refusion-tiny"]
    assert sum(f.stat().st_size for f in BUNDLED_ROOT.rglob("*") if f.is_file()) < 40 * 2**20
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
    with pytest.raises(CheckpointError, match="bundled:ar-tiny, bundled:refusion-tiny"):
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
