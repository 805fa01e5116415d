"""What a new user meets first: settings that travel with the checkpoint, presets that fit
the model, and failures that are loud (empty prompts, broken weights, a prompt taken as
the model, evaluations where nothing generated)."""

import json
import re

import pytest
import torch

import refusion
from refusion.cli.dispatch import main
from refusion.decode import DecodeConfig, Engine
from refusion.errors import CheckpointError, ConfigError, ContextLengthError
from refusion.evaluate import evaluate, get_benchmark
from refusion.io import describe, save_pretrained
from refusion.settings.recommended import FILE, Recommended, recommended_of


# ------------------------------------------------------------------ decode_config.json
def test_recommended_settings_round_trip_through_save_and_load(model_dir, tmp_path):
    rec = Recommended(
        decode={"slot_size": 4, "serial_blocks": 2, "gen_length": 16},
        about="a test model",
        single_turn=True,
        examples={"greeting": "hello there"},
    )
    rec.write(model_dir)
    model, tok = refusion.load(model_dir)
    assert recommended_of(model) == rec
    save_pretrained(model, tok, tmp_path / "again")  # a save writes them back
    assert json.loads((tmp_path / "again" / FILE).read_text())["decode"]["slot_size"] == 4
    assert describe(tmp_path / "again")["recommended"]["about"] == "a test model"


def test_a_model_without_the_file_gets_the_defaults(model_dir):
    model, _ = refusion.load(model_dir)
    assert recommended_of(model).empty and recommended_of(model).decode_config() == DecodeConfig()
    assert not (model_dir / FILE).exists()


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not valid JSON"),
        ('{"decode": {"slot_size": 0}}', "not a valid DecodeConfig"),
        ('{"decode": {"no_such_field": 1}}', "not a valid DecodeConfig"),
        ('{"colour": "blue"}', "expected an object with keys"),
        ('{"examples": {"a": ""}}', "non-empty prompt"),
    ],
)
def test_a_malformed_file_is_one_clear_error(model_dir, text, words, capsys):
    (model_dir / FILE).write_text(text)
    with pytest.raises(CheckpointError, match=words):
        refusion.load(model_dir)
    assert main(["info", str(model_dir)]) == 2
    assert FILE in capsys.readouterr().err


