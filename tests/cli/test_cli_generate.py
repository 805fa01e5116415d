"""`refusion generate` / `chat` / `bench decode` end to end on a tiny converted model."""

import json
import math
import re

import pytest

import refusion
from refusion.cli.dispatch import main
from refusion.decode import DecodeConfig
from refusion.decode.request import NOTES


def test_generate_json_matches_the_library(model_dir, capsys):
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "hello there",
                "the cat",
                "--json",
                "--gen-length",
                "16",
                "--slot-size",
                "4",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, tok = refusion.load(model_dir)
    outs = refusion.generate(
        model, tok, ["hello there", "the cat"], refusion.DecodeConfig(gen_length=16, slot_size=4)
    )
    assert [r["token_ids"] for r in lines] == [o.token_ids for o in outs]
    assert [r["text"] for r in lines] == [o.text for o in outs]
    assert all(r["stats"]["nfe"] >= 1 and r["config"]["method"] == "refusion" for r in lines)


@pytest.mark.parametrize("method", ["ar", "mdm"])
def test_generate_stats_for_baselines(model_dir, capsys, method):
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "hi",
                "--method",
                method,
                "--gen-length",
                "8",
                "--mdm-block-length",
                "4",
                "--stats",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert re.search(rf"\[{method}\] tokens=\d+ nfe=\d+ tpf=[\d.]+", err)


def test_generate_trace_page_replays_the_commits(model_dir, tmp_path, capsys):
    page = tmp_path / "trace.html"
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "hello",
                "--gen-length",
                "16",
                "--slot-size",
                "4",
                "--trace",
                str(page),
            ]
        )
        == 0
    )
    html = page.read_text()
    data = json.loads(re.search(r"const DATA = (.*);\n", html).group(1))
    events = data[0]["events"]
    commits = [e for e in events if e["path"] not in NOTES]
    assert commits and {e["path"] for e in commits} <= {"fast", "infill"}
    assert {e["path"] for e in events} - {"fast", "infill"} <= set(NOTES)
    assert "plan" in {e["path"] for e in events}  # each step's plan is shown with its drafts
    covered = sorted(i for e in commits for s, n in e["spans"] for i in range(s, s + n))
    assert covered[: len(covered)] == list(range(len(covered)))  # each position once, from the start
    # each span's texts are its tokens' own
    assert all(len(t) == n for e in events for (_, n), t in zip(e["spans"], e["texts"]))
    assert "<script>" in html and "http" not in html.split("<script>")[1]  # self-contained
    assert "class SlotView" in html  # drawn by the slot view the playground uses


@pytest.mark.parametrize("prompt", ["<!--<script>", "</script><script>alert(1)</script>", "a & b -->"])
def test_the_trace_page_embeds_any_text_as_data(model_dir, tmp_path, prompt):
    """No `<`, `>` or `&` in the embedded data, whatever the prompt or output: nothing an
    HTML parser could take for markup inside the script element."""
    page = tmp_path / "trace.html"
    assert main(["generate", str(model_dir), prompt, "--gen-length", "8", "--trace", str(page)]) == 0
    data = re.search(r"const DATA = (.*);\n", page.read_text()).group(1)
    assert not set("<>&") & set(data)
    assert json.loads(data)[0]["prompt"] == prompt


