"""What keeps a training run from going wrong quietly: a resume with changed settings, two
trainers on one output directory, records too long for the limit, the library noise of
saving tied embeddings, and CLI errors that name flags. CPU, tiny models (test_train's)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_train
import torch
from safetensors.torch import load_file
from test_train import REPO, scratch_cfg

from refusion import cli
from refusion.errors import ConfigError
from refusion.io import load, load_metadata
from refusion.train import TrainConfig, lr_factor, train
from refusion.train.lock import LOCK_FILE, OutLock

# test_train's fixtures: one thread and a fresh accelerate per test, the tiny model and copy data
_one_thread_and_fresh_accelerate = test_train._one_thread_and_fresh_accelerate
workdir = test_train.workdir

SAMPLE_DATA = Path("/work/shared/data/refusion_train_sample.json")  # 100 records of the authors' format


def fresh_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def cli_train(workdir: Path, tokenizer_dir: Path, out: Path, *flags: str) -> int:
    return cli.main(
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
            str(out),
            "--batch-size",
            "4",
            "--eval-every",
            "0",
            "--save-every",
            "0",
            "--no-progress",
            "--no-tensorboard",
            *flags,
        ]
    )


# ------------------------------------------------------------------ resume with other settings
def test_resume_with_changed_settings_is_refused_unless_allowed(workdir, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    common = dict(max_steps=3, batch_size=4)
    train(scratch_cfg(workdir, tokenizer_dir, out, **common))
    fresh_accelerate()
    capsys.readouterr()
    # changed schedule, learning rate and batch: one line naming each, and the flag that accepts them
    code = cli_train(
        workdir, tokenizer_dir, out, "--resume", "--max-steps", "5", "--lr", "1e-3", "--grad-accum", "2"
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for change in (
        "--max-steps 3 -> 5",
        "--lr 0.003 -> 0.001",
        "--grad-accum 1 -> 2",
        "pass --allow-config-change",
    ):
        assert change in err, err
    fresh_accelerate()
    # how often the run logs, evaluates and saves may change freely (step 3 of 3: nothing to train)
    again = train(
        scratch_cfg(
            workdir,
            tokenizer_dir,
            out,
            resume=True,
            log_every=7,
            eval_every=1,
            save_every=9,
            keep_checkpoints=5,
            **common,
        )
    )
    assert again.step == 3
    fresh_accelerate()
    # allowed: one line says what changed, and the run goes on with the new values
    changed = dict(max_steps=5, lr=1e-3, grad_accum=2, weight_decay=0.1)
    resumed = train(
        scratch_cfg(
            workdir, tokenizer_dir, out, resume=True, allow_config_change=True, **{**common, **changed}
        )
    )
    said = [line for line in capsys.readouterr().err.splitlines() if "changed settings" in line]
    assert len(said) == 1 and "--max-steps 3 -> 5" in said[0] and "--weight-decay 0.0 -> 0.1" in said[0], said
    logs = [r for r in resumed.history if "loss" in r]
    assert [r["step"] for r in logs] == [4, 5]
    warmup = max(1, int(0.03 * 5))
    for r in logs:  # the new peak and schedule
        assert r["lr"] == pytest.approx(1e-3 * lr_factor(r["step"], 5, warmup, 0.1), rel=1e-12)
        assert "grad_norm" in r  # gradients synced on the last of the 2 micro-batches, not before
    assert logs[-1]["samples"] == 3 * 4 + 2 * 2 * 4
    opt = torch.load(
        out / "checkpoints" / "step-00000005" / "train_state" / "optimizer.bin", weights_only=False
    )
    assert {float(s["step"]) for s in opt["state"].values()} == {5.0}  # one AdamW step per optimizer step
    assert [g["weight_decay"] for g in opt["param_groups"]] == [0.1, 0.0]
    assert opt["param_groups"][0]["lr"] == pytest.approx(logs[-1]["lr"], rel=1e-12)


# ------------------------------------------------------------------ one trainer per directory
HOLD_LOCK = """
import sys, time
from pathlib import Path
from refusion.train.lock import OutLock
assert OutLock(Path(sys.argv[1])).acquire() is None
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_trainer_on_the_same_out_is_refused_until_the_first_exits(
    workdir, tokenizer_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        refusal = f"another trainer (pid {holder.pid}) is writing {out}"
        code = cli_train(workdir, tokenizer_dir, out, "--max-steps", "1")
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and refusal in err and "--out" in err, err
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            train(scratch_cfg(workdir, tokenizer_dir, out, max_steps=1, resume=True))
        assert not (out / "log.jsonl").exists()  # refused before writing anything
    finally:
        holder.kill()  # SIGKILL: the kernel drops its lock
        holder.wait()
    first = train(scratch_cfg(workdir, tokenizer_dir, out, max_steps=1))
    assert first.step == 1
    fresh_accelerate()
    # a finished run lets go too: the next one (in this same process) proceeds
    resumed = train(scratch_cfg(workdir, tokenizer_dir, out, max_steps=1, resume=True))
    assert resumed.history[0]["event"] == "start"


def test_no_lock_file_is_left_after_a_finished_or_a_failed_run(workdir, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_train(workdir, tokenizer_dir, out, "--max-steps", "1") == 0
    assert (out / "log.jsonl").is_file() and not (out / LOCK_FILE).exists()
    fresh_accelerate()

    def fail(step: int) -> None:
        raise RuntimeError("a failure mid-run")

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="mid-run"):
        train(scratch_cfg(workdir, tokenizer_dir, failed, max_steps=3), on_step=fail)
    assert (failed / "log.jsonl").is_file() and not (failed / LOCK_FILE).exists()


def test_a_lock_file_deleted_as_it_is_opened_is_not_the_one_locked(tmp_path, monkeypatch):
    """A trainer that opens the file just before the one ending deletes it locks the file
    at the path, not the deleted one: else a third trainer would lock the new file too."""
    first = OutLock(tmp_path)
    assert first.acquire() is None
    stale = os.open(first.path, os.O_RDWR)  # the second trainer opens it ...
    first.release()  # ... as the first deletes it and lets go
    opens, real_open = iter([stale]), os.open
    monkeypatch.setattr(os, "open", lambda *a: next(opens, None) or real_open(*a))
    second = OutLock(tmp_path)
    assert second.acquire() is None and second.fd != stale
    third = OutLock(tmp_path)
    assert third.acquire() == str(os.getpid())  # refused: the second holds the file at the path
    second.release()
    assert not first.path.exists()


# ------------------------------------------------------------------ records too long
@pytest.mark.skipif(not SAMPLE_DATA.is_file(), reason="the shared sample data is not on this machine")
def test_the_too_long_count_says_the_limit_the_lengths_and_the_flag(tmp_path, capfd):
    from refusion.train.data import RunData
    from refusion.train.log import RunLog

    def summary(max_length: int, context: int = 512) -> str:
        config, tokenizer = load_metadata(None)  # the bundled model: 512 positions
        config.max_position_embeddings = context
        cfg = TrainConfig(data=str(SAMPLE_DATA), out=str(tmp_path), max_length=max_length, eval_fraction=0)
        RunData(cfg, tokenizer, config, tokenizer.eos_token_id, 0, RunLog(tmp_path, main=True))
        return capfd.readouterr().err

    def kept(text: str) -> int:
        return int(re.search(r"(\d+) of 100 records kept", text).group(1))

    at_context = summary(2048)  # the default, capped at the model's context
    assert "70 too long (over the limit of 512 tokens: median " in at_context, at_context
    longest = int(re.search(r"longest (\d+)", at_context).group(1))
    assert longest > 512
    assert (
        "512 tokens is the model's context (max_position_embeddings), which --max-length cannot exceed"
        in at_context
    )
    assert (
        "Token indices sequence length" not in at_context
    )  # the tokenizer's warning: explained by the line above
    below = summary(300)
    assert "over the limit of 300 tokens" in below
    assert (
        "pass --max-length 512 (the model's context, the most it allows) "
        f"to keep {kept(at_context) - kept(below)} of them"
    ) in below
    roomy = summary(512, context=longest)
    assert f"pass --max-length {longest} to keep them" in roomy


# ------------------------------------------------------------------ quiet saves of tied embeddings
def test_checkpoints_of_tied_embeddings_save_quietly_and_load_back(
    workdir, tokenizer_dir, tmp_path, capfd, caplog, recwarn
):
    tied = tmp_path / "tied.json"
    tied.write_text(
        json.dumps({**json.loads((workdir / "config.json").read_text()), "tie_word_embeddings": True})
    )
    out = tmp_path / "run"
    cfg = dict(init_config=str(tied), max_steps=2, save_every=1)
    with caplog.at_level(logging.INFO):
        result = train(scratch_cfg(workdir, tokenizer_dir, out, **cfg))
    printed = capfd.readouterr()
    noise = "Removed shared tensor"
    assert noise not in printed.err + printed.out
    assert not [r for r in caplog.records if noise in r.getMessage()]
    assert not [w for w in recwarn if noise in str(w.message)]
    trained = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    # the checkpoint is the trained model, its output matrix stored once and tied on loading
    ckpt = out / "checkpoints" / "step-00000002"
    model, _ = load(ckpt)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    state = load_file(ckpt / "train_state" / "model.safetensors")
    assert "lm.lm_head.weight" not in state
    assert torch.equal(state["lm.model.embed_tokens.weight"], trained["model.embed_tokens.weight"])
    fresh_accelerate()
    resumed = train(
        scratch_cfg(workdir, tokenizer_dir, out, resume=True, **cfg)
    )  # step 2 of 2: loads, trains nothing
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, trained[name]), name


