"""The training loop (refusion/train.py) and `refusion train`, on the CPU with tiny models."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_objective import naive_example

from refusion.cli import dispatch as cli
from refusion.errors import ConfigError, MissingMaskTokenError
from refusion.io import load
from refusion.train import TrainConfig, init_weights, list_checkpoints, train
from refusion.train.dataset import DataError, load_dataset
from refusion.train.objective import IGNORE, ObjectiveConfig, draw_slots

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate():
    """One intra-op thread (2 shared cores: more threads only fight), and accelerate's
    process-wide state cleared after each run so tests do not leak settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny Qwen3 config sized to the test tokenizer, and copy-task data (response = query)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("train")
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir)) + 4
    config = dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    (d / "config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    for name, n in (("copy.jsonl", 600), ("copy_eval.jsonl", 24)):
        with (d / name).open("w") as f:
            for _ in range(n):
                q = " ".join(rng.choice("abcdefgh") for _ in range(10))
                f.write(json.dumps({"query": q, "response": q}) + "\n")
    return d


def scratch_cfg(workdir: Path, tokenizer_dir: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        init_config=str(workdir / "config.json"),
        tokenizer=str(tokenizer_dir),
        add_mask_token=True,
        data=str(workdir / "copy.jsonl"),
        out=str(out),
        batch_size=8,
        lr=3e-3,
        log_every=1,
        eval_every=0,
        save_every=0,
        progress=False,
        tensorboard=False,
    )
    return TrainConfig(**{**base, **kw})


def naive_token_losses(model, ds, mask_id: int, repeats: int = 4) -> tuple[float, float]:
    """Mean CE per AR label and per MASK token over sequences built by the naive reading of
    docs/algorithm.md#training (test_objective.naive_example), not by the code under test."""
    cfg, gen = ObjectiveConfig(), torch.Generator().manual_seed(123)
    ar, n_ar, mdm, n_mdm = 0.0, 0, 0.0, 0
    for _ in range(repeats):
        for i in range(len(ds)):
            ids, m = ds[i]
            ids = ids.tolist()
            seq = naive_example(ids[:m], ids[m:], draw_slots(1, len(ids), cfg, gen), 0, mask_id)
            with torch.no_grad():
                logp = model(torch.tensor([seq["input_ids"]]), torch.tensor([seq["position_ids"]]))[
                    0
                ].log_softmax(-1)
            for t, (a, b) in enumerate(zip(seq["ar_labels"], seq["mdm_labels"])):
                if a != IGNORE:
                    ar, n_ar = ar - float(logp[t, a]), n_ar + 1
                if b != IGNORE:
                    mdm, n_mdm = mdm - float(logp[t, b]), n_mdm + 1
    return ar / n_ar, mdm / n_mdm


def test_training_lowers_both_loss_parts(workdir, tokenizer_dir, tmp_path):
    """300 steps of a tiny model on a copy task. Judged on sequences built by the naive
    reference, where the tokens are letters (entropy ln 8 = 2.08 per token): the correct
    objective gets AR ~0.66 and MASK ~1.23 nats; feeding physical instead of true positions
    gets ~1.0 and ~1.52, forgetting to replace masked tokens by MASK ~3.7 on the MASK part,
    labelling clean tokens with themselves ~9 on the AR part."""
    cfg = scratch_cfg(
        workdir,
        tokenizer_dir,
        tmp_path / "run",
        max_steps=300,
        batch_size=16,
        lr=1e-2,
        warmup_steps=10,
        log_every=50,
        eval_data=str(workdir / "copy_eval.jsonl"),
        eval_every=150,
    )
    result = train(cfg)
    model, tokenizer = load(tmp_path / "run")
    ds, _ = load_dataset(workdir / "copy_eval.jsonl", tokenizer, 512)
    ar, mdm = naive_token_losses(model, ds, model.config.mask_token_id)
    torch.manual_seed(0)
    ar0, mdm0 = naive_token_losses(init_weights(model), ds, model.config.mask_token_id)
    assert ar0 > 5 and mdm0 > 5  # ln(vocab ~300) at the start
    assert ar < 0.85 and mdm < 1.4, (ar, mdm)
    # the loop's own records agree: both parts fall, the eval split is scored
    logs = [r for r in result.history if "loss" in r]
    evals = [r for r in result.history if "eval_loss" in r]
    assert logs[-1]["ar_loss"] < logs[0]["ar_loss"] and logs[-1]["mdm_loss"] < logs[0]["mdm_loss"]
    assert len(evals) == 2
    for part in ("eval_ar_loss", "eval_mdm_loss"):
        assert evals[-1][part] < evals[0][part]


KILL_SCRIPT = """
import os, signal, sys, torch
torch.set_num_threads(1)
from refusion.train import TrainConfig, train
cfg = TrainConfig(**{cfg!r})
def on_step(step):
    if step == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
train(cfg, on_step=on_step)
"""


def test_a_run_killed_and_resumed_matches_an_uninterrupted_run_bitwise(workdir, tokenizer_dir, tmp_path):
    common = dict(max_steps=12, batch_size=4, grad_accum=2, save_every=5, eval_every=4, keep_checkpoints=1)
    whole = train(scratch_cfg(workdir, tokenizer_dir, tmp_path / "whole", **common))
    assert whole.step == 12
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    # the interrupted run: SIGKILL after step 7 (checkpoint at 5, steps 6-7 lost)
    out = tmp_path / "killed"
    cfg = scratch_cfg(workdir, tokenizer_dir, out, **common)
    script = KILL_SCRIPT.format(cfg=vars(cfg), kill_at=7)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["step-00000005"]
    assert not (out / "config.json").exists()  # no final model
    (out / "checkpoints" / ".tmp-step-00000010").mkdir()  # as a kill during a save leaves it
    resumed = train(scratch_cfg(workdir, tokenizer_dir, out, resume=True, **common))
    assert resumed.step == 12
    assert resumed.history[0]["event"] == "start" and resumed.history[0]["step"] == 5  # not a fresh start
    logged = [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged == list(range(1, 8)) + list(range(6, 13))
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resuming"
    assert [p.name for p in list_checkpoints(out)] == ["step-00000012"]  # keep_checkpoints=1
    state = json.loads((out / "checkpoints" / "step-00000012" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["samples"] == 12 * 2 * 4
    assert (out / "checkpoints" / "step-00000012" / "train_state" / "optimizer.bin").is_file()
    # a checkpoint is a model directory too
    model, _ = load(out / "checkpoints" / "step-00000012")
    assert model.config.mask_token_id is not None


def test_base_model_without_mask_is_refused_unless_asked_to_add_it(make_hf_dir, workdir, tmp_path):
    base = make_hf_dir("qwen3")
    cfg = dict(
        model=str(base),
        data=str(workdir / "copy.jsonl"),
        max_steps=2,
        batch_size=4,
        progress=False,
        tensorboard=False,
        eval_every=0,
        save_every=0,
    )
    with pytest.raises(MissingMaskTokenError, match=r"refusion convert.*--add-mask-token"):
        train(TrainConfig(out=str(tmp_path / "a"), **cfg))
    result = train(TrainConfig(out=str(tmp_path / "b"), add_mask_token=True, **cfg))
    ours, tokenizer = load(tmp_path / "b")
    assert ours.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert result.history[-1]["event"] == "end"
    # the output loads in transformers too, with the same logits
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, ours.config.mask_token_id, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(5)[None]), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_ar_objective_needs_no_mask_and_has_no_mdm_part(make_hf_dir, workdir, tmp_path):
    base = make_hf_dir("llama")
    result = train(
        TrainConfig(
            model=str(base),
            data=str(workdir / "copy.jsonl"),
            out=str(tmp_path / "ar"),
            objective="ar",
            max_steps=6,
            batch_size=8,
            lr=3e-3,
            log_every=1,
            progress=False,
            tensorboard=False,
            eval_every=0,
            save_every=0,
        )
    )
    logs = [r for r in result.history if "loss" in r]
    assert all(r["mdm_loss"] == 0 for r in logs)
    assert logs[-1]["ar_loss"] < logs[0]["ar_loss"]


def test_lora_adapters_are_merged_into_the_saved_weights(make_hf_dir, workdir, tmp_path):
    pytest.importorskip("peft")
    base = make_hf_dir("qwen2")  # tied embeddings
    result = train(
        TrainConfig(
            model=str(base),
            data=str(workdir / "copy.jsonl"),
            out=str(tmp_path / "lora"),
            add_mask_token=True,
            lora=True,
            lora_r=4,
            lora_targets=("q_proj", "v_proj", "down_proj"),
            max_steps=4,
            batch_size=4,
            lr=1e-2,
            progress=False,
            tensorboard=False,
            eval_every=0,
            save_every=0,
        )
    )
    trained = result.model.eval()
    trainable = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    merged, _ = load(tmp_path / "lora")
    before = load_file(base / "model.safetensors")
    after = load_file(tmp_path / "lora" / "model.safetensors")
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(before[q], after[q])  # adapted, merged
    assert torch.equal(before[k], after[k])  # no adapter
    ids = torch.tensor([[1, 5, 9, 3, merged.config.mask_token_id]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(ids, torch.arange(5)[None]), trained(ids, torch.arange(5)[None]), rtol=1e-4, atol=1e-5
        )


def test_gradient_checkpointing_changes_memory_not_results(workdir, tokenizer_dir, tmp_path):
    plain = train(scratch_cfg(workdir, tokenizer_dir, tmp_path / "a", max_steps=2))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    ckpt = train(
        scratch_cfg(workdir, tokenizer_dir, tmp_path / "b", max_steps=2, gradient_checkpointing=True)
    )
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_logs_and_output_directory(workdir, tokenizer_dir, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    train(scratch_cfg(workdir, tokenizer_dir, out, max_steps=4, log_every=2, eval_every=2, tensorboard=True))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1]["event"] == "end"
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]
    for key in (
        "ar_loss",
        "mdm_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "objective_share",
        "eta_s",
        "epoch",
    ):
        assert key in steps[0], key
    assert 0 < steps[0]["objective_share"] < 1
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file()
    assert not list(out.glob(".final*"))


def test_bad_configurations_and_inputs_get_their_errors(workdir, tokenizer_dir, tmp_path):
    ok = scratch_cfg(workdir, tokenizer_dir, tmp_path / "x", max_steps=1)
    cases = [
        (dict(data=""), ConfigError, "no training data"),
        (dict(model="some/model"), ConfigError, "exactly one of"),
        (dict(init_config=None), ConfigError, "exactly one of"),
        (dict(tokenizer=None), ConfigError, "needs a tokenizer"),
        (dict(objective="bert"), ConfigError, "objective"),
        (dict(slot_sizes=(0,)), ConfigError, "slot sizes"),
        (dict(batch_size=0), ConfigError, "batch_size"),
        (dict(data=str(tmp_path / "missing.jsonl")), DataError, "does not exist"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            train(TrainConfig(**{**vars(ok), **change}))
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.loads((workdir / "config.json").read_text()), "vocab_size": 10}))
    with pytest.raises(ConfigError, match="vocab_size 10"):
        train(TrainConfig(**{**vars(ok), "init_config": str(small)}))
    # an output directory with checkpoints needs --resume
    train(TrainConfig(**{**vars(ok), "out": str(tmp_path / "y")}))
    with pytest.raises(ConfigError, match="--resume"):
        train(TrainConfig(**{**vars(ok), "out": str(tmp_path / "y")}))


def test_cli_flags_mirror_the_config(workdir, tokenizer_dir, tmp_path, capsys):
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "train",
            "--data",
            "d.jsonl",
            "--out",
            "o",
            "--model",
            "m",
            "--slot-sizes",
            "4",
            "8",
            "--no-progress",
            "--lora",
            "--lr",
            "2e-4",
            "--objective",
            "ar",
            "--max-steps",
            "7",
        ]
    )
    from refusion.train import config_fields

    values = {f.name: getattr(args, f.name) for f in config_fields()}
    cfg = TrainConfig(**values)
    want = TrainConfig(
        data="d.jsonl",
        out="o",
        model="m",
        slot_sizes=(4, 8),
        progress=False,
        lora=True,
        lr=2e-4,
        objective="ar",
        max_steps=7,
    )
    assert vars(cfg) == vars(want)  # every other flag defaults to the field's default
    # an error is one line and exit code 2
    code = cli.main(
        [
            "train",
            "--init-config",
            str(workdir / "config.json"),
            "--tokenizer",
            str(tokenizer_dir),
            "--data",
            str(tmp_path / "nope.jsonl"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err
    # the command trains end to end
    code = cli.main(
        [
            "train",
            "--init-config",
            str(workdir / "config.json"),
            "--tokenizer",
            str(tokenizer_dir),
            "--add-mask-token",
            "--data",
            str(workdir / "copy.jsonl"),
            "--out",
            str(tmp_path / "cli"),
            "--max-steps",
            "2",
            "--batch-size",
            "2",
            "--no-progress",
            "--no-tensorboard",
        ]
    )
    assert code == 0 and (tmp_path / "cli" / "model.safetensors").is_file()
    assert "--add-mask-token" in textwrap.dedent(
        subprocess.run(
            [sys.executable, "-m", "refusion.cli", "train", "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        ).stdout
    )