def test_generate_preset_and_overrides_reach_the_config(model_dir, capsys):
    assert main(["generate", str(model_dir), "x", "--preset", "gsm8k", "--gen-length", "128", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert (cfg["slot_size"], cfg["serial_blocks"], cfg["slot_threshold"], cfg["token_threshold"]) == (
        32,
        4,
        0.9,
        0.4,
    )
    assert cfg["gen_length"] == 128


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slot-threshold", "1.5"], "slot_threshold"),
        (["--gen-length", "600"], "context"),
        (["--top-k", "-1"], "--top-k: top_k must be between 0 and"),
        (["--method", "mdm", "--mdm-block-length", "0"], "mdm_block_length"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(model_dir, capsys, argv, message):
    assert main(["generate", str(model_dir), "hi", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_generate_without_a_prompt_says_how(capsys):
    assert main(["generate"]) == 2
    assert "no prompt" in capsys.readouterr().err


def test_stream_yields_the_generated_text(model_dir):
    model, tok = refusion.load(model_dir)
    cfg = refusion.DecodeConfig(gen_length=16, slot_size=4)
    pieces = list(refusion.stream(model, tok, "hello there", cfg))
    assert "".join(pieces) == refusion.generate(model, tok, ["hello there"], cfg)[0].text


def test_chat_streams_replies(model_dir, monkeypatch, capsys):
    answers = iter(["hello", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(answers))
    assert main(["chat", str(model_dir), "--gen-length", "8", "--slot-size", "4", "--stats"]) == 0
    err = capsys.readouterr().err
    assert err.count("[refusion] tokens=") == 2


def test_bench_decode_prints_the_table(model_dir, capsys):
    assert (
        main(
            [
                "bench",
                "decode",
                str(model_dir),
                "--prompts",
                "2",
                "--rounds",
                "1",
                "--gen-length",
                "8",
                "--slot-size",
                "4",
                "--batch-sizes",
                "1,2",
                "--mdm-block-length",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # it leads with one line: ReFusion against AR, and a warning that one round is too few
    lead = re.search(
        r"^refusion: ([\d.]+)x AR's tokens/s at batch size 1 \(TPF ([\d.]+) vs 1\.00\), median of 1 round, "
        r"per-round ratios ([\d.]+)x-([\d.]+)x\nwarning: 1 round only",
        out,
        re.M,
    )
    assert lead and lead.group(1) == lead.group(3) == lead.group(4), out
    assert out.index("refusion: ") < out.index("prompts, batch size 1")
    for method in ("ar", "refusion", "mdm"):
        assert re.search(rf"^{method}\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M)
    assert re.search(rf"^refusion\s+\d+\s+\d+\s+{lead.group(2)}\s+[\d.]+\s+{lead.group(1)}x", out, re.M)
    assert "batch-size sweep" in out
    for method in ("ar", "refusion", "mdm"):  # what each asks of the machine, per batch size
        assert re.search(rf"^{method}\s+fed/token(\s+[\d.]+){{2}}\n\s+GFLOP/s(\s+[\d.]+){{2}}$", out, re.M)
    assert re.search(r"^refusion / ar(\s+[\d.]+x){2}$", out, re.M)  # the sweep against AR, per batch size
    assert re.search(r"a matmul of the model's shapes reaches [\d.]+ GFLOP/s", out)
    for method in ("ar", "refusion", "mdm"):  # the linear layers' ceiling, against b=1 and the best batch
        assert re.search(rf"^{method}\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+[\d.]+%$", out, re.M)


def _summary(ratios: list[float], tpf: float = 7.05) -> list[str]:
    from refusion.bench.decode import median_ratio
    from refusion.bench.decode_report import print_summary

    table = {
        "ar": {"tpf": 1.0, "vs_ar": 1.0, "vs_ar_low": 1.0, "vs_ar_high": 1.0},
        "refusion": {
            "tpf": tpf,
            "vs_ar": median_ratio((1.0, x) for x in ratios),
            "vs_ar_low": min(ratios),
            "vs_ar_high": max(ratios),
        },
    }
    return print_summary(table, len(ratios))


def test_bench_decode_summary_warns_when_rounds_are_too_few_or_too_spread(capsys):
    """The summary line, and the warning a reader needs beside a ratio: one round cannot
    show its own noise (2.23x then 0.29x were seen for one comparison), and rounds that
    disagree by more than a quarter of their median say the machine's speed moved."""
    one = _summary([2.23])
    assert one[0] == (
        "refusion: 2.23x AR's tokens/s at batch size 1 (TPF 7.05 vs 1.00), median of 1 round, "
        "per-round ratios 2.23x-2.23x"
    )
    assert len(one) == 2 and one[1].startswith("warning: 1 round only") and "--rounds 3" in one[1]
    spread = _summary([2.23, 0.29, 3.1])
    assert spread[0].startswith("refusion: 2.23x")
    assert "median of 3 rounds, per-round ratios 0.29x-3.10x" in spread[0]
    assert len(spread) == 2 and "spread over 126% of their median" in spread[1]
    steady = _summary([3.3, 3.4, 3.5, 3.45, 3.38])
    assert steady == [
        "refusion: 3.40x AR's tokens/s at batch size 1 (TPF 7.05 vs 1.00), median of 5 rounds, "
        "per-round ratios 3.30x-3.50x"
    ]
    assert capsys.readouterr().out.count("warning:") == 2


def test_bench_decode_compares_compiled_and_eager(model_dir, capsys, tmp_path):
    """`+c` methods run with --compile in the same run as the eager ones, after a warm-up
    that compiles their graphs; they decode the same tokens (the same counts, NFE and fed)."""
    path = tmp_path / "decode.json"
    args = [
        "bench",
        "decode",
        str(model_dir),
        "--prompts",
        "2",
        "--rounds",
        "1",
        "--gen-length",
        "8",
        "--slot-size",
        "4",
        "--batch-sizes",
        "1,2",
        "--methods",
        "ar,refusion,ar+c,refusion+c",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warm-up: compiling ar+c" in out and "warm-up: compiling refusion+c" in out
    fig = json.loads(path.read_text())
    for m in ("ar", "refusion"):
        assert re.search(rf"^{re.escape(m + '+c')}\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M)
        for key in ("tokens", "nfe"):
            assert fig["table"][m + "+c"][key] == fig["table"][m][key]
        assert (
            fig["sweep_detail"][m + "+c"]["2"]["fed_per_token"]
            == fig["sweep_detail"][m]["2"]["fed_per_token"]
        )
    # the forward-cost lead is read from the eager forward: predicted for the eager methods only
    assert set(fig["forward_lead"]["methods"]) == {"ar", "refusion"}


def test_bench_decode_compares_each_temperature_with_ar_at_it(capsys, tmp_path):
    """`--temperatures 0.7` adds sampled rows of every method, each compared with AR sampled
    at the same temperature; the bundled model's settings, lossless at any temperature, draft
    as many tokens per forward sampled as greedy, give or take the draws."""
    path = tmp_path / "decode.json"
    args = ["bench", "decode", "--prompts", "2", "--rounds", "1", "--batch-sizes", "1"]
    args += ["--sweep-prompts", "2"]
    assert main([*args, "--methods", "ar,refusion", "--temperatures", "0.7", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^refusion~0\.7 / ar~0\.7\s+[\d.]+x$", out, re.M)
    assert not re.search(r"^ar~0\.7 / ", out, re.M)
    table = json.loads(path.read_text())["table"]
    assert set(table) == {"ar", "refusion", "ar~0.7", "refusion~0.7"}
    assert table["ar~0.7"]["vs_ar"] == 1.0 and table["refusion~0.7"]["tpf"] > 1.5
    assert main([*args, "--methods", "ar", "--temperatures", "hot"]) == 2


def test_bench_decode_takes_its_prompts_from_a_training_format_file(model_dir, capsys, tmp_path):
    """`--prompts-from FILE`: the queries (or first user messages) of a training-format file,
    in order and repeated when there are fewer than asked, in place of the bundled suite's;
    each greedy method's outputs compared with the answers the file gives (its own AR
    answer to the first, cut at gen_length, counts; another text to the second does not);
    a file without a prompt is refused with the reason."""
    import refusion
    from refusion.bench.decode import bench_answers, bench_prompts

    model, tok = refusion.load(model_dir)
    own = refusion.generate(model, tok, ["Name a colour."], refusion.DecodeConfig(method="ar", gen_length=8))
    data = tmp_path / "held-out.jsonl"
    records = [
        {"query": "Name a colour.", "response": own[0].text + " and more the model did not reach"},
        {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Not this."}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench_prompts(3, str(data)) == ["Name a colour.", "Hi?", "Name a colour."]
    assert bench_answers(3, str(data))[1:] == ["Not this.", records[0]["response"]]
    out = tmp_path / "decode.json"
    args = ["bench", "decode", str(model_dir), "--prompts", "2", "--rounds", "1", "--gen-length", "8"]
    args += ["--slot-size", "4", "--batch-sizes", "1", "--sweep-prompts", "3", "--methods", "ar,refusion"]
    assert main([*args, "--prompts-from", str(data), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["prompts"] == 2 and figures["prompts_from"] == str(data) and figures["sweep_prompts"] == 3
    assert figures["file_agreement"]["ar"] == 0.5
    assert "greedy outputs identical to the answers in" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"response": "no prompt"}) + "\n")
    capsys.readouterr()
    assert main([*args, "--prompts-from", str(empty)]) == 2
    assert "no record with a query or a user message" in capsys.readouterr().err


def test_bench_decode_rejects_an_unknown_suffix(model_dir, capsys):
    assert main(["bench", "decode", str(model_dir), "--methods", "ar+x", "--prompts", "1"]) == 2
    assert "a suffix is +c (compiled), +f (fixed draft widths) or +cf" in capsys.readouterr().err


def test_bench_decode_compares_fixed_and_adaptive_widths(capsys, tmp_path):
    """`refusion+f` decodes the bundled model's own (lossless) settings with fixed widths in
    the same run: the same tokens, and the widths table says what each chose."""
    path = tmp_path / "decode.json"
    args = ["bench", "decode", "--prompts", "2", "--rounds", "1", "--batch-sizes", "1,4"]
    assert (
        main([*args, "--sweep-prompts", "4", "--methods", "ar,refusion,refusion+f", "--json", str(path)]) == 0
    )
    out = capsys.readouterr().out
    assert "draft widths per batch size" in out
    assert re.search(r"^refusion\+f\s+32/12\s+0%\s+32/12\s+0%$", out, re.M)  # fixed: the settings' widths
    fig = json.loads(path.read_text())
    for key in ("tokens",):
        assert fig["table"]["refusion+f"][key] == fig["table"]["refusion"][key] == fig["table"]["ar"][key]
    for b in ("1", "4"):
        assert (
            fig["sweep_detail"]["refusion"][b]["overhead"] >= 0
            and fig["sweep_detail"]["ar"][b]["overhead"] >= 0
        )
    # the lead forward cost predicts: AR against itself is 1; ReFusion's follows from its own
    # TPF and tokens fed per forward on the timed cost curve
    lead = fig["forward_lead"]
    assert lead["methods"]["ar"]["predicted_lead"] == 1.0
    ms = {int(n): v for n, v in lead["ms_by_tokens_fed"].items()}

    def at(fed: float) -> float:  # a mean of tokens fed: linear between the whole sizes around it
        lo, hi = math.floor(fed), math.ceil(fed)
        return ms[lo] + (fed - lo) * (ms[hi] - ms[lo])

    for m in ("refusion", "refusion+f"):
        r, got = fig["table"][m], lead["methods"][m]
        assert got["fed_per_forward"] == pytest.approx(r["fed_per_token"] * r["tpf"])
        ar = fig["table"]["ar"]
        want = (at(ar["fed_per_token"] * ar["tpf"]) / ar["tpf"]) / (at(got["fed_per_forward"]) / r["tpf"])
        assert got["predicted_lead"] == pytest.approx(want)
    assert re.search(
        r"^refusion\s+feeds\s+[\d.]+ tokens a forward at TPF\s+[\d.]+: predicted [\d.]+x AR$", out, re.M
    )


def test_bench_decode_sweep_runs_methods_side_by_side_and_pairs_their_ratios(monkeypatch):
    """At each batch size the methods run one after the other, their order turning each
    round; a method's ratio to AR is the median of the rounds' own ratios, not a ratio of
    medians taken minutes apart."""
    import refusion.bench.decode as bench

    calls, speed = [], iter([100.0, 300.0, 200.0, 200.0, 50.0, 200.0])  # AR, ReFusion per round at b=1

    def fake_timed(model, tokenizer, prompts, cfg, engine):
        calls.append((engine.max_batch_size, cfg.method))
        return {"tps": next(speed) if engine.max_batch_size == 1 else 1.0}

    monkeypatch.setattr(bench, "timed", fake_timed)
    monkeypatch.setattr(bench, "matmul_peak", lambda model: 1.0)
    base, engine = DecodeConfig(), refusion.EngineConfig()
    full, _ = bench.batch_sweep({None: None}, None, base, engine, ["ar", "refusion"], [1, 4], 2, 3)
    assert calls == [
        (1, "ar"), (1, "refusion"), (4, "ar"), (4, "refusion"),
        (1, "refusion"), (1, "ar"), (4, "refusion"), (4, "ar"),
        (1, "ar"), (1, "refusion"), (4, "ar"), (4, "refusion"),
    ]  # fmt: skip
    # rounds at b=1: 300/100, 200/200 (ReFusion ran first), 200/50 -> median 3.0;
    # the medians' ratio would say 200/100 = 2.0
    assert full["refusion"][1]["vs_ar"] == pytest.approx(3.0)
    assert full["refusion"][1]["tps"] / full["ar"][1]["tps"] == pytest.approx(2.0)
    assert full["ar"][4]["vs_ar"] == 1.0


def test_bench_decode_times_the_draft_widths_forwards_before_any_timed_run(monkeypatch, capsys):
    """The forwards adaptive widths are chosen from are timed in the warm-up: a timed run
    that did it would count it as decoder overhead (a one-round run showed ReFusion's
    overhead at half its time)."""
    import refusion.bench.decode as bench
    from refusion.decode.widths import drafting_of

    timed = bench.timed
    seen = []

    def checked(model, tokenizer, prompts, cfg, engine):
        if cfg.method == "refusion" and engine.adaptive_drafts:
            seen.append(drafting_of(model).cost.calibrated)
        return timed(model, tokenizer, prompts, cfg, engine)

    monkeypatch.setattr(bench, "timed", checked)  # the bench loads its own model: nothing timed yet
    args = [
        "bench",
        "decode",
        "--prompts",
        "1",
        "--rounds",
        "1",
        "--batch-sizes",
        "1",
        "--sweep-prompts",
        "1",
    ]
    assert main([*args, "--methods", "refusion"]) == 0
    assert seen and all(seen)