# ------------------------------------------------------------------ CLI errors name flags
def test_cli_errors_name_flags_where_the_api_names_arguments(workdir, tokenizer_dir, tmp_path, capsys):
    data, out = str(workdir / "copy.jsonl"), str(tmp_path / "o")
    code = cli.main(["train", "--data", data, "--out", out])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "give exactly one of --model BASE or --init-config config.json" in err, err
    with pytest.raises(ConfigError, match=r"give exactly one of model=BASE or init_config=config\.json"):
        train(TrainConfig(data=data, out=out))
    code = cli_train(workdir, tokenizer_dir, tmp_path / "o", "--grad-accum", "0")
    assert code == 2 and "--batch-size and --grad-accum must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_fine_tune_keeps_the_base_model_s_decode_settings(model_dir, workdir, tmp_path):
    """decode_config.json travels from the base to every checkpoint and the final model."""
    from refusion.settings.recommended import FILE, Recommended

    rec = Recommended(decode={"slot_size": 4, "gen_length": 16}, about="a tuned tiny model")
    rec.write(model_dir)
    out = tmp_path / "ft"
    train(
        TrainConfig(
            model=str(model_dir),
            data=str(workdir / "copy.jsonl"),
            out=str(out),
            max_steps=2,
            batch_size=4,
            log_every=1,
            progress=False,
            tensorboard=False,
            eval_every=0,
            save_every=1,
        )
    )
    assert Recommended.read(out) == rec
    assert Recommended.read(out / "checkpoints" / "step-00000002") == rec
    assert (out / FILE).is_file()


# ------------------------------------------------------------------ a data path that is not a file
@pytest.mark.parametrize("data", ["/dev/zero", "fifo"])
def test_train_refuses_a_data_path_that_is_not_a_regular_file(
    workdir, tokenizer_dir, tmp_path, capsys, within, data
):
    """/dev/zero (an endless line) and a FIFO (a read that never returns) are refused
    before a model is built, in one line."""
    if data == "fifo":
        data = str(tmp_path / "data.jsonl")
        os.mkfifo(data)
    with within(60):
        code = cli_train(workdir, tokenizer_dir, tmp_path / "o", "--data", data)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert data in err and "not a regular file" in err and "--data" in err
    assert not (tmp_path / "o").exists()


def test_train_refuses_a_tokenizer_file_that_is_a_fifo(workdir, tokenizer_dir, tmp_path, capsys, within):
    """--tokenizer DIR is checked as a checkpoint's tokenizer is: a FIFO in a file's place
    would block the read."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tokenizer)
    (tokenizer / "tokenizer.json").unlink()
    os.mkfifo(tokenizer / "tokenizer.json")
    with within(60):
        code = cli_train(workdir, tokenizer, tmp_path / "o")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert str(tokenizer / "tokenizer.json") in err and "FIFO" in err
