"""The distributed path on the CPU: two processes under torchrun (gloo), data parallel."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import json, os, sys, torch
torch.set_num_threads(1)
from refusion.train import TrainConfig, train
cfg = TrainConfig(**json.loads(sys.argv[1]))
result = train(cfg)
rank = int(os.environ["RANK"])
torch.save({k: v.detach().clone() for k, v in result.model.state_dict().items()}, f"{cfg.out}/rank{rank}.pt")
"""


REFUSED_WORKER = """
import json, os, sys
from refusion.errors import ConfigError
from refusion.train import TrainConfig, train
try:
    train(TrainConfig(**json.loads(sys.argv[1])))
except ConfigError as e:
    with open(os.path.join(sys.argv[2], f"refused{os.environ['RANK']}.txt"), "w") as f:
        f.write(str(e))
"""


def torchrun(tmp_path: Path, tokenizer_dir: Path, worker: str, *args: str) -> subprocess.CompletedProcess:
    """A tiny model and copy data in tmp_path, and `worker` run on them by two CPU processes,
    given the run's TrainConfig fields (out = tmp_path/out) as JSON, then `args`."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir)) + 4
    config = dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    with (tmp_path / "data.jsonl").open("w") as f:
        for _ in range(64):
            q = " ".join(rng.choice("abcdefgh") for _ in range(6))
            f.write(json.dumps({"query": q, "response": q}) + "\n")
    cfg = dict(
        init_config=str(tmp_path / "config.json"),
        tokenizer=str(tokenizer_dir),
        add_mask_token=True,
        data=str(tmp_path / "data.jsonl"),
        out=str(tmp_path / "out"),
        max_steps=3,
        batch_size=4,
        lr=1e-2,
        log_every=1,
        eval_every=0,
        save_every=2,
        progress=False,
        tensorboard=False,
    )
    (tmp_path / "worker.py").write_text(worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(tmp_path / "worker.py"),
        json.dumps(cfg),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_two_processes_train_in_step(tmp_path, tokenizer_dir):
    proc = torchrun(tmp_path, tokenizer_dir, WORKER)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between the ranks"
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["world_size"] == 2
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["samples"] == 3 * 4 * 2
    state_files = {p.name for p in (out / "checkpoints" / "step-00000003" / "train_state").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= state_files
    # the saved model holds the ranks' weights, and step 3 moved them from step 2
    from safetensors.torch import load_file

    final = load_file(out / "model.safetensors")
    step2 = load_file(out / "checkpoints" / "step-00000002" / "model.safetensors")
    assert all(torch.equal(value, ranks[0][name]) for name, value in final.items())
    assert any(not torch.equal(step2[name], final[name]) for name in final)


def test_a_locked_output_directory_stops_every_rank(tmp_path, tokenizer_dir):
    """Only the main process takes the lock, and every rank hears that it is taken: all of
    them refuse (none waits in a collective for a rank that left)."""
    from refusion.train.lock import OutLock

    lock = OutLock(tmp_path / "out")
    assert lock.acquire() is None
    try:
        proc = torchrun(tmp_path, tokenizer_dir, REFUSED_WORKER, str(tmp_path))
    finally:
        lock.release()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        said = (tmp_path / f"refused{rank}.txt").read_text()
        assert f"another trainer (pid {os.getpid()}) is writing {tmp_path / 'out'}" in said
