"""`refusion bench curve RUN`: the learning curve of a real (four-step) ReFusion run of
the bundled model, read back from its checkpoints and log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from refusion.cli.dispatch import main
from refusion.io import BUNDLED_DIR

pytest.importorskip("matplotlib")


def test_curve_decodes_each_checkpoint_and_reads_the_losses(tmp_path, capsys):
    data, run = tmp_path / "train.jsonl", tmp_path / "run"
    subprocess.run([sys.executable, "-m", "refusion.tasks", "data", "train", "64", str(data)], check=True)
    assert (
        main(
            [
                "train",
                "--model",
                str(BUNDLED_DIR),
                "--data",
                str(data),
                "--out",
                str(run),
                "--objective",
                "refusion",
                "--max-steps",
                "4",
                "--batch-size",
                "4",
                "--save-every",
                "2",
                "--eval-every",
                "2",
                "--keep-checkpoints",
                "0",
                "--lr",
                "1e-3",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["bench", "curve", str(run), "--every", "2", "--limit", "4"]) == 0
    curve = json.loads((run / "curve.json").read_text())
    assert [p["step"] for p in curve["points"]] == [0, 2, 4]
    assert curve["points"][0]["model"] == str(BUNDLED_DIR) and curve["ar_reference"]["tpf"] == 1.0
    assert [x["step"] for x in curve["losses"]] == [2, 4] and all(x["mdm"] > 0 for x in curve["losses"])
    assert (run / "curve.png").stat().st_size > 10_000
    # how far each point's MASK drafts reach along its greedy AR answers: the trained bundled
    # model's drafts pass at the next token more often than not
    reach = curve["points"][0]["reach"]
    assert reach["points"] > 4 * 10 and len(reach["match"]) == 4 and reach["match"][0] > 0.5
    # step 0 is the base model as `bench suite` decodes it: same tokens and forwards per item
    assert main(["bench", "suite", "--limit", "4", "--no-sweep", "--out", str(tmp_path / "suite")]) == 0
    suite = json.loads((tmp_path / "suite" / "suite.json").read_text())
    refusion_row = next(r for r in suite["table"] if r["key"] == "refusion")
    step0 = curve["points"][0]
    assert (step0["tokens"], step0["nfe"], step0["accuracy"]) == (
        refusion_row["tokens"],
        refusion_row["nfe"],
        refusion_row["accuracy"],
    )
    assert "AR decoding" in capsys.readouterr().out
    # run again: nothing is decoded again; a rewritten checkpoint is; a pruned one keeps its point
    import shutil

    import refusion.bench.curve as curve_mod

    decoded = []
    real = curve_mod.decode_all
    curve_mod.decode_all = lambda path, *a: decoded.append(str(path)) or real(path, *a)
    try:
        assert main(["bench", "curve", str(run), "--every", "2", "--limit", "4"]) == 0
        assert decoded == []
        assert json.loads((run / "curve.json").read_text())["points"] == curve["points"]
        config = run / "checkpoints" / "step-00000004" / "config.json"
        config.write_text(config.read_text())  # written again, as a new run into the same --out would
        shutil.rmtree(run / "checkpoints" / "step-00000002")
        assert main(["bench", "curve", str(run), "--every", "2", "--limit", "4"]) == 0
    finally:
        curve_mod.decode_all = real
    assert decoded == [str(run / "checkpoints" / "step-00000004")]
    again = json.loads((run / "curve.json").read_text())["points"]
    assert [p["step"] for p in again] == [0, 2, 4] and again[:2] == curve["points"][:2]
    assert (again[2]["tokens"], again[2]["nfe"]) == (curve["points"][2]["tokens"], curve["points"][2]["nfe"])

    # --prompts-from: a file's prompts; a point scores the outputs identical to the file's answers
    from refusion import generate, load
    from refusion.bench.suite import SUITE_DEFAULTS

    model, tokenizer = load(BUNDLED_DIR)
    prompts = ["Reverse the list [3, 1, 2].", "What is 7 plus 8?", "Sort: pear, fig."]
    greedy = generate(model, tokenizer, prompts[:2], SUITE_DEFAULTS.replace(method="ar"))
    records = [{"query": q, "response": o.text} for q, o in zip(prompts, greedy)]
    records.append({"query": prompts[2], "response": "not what the model writes"})
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in records))
    file_curve = run / "file.json"
    args = ["bench", "curve", str(run), "--every", "4", "--prompts-from", str(held_out)]
    args += ["--out", str(file_curve)]
    assert main([*args, "--method", "ar"]) == 0
    printed = capsys.readouterr().out
    assert "held-out prompts of held-out.jsonl, 3 items" in printed and "same%" in printed
    points = json.loads(file_curve.read_text())["points"]
    assert points[0]["step"] == 0 and points[0]["accuracy"] == pytest.approx(2 / 3)
    assert main([*args, "--families", "arithmetic"]) == 2
    assert "with --prompts-from the file's prompts are decoded" in capsys.readouterr().err
