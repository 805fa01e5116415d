"""Self-distillation data (`train/distill.py`, `refusion distill`): each kept answer is the
model's greedy AR answer to its prompt, a stopped run goes on where it ended, prompts with
no room in the context are skipped and counted, and the file trains."""

from __future__ import annotations

import json

import pytest

import refusion
from refusion.cli import main
from refusion.decode import DecodeConfig, generate
from refusion.tasks import make_split
from refusion.train.distill import Prompt, answered_keys, distill, file_prompts, self_prompts


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


def suite(n):
    return [Prompt(it.prompt, "suite") for it in make_split("train", n, seed=5)]


def test_answers_are_the_models_greedy_ar_answers_and_a_stopped_run_goes_on(bundled, tmp_path):
    model, tok = bundled
    prompts, out = suite(6), tmp_path / "d.jsonl"
    stats = distill(model, tok, prompts, out, max_new_tokens=96, batch_size=4)
    lines = out.read_text().splitlines()
    assert stats.answered == len(lines) >= 4 and stats.done_before == 0
    want = generate(model, tok, [p.text for p in prompts], DecodeConfig(method="ar", gen_length=96))
    by_query = {p.text: o.text.strip() for p, o in zip(prompts, want) if o.finish_reason == "stop"}
    records = [json.loads(x) for x in lines]
    assert {r["query"]: r["response"] for r in records} == by_query
    # a run stopped after two answers (the rest of the file lost, the last line cut in half)
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    again = distill(model, tok, prompts, out, max_new_tokens=96, batch_size=4)
    assert again.done_before == 2 and again.answered == len(lines) - 2
    assert answered_keys(out) == {r["key"] for r in records}
    assert distill(model, tok, prompts, out, max_new_tokens=96).todo == 0


def test_prompts_without_room_are_skipped_and_counted(bundled, tmp_path):
    model, tok = bundled
    long = Prompt("word " * 600, "file")
    stats = distill(model, tok, [long, *suite(1)], tmp_path / "d.jsonl", max_new_tokens=32)
    assert stats.too_long == 1 and stats.todo == 1


def test_the_model_writes_requests_from_the_opening_of_a_user_turn(bundled):
    model, tok = bundled
    mine = self_prompts(model, tok, 6, seed=0, max_tokens=64)
    assert mine and all(p.source == "self" and p.text for p in mine)
    assert len({p.text for p in mine}) == len(mine)


def test_file_prompts_read_queries_and_first_user_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"query": "a?"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "b?"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows + [{"nothing": 1}]))
    assert [p.text for p in file_prompts(f)] == ["a?", "b?"]


def test_the_cli_writes_a_file_that_trains(tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    assert main(["distill", "--out", str(out), "--suite", "4", "--max-new-tokens", "96"]) == 0
    assert "answers added (suite" in capsys.readouterr().out
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--model",
            "bundled:refusion-tiny",
            "--data",
            str(out),
            "--out",
            str(run),
            "--max-steps",
            "1",
        ]
        + ["--batch-size", "2"]
    )
    assert code == 0 and (run / "model.safetensors").exists()


def test_the_cli_needs_prompts(capsys):
    assert main(["distill", "--out", "x.jsonl"]) == 2
    assert "no prompts" in capsys.readouterr().err