def test_every_driver_starts_from_the_checkpoint_s_settings(model_dir, capsys):
    Recommended(decode={"method": "ar", "gen_length": 8}).write(model_dir)
    model, tok = refusion.load(model_dir)
    engine = Engine(model, tok)
    assert engine.default_config == DecodeConfig(method="ar", gen_length=8)
    out = refusion.generate(model, tok, ["hello"])[0]  # no config: the checkpoint's
    assert out.stats.nfe == len(out.token_ids) <= 8  # AR: one token per forward
    assert main(["generate", str(model_dir), "hello", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["method"] == "ar" and printed["config"]["gen_length"] == 8
    assert (
        main(["generate", str(model_dir), "hello", "--json", "--method", "refusion", "--slot-size", "4"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)  # flags go on top
    assert (printed["config"]["method"], printed["config"]["slot_size"], printed["config"]["gen_length"]) == (
        "refusion",
        4,
        8,
    )
    assert main(["info", str(model_dir)]) == 0
    assert "method=ar, gen_length=8" in capsys.readouterr().out


def test_the_bundled_model_ships_its_settings(capsys):
    model, _ = refusion.load()
    cfg = recommended_of(model).decode_config()
    assert (cfg.slot_size, cfg.serial_blocks, cfg.slot_threshold, cfg.token_threshold, cfg.gen_length) == (
        32,
        4,
        0.7,
        0.5,
        128,
    )
    assert cfg.ar_correction and cfg.first_token_check and cfg.infill_window == 12
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert (
        "slot_threshold=0.7" in out
        and "ar_correction=True" in out
        and "infill_window=12" in out
        and "single turns only" in out
    )


# ------------------------------------------------------------------ presets fit the model
def test_a_preset_s_length_is_lowered_to_fit_with_one_line(capsys):
    prompt = "Find the largest number: 47, 38, 23"
    assert main(["generate", prompt, "--preset", "gsm8k", "--json"]) == 0
    captured = capsys.readouterr()
    cfg = json.loads(captured.out)["config"]
    assert cfg["gen_length"] == 512 and cfg["slot_size"] == 32  # the preset, as asked for
    notes = [line for line in captured.err.splitlines() if "lowered" in line]
    assert len(notes) == 1 and "gen_length 512 (preset gsm8k)" in notes[0] and "512 positions" in notes[0]


def test_an_explicit_gen_length_that_does_not_fit_names_one_that_does(capsys):
    assert main(["generate", "Find the largest number: 47, 38, 23", "--gen-length", "510"]) == 2
    err = capsys.readouterr().err
    match = __import__("re").search(r"lower gen_length to (\d+)", err)
    assert match, err
    assert main(["generate", "Find the largest number: 47, 38, 23", "--gen-length", match.group(1)]) == 0


def test_the_server_fits_a_preset_without_inventing_a_max_tokens():
    from served import fit_length

    from refusion.serve.protocol.errors import APIError

    cfg = DecodeConfig.preset("gsm8k")
    fitted = fit_length(cfg, 18, None, 512, "messages")
    assert fitted.region_length <= 512 - 18 and fitted.slot_size == 32
    with pytest.raises(APIError) as e:
        fit_length(cfg, 500, None, 512, "messages")  # not even one unit is left
    assert "max_tokens" not in e.value.message and e.value.param in ("messages", "slot_size")


# ------------------------------------------------------------------ loud failures
@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_an_empty_prompt_is_refused(prompt, capsys):
    assert main(["generate", prompt]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    model, tok = refusion.load()
    with pytest.raises(ConfigError, match="empty"):
        refusion.generate(model, tok, [prompt])


def test_nan_weights_warn_once_in_one_line(model_dir, tmp_path, capsys):
    model, tok = refusion.load(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="not finite") as caught:
        refusion.generate(model, tok, ["hello", "there"], DecodeConfig(gen_length=8, slot_size=4))
    assert len([w for w in caught if "not finite" in str(w.message)]) == 1
    save_pretrained(model, tok, tmp_path / "nan")
    argv = ["generate", str(tmp_path / "nan"), "hello", "--gen-length", "8", "--slot-size", "4"]
    assert main(argv) == 2  # refused before decoding, unless the user allows it
    assert "--allow-nonfinite-weights" in capsys.readouterr().err
    assert main([*argv, "--allow-nonfinite-weights"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "not finite" in line] == [
        next(
            line
            for line in err
            if line.startswith("refusion generate: warning: the model's logits are not finite")
        )
    ]


def test_finite_logits_do_not_warn(model_dir, recwarn):
    model, tok = refusion.load(model_dir)
    refusion.generate(model, tok, ["hello"], DecodeConfig(gen_length=8, slot_size=4))
    assert not [w for w in recwarn if "not finite" in str(w.message)]


def test_a_prompt_taken_as_the_model_gets_a_hint(capsys):
    assert main(["generate", "Sort: 1", "Sort: 2"]) == 2
    err = capsys.readouterr().err
    assert "the first is the model" in err and "--prompt-file" in err


def test_stats_come_from_a_second_decode(monkeypatch, capsys):
    import refusion.decode as decode

    calls = []
    real = decode.generate

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "generate", counting)
    assert main(["generate", "Find the largest number: 47, 38, 23", "--stats"]) == 0
    assert len(calls) == 2 and "tps=" in capsys.readouterr().err
    assert main(["generate", "Find the largest number: 47, 38, 23"]) == 0
    assert len(calls) == 3  # no warm-up without --stats


# ------------------------------------------------------------------ evaluation
def _suite_samples(n: int):
    return get_benchmark("suite").load(limit=n)


def test_eval_marks_generation_errors_and_counts_right(tmp_path):
    samples = _suite_samples(4)

    def generate(prompts):
        if prompts[0] == samples[1].prompt:
            raise ContextLengthError("prompt (900 tokens) + generation (128) exceeds the model's context")
        return ["Answer: nothing"] * len(prompts)

    summary = evaluate("suite", generate, samples=samples, out_dir=tmp_path / "o", progress=False)
    assert summary["generation_errors"] == 1 and "exceeds" in summary["first_generation_error"]
    assert summary["no_answer"] is None  # the suite's checker judges whole texts: no extraction to miss
    records = [json.loads(line) for line in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert [r["detail"]["reason"] for r in records if r["detail"]] == ["generation_error"]
    assert "1 failed to generate" in summary["line"]


def test_eval_exits_non_zero_when_every_sample_fails(monkeypatch, tmp_path, capsys):
    def failing(model, tokenizer, prompts, cfg=None, engine_config=None):
        raise ContextLengthError("prompt (900 tokens) leaves no room in the model's context of 512 positions")

    monkeypatch.setattr("refusion.decode.api.generate", failing)  # what `refusion eval` calls
    code = main(
        [
            "eval",
            "--task",
            "suite",
            "--limit",
            "3",
            "--out",
            str(tmp_path / "e"),
            "--no-progress",
            "--gen-length",
            "32",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "3 of 3 samples failed to generate" in err and "leaves no room" in err


def test_a_resumed_eval_says_so(tmp_path, capsys):
    samples = _suite_samples(4)
    answer = lambda ps: ["Answer: nothing"] * len(ps)  # noqa: E731
    evaluate("suite", answer, samples=samples[:2], out_dir=tmp_path / "r", progress=False)
    again = evaluate("suite", answer, samples=samples, out_dir=tmp_path / "r", progress=True)
    assert again["resumed"] == 2 and "2 of 4 samples resumed" in again["line"]
    assert "resuming" in capsys.readouterr().err


def test_serve_without_its_extra_names_the_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a)
    )
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "needs uvicorn (the serve extra)" in err and "setup.sh serve" in err and "Traceback" not in err


def test_convert_says_what_comes_next(make_hf_dir, tmp_path, capsys):
    assert main(["convert", str(make_hf_dir("qwen3")), str(tmp_path / "new")]) == 0
    assert "need ReFusion training first: refusion train --model" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "new"), str(tmp_path / "again")]) == 0  # already has its MASK
    assert "already had <|mask|>" in capsys.readouterr().out


# ------------------------------------------------------------------ your own model
def test_generate_on_an_ar_checkpoint_names_method_ar_before_loading_weights(
    make_hf_dir, monkeypatch, capsys
):
    base = make_hf_dir("qwen3")  # an AR checkpoint: no <|mask|> in its tokenizer or config

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("refusion.io.load", no_weights)
    assert main(["generate", str(base), "hello"]) == 2
    err = capsys.readouterr().err
    assert "has no MASK token" in err and "--method ar" in err and f"refusion convert {base} OUT" in err
    monkeypatch.undo()
    assert main(["generate", str(base), "hello", "--method", "ar", "--gen-length", "4"]) == 0


@pytest.mark.parametrize(
    "verb",
    [["chat"], ["serve", "--port", "0"], ["eval", "--task", "suite", "--limit", "1"]],
    ids=["chat", "serve", "eval"],
)
def test_every_verb_that_decodes_names_method_ar_before_loading_weights(
    make_hf_dir, monkeypatch, capsys, verb
):
    """chat, serve and eval refuse a ReFusion method on an AR checkpoint as generate does
    (`check_mask_before_load`): before any weight is read."""
    base = make_hf_dir("qwen3")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("refusion.io.load", no_weights)
    monkeypatch.setattr("refusion.io.loading.load", no_weights)
    assert main([verb[0], str(base), *verb[1:]]) == 2
    err = capsys.readouterr().err
    assert "has no MASK token" in err and "--method ar" in err and "Traceback" not in err


def test_gguf_without_its_package_names_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from refusion.errors import MissingExtraError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF" + bytes(60))
    assert main(["info", str(file)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'refusion[gguf]'" in err and "scripts/setup.sh gguf" in err and "Traceback" not in err
    with pytest.raises(MissingExtraError, match="gguf extra"):
        refusion.load(file)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Out:
    """An output as `on_output` sees it: the final prefix and the forwards so far."""

    def __init__(self, tokens: int, nfe: int) -> None:
        self.token_ids = [0] * tokens
        self.stats = type("S", (), {"nfe": nfe})()


@pytest.mark.parametrize("tty", [True, False])
def test_progress_is_quiet_for_short_runs_and_counts_long_ones(tty):
    import io

    from refusion.cli import progress

    stream, clock = io.StringIO(), _Clock()
    stream.isatty = lambda: tty  # type: ignore[method-assign]
    p = progress.Progress(64, stream=stream, clock=clock)
    p(0, _Out(8, 2))
    assert stream.getvalue() == ""  # short so far: nothing
    clock.now = progress.QUIET_S + 1
    p(0, _Out(16, 3))
    p(1, _Out(8, 5))  # soon after: a terminal redraws, a log waits
    clock.now += progress.LOG_EVERY_S
    p(1, _Out(12, 6))
    p.close()
    text = stream.getvalue()
    lines = text.replace("\r", "\n").replace("\x1b[K", "").split("\n")
    shown = [line for line in lines if line]
    assert shown[0] == "decoding: 16 of at most 64 tokens, 3 forwards, 3s"
    last = progress.QUIET_S + 1 + progress.LOG_EVERY_S
    assert shown[-1] == f"decoding: 28 of at most 64 tokens, 6 forwards, {last:.0f}s"
    assert len(shown) == 2 and text.endswith("\r\x1b[K" if tty else "\n")


def test_a_long_cli_generation_shows_progress_on_stderr(monkeypatch, capsys):
    from refusion.cli import progress

    monkeypatch.setattr(progress, "QUIET_S", 0.0)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    assert main(["generate", "Find the largest number: 47, 38, 23", "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    counts = re.findall(r"^decoding: (\d+) of at most 128 tokens, (\d+) forwards", captured.err, flags=re.M)
    tokens, forwards = [int(t) for t, _ in counts], [int(f) for _, f in counts]
    assert printed["text"].endswith("Answer: 47") and counts, captured.err
    assert tokens == sorted(tokens) and forwards == sorted(forwards)  # live counts only grow
    assert (tokens[-1], forwards[-1]) == (len(printed["token_ids"]), printed["stats"]["nfe"])
