"""FSDP and DeepSpeed ZeRO-2 / ZeRO-3 on the CPU: test_train_distributed's two-process run
(gloo, tiny model) under each engine's launch config, against the same run under DDP.
Each must follow DDP's losses, really shard its training state, resume after SIGKILL
exactly where it stopped, and leave an ordinary model directory, gathered on rank 0, that
transformers loads with our logits. DeepSpeed's cases are skipped where it is not installed;
its refusal where it is missing is tested everywhere (deepspeed hidden), as are the other
refusals, in one process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import test_train
import torch
from safetensors.torch import load_file
from test_train_distributed import REPO, torchrun
from test_train_guards import cli_train

_one_thread_and_fresh_accelerate = test_train._one_thread_and_fresh_accelerate
workdir = test_train.workdir

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install --no-build-isolation deepspeed)"
)

# test_train_distributed's run (3 steps, checkpoints at 2 and 3) with accumulation, so that
# the engines' no-sync micro-batches and their clipping (lr 1e-2: every step clips) are used
OVERRIDES = {"grad_accum": 2}

# the run's config and the step at which rank 0 kills itself (0: never), as argv
SHARDED_WORKER = """
import json, os, signal, sys, torch
torch.set_num_threads(1)
from refusion.train import TrainConfig, train
cfg = TrainConfig(**{**json.loads(sys.argv[1]), **json.loads(sys.argv[2])})
kill = int(sys.argv[3])
def on_step(step):
    if step == kill and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
train(cfg, on_step=on_step)
"""

ENGINES = {
    "fsdp": pytest.param("configs/fsdp.yaml", "pytorch_model_fsdp_0", id="fsdp"),
    "zero2": pytest.param("configs/deepspeed_zero2.yaml", "pytorch_model", id="zero2", marks=needs_deepspeed),
    "zero3": pytest.param("configs/deepspeed_zero3.yaml", "pytorch_model", id="zero3", marks=needs_deepspeed),
}


def launch_env(config: str) -> dict[str, str]:
    """The engine's environment that `accelerate launch --config_file CONFIG` gives each
    process (ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_USE_DEEPSPEED, ...), made by
    accelerate itself, without its rendezvous settings (torchrun's own are used)."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / config), "--num_processes", "2", "x.py"]
    )
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as launch_command fills it in before calling the DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", "DEEPSPEED"))}


def run(tmp_path: Path, tokenizer_dir: Path, name: str, kill: int = 0, **overrides):
    """test_train_distributed's two-process run in tmp_path/name (its output in .../out)."""
    where = tmp_path / name
    where.mkdir(exist_ok=True)
    return torchrun(where, tokenizer_dir, SHARDED_WORKER, json.dumps({**OVERRIDES, **overrides}), str(kill))


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def ok(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tokenizer_dir) -> Path:
    """The reference: the same run under DDP."""
    tmp = tmp_path_factory.mktemp("ddp")
    proc = run(tmp, tokenizer_dir, "ddp")
    assert proc.returncode == 0, ok(proc)
    return tmp / "ddp" / "out"


def use_engine(config: str, monkeypatch) -> None:
    for key, value in launch_env(config).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("config, sharded_state", ENGINES.values())
def test_engine_follows_ddp_resumes_and_saves_a_plain_model(
    config, sharded_state, ddp_run, tmp_path, tokenizer_dir, monkeypatch
):
    use_engine(config, monkeypatch)
    proc = run(tmp_path, tokenizer_dir, "full")
    assert proc.returncode == 0, ok(proc)
    out = tmp_path / "full" / "out"
    # the same losses as DDP, step by step
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(ddp_run)), rtol=1e-5, atol=0)
    # the training state is the engine's sharded one, not DDP's whole-model files
    state = {p.name for p in (out / "checkpoints" / "step-00000003" / "train_state").iterdir()}
    assert sharded_state in state and "model.safetensors" not in state, state
    # the final model: whole weights gathered on rank 0, close to DDP's, loadable by
    # refusion and transformers with the same logits
    final, reference = load_file(out / "model.safetensors"), load_file(ddp_run / "model.safetensors")
    assert final.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=0, atol=1e-5, msg=name)
    from transformers import AutoModelForCausalLM

    from refusion import load

    ours, _ = load(str(out))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, torch.arange(9).expand(2, 9)), hf(ids).logits, rtol=1e-5, atol=1e-5
        )
    # killed after step 3's update, before its checkpoint: resumed from step 2, the same run
    killed = run(tmp_path, tokenizer_dir, "cut", kill=3)
    assert killed.returncode != 0
    resumed = run(tmp_path, tokenizer_dir, "cut", resume=True)
    assert resumed.returncode == 0, ok(resumed)
    again = load_file(tmp_path / "cut" / "out" / "model.safetensors")
    for name in final:
        assert torch.equal(again[name], final[name]), f"{name} differs after the resume"


def test_lora_under_fsdp_follows_ddp(tmp_path, tokenizer_dir, monkeypatch):
    """FSDP2 shards frozen base weights and trainable adapters alike; the saved model has
    the adapters merged, as under DDP."""
    lora = {"lora": True, "lora_r": 4}
    reference = run(tmp_path, tokenizer_dir, "ddp", **lora)
    assert reference.returncode == 0, ok(reference)
    use_engine("configs/fsdp.yaml", monkeypatch)
    proc = run(tmp_path, tokenizer_dir, "fsdp", **lora)
    assert proc.returncode == 0, ok(proc)
    ddp, fsdp = tmp_path / "ddp" / "out", tmp_path / "fsdp" / "out"
    torch.testing.assert_close(torch.tensor(losses(fsdp)), torch.tensor(losses(ddp)), rtol=1e-5, atol=0)
    final, expected = load_file(fsdp / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert final.keys() == expected.keys() and not any("lora" in name for name in final)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=1e-5, msg=name)


def test_a_deepspeed_config_without_deepspeed_is_refused_in_one_line(
    workdir, tokenizer_dir, tmp_path, monkeypatch, capsys
):
    """Before accelerate builds its plugin (which would fail with an ImportError's stack
    trace): deepspeed is hidden here, so this runs whether or not it is installed."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    code = cli_train(workdir, tokenizer_dir, tmp_path / "out", "--max-steps", "1")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "uses DeepSpeed, which is not installed: pip install --no-build-isolation deepspeed" in err
        and "configs/ddp.yaml" in err
    ), err


def test_fsdp1_on_the_cpu_is_refused_in_one_line(workdir, tokenizer_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    code = cli_train(workdir, tokenizer_dir, tmp_path / "out", "--max-steps", "1", "--cpu")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "fsdp_version: 2" in err, err


@pytest.mark.parametrize("engine", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_cpu_with_a_sharding_config_on_a_gpu_machine_is_refused_in_one_line(
    engine, workdir, tokenizer_dir, tmp_path, monkeypatch, capsys
):
    import refusion.train.run

    monkeypatch.setattr(refusion.train.run, "has_accelerator", lambda: True)
    monkeypatch.setenv(engine, "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    code = cli_train(workdir, tokenizer_dir, tmp_path / "out", "--max-steps", "1", "--cpu")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--cpu with a " in err and "drop --cpu, or launch with configs/ddp.yaml" in err, err
