"""`refusion bench suite`: Table 1 / Figure 1 figures agree with their per-item records,
the sweep's PNG is written, AUP matches hand-computed values, and bad inputs fail as one
line with exit code 2 before any decoding."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

from refusion.bench import results, suite, suite_report
from refusion.bench.aup import aup, aup_weight
from refusion.cli.dispatch import main
from refusion.io import BUNDLED_DIR
from refusion.settings.recommended import Recommended

TINY = [
    "--gen-length",
    "16",
    "--slot-size",
    "8",
    "--serial-blocks",
    "1",
    "--mdm-block-length",
    "16",
    "--chunk",
    "2",
]


# ---------------------------------------------------------------------------- AUP
def test_aup_single_point_is_tpf_times_accuracy() -> None:
    assert aup([(1.0, 62.0)], y_max=80.0) == pytest.approx(62.0)


def test_aup_hand_computed_with_filter() -> None:
    # sorted by TPF: (1, 80) (2, 78) (3, 74) (4, 70); y_min = 80 - 5 = 75 keeps the first two.
    # AUP = 1*80 + 0.5*(2-1)*(78*W(78) + 80*W(80)), W(80) = 1, W(78) = exp(-3*(1-78/80)) = exp(-0.075)
    expected = 80 + 0.5 * (78 * math.exp(-0.075) + 80)
    assert expected == pytest.approx(156.18199, abs=1e-4)
    assert aup([(4, 70), (2, 78), (1, 80), (3, 74)], y_max=80) == pytest.approx(expected)


def test_aup_weight_uses_best_accuracy_of_any_method() -> None:
    # another method reached 90: even this method's best point is down-weighted, but not its first term
    w80, w79 = math.exp(-3 * (1 - 80 / 90)), math.exp(-3 * (1 - 79 / 90))
    got = aup([(1, 80), (3, 79)], y_max=90)
    assert got == pytest.approx(80 + 0.5 * 2 * (79 * w79 + 80 * w80))
    assert aup_weight(95, 90) == 1.0  # capped at 1


def test_aup_filters_a_dip_and_joins_its_neighbours() -> None:
    # (2, 70) is below y_min = 75: the trapezoid runs from (1, 80) straight to (3, 79)
    assert aup([(1, 80), (2, 70), (3, 79)], y_max=80) == pytest.approx(aup([(1, 80), (3, 79)], y_max=80))


def test_aup_rejects_empty_and_non_positive_tpf() -> None:
    with pytest.raises(ValueError):
        aup([], y_max=50)
    with pytest.raises(ValueError):
        aup([(0.0, 50)], y_max=50)
    assert aup([(1, 0), (2, 0)], y_max=0) == 0.0


def test_frontier_keeps_only_undominated_points() -> None:
    pts = [(1, 50), (2, 60), (3, 55), (4, 40), (2.5, 30)]
    assert suite_report.frontier(pts) == [(2, 60), (3, 55), (4, 40)]


# ---------------------------------------------------------------------------- one small run
@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("suite")
    argv = [
        "bench",
        "suite",
        "--ar-model",
        str(BUNDLED_DIR),
        "--limit",
        "4",
        *TINY,
        "--out",
        str(out),
        "--sweep-limit",
        "2",
        "--sweep-slot",
        "0.7",
        "--sweep-token",
        "0.3,0.6",
        "--sweep-mdm-tokens-per-step",
        "2",
        "--sweep-mdm-threshold",
        "0.9",
        "--results",
        str(out / "suite.md"),
    ]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # capsys is function-scoped; this fixture runs once per module
        assert main(argv) == 0
    return json.loads((out / "suite.json").read_text()), buf.getvalue(), out


def test_table_has_every_row_on_the_same_items(small_run) -> None:
    result, printed, _ = small_run
    labels = [r["label"] for r in result["table"]]
    assert labels == [
        "AR baseline (AR decoding)",
        "ReFusion",
        "ReFusion L2R (one slot per block)",
        "MDM",
        "AR decoding of ReFusion weights",
        "ReFusion + AR correction",
        "ReFusion + AR correction + first-token check",
        "ReFusion + AR correction + first-token check + left check",
        "ReFusion, the checkpoint's settings "
        "(slot 32, 4 blocks, 0.7/0.5 + AR correction + first-token check, infill window 12)",
    ]
    assert [r["method"] for r in result["table"]] == ["ar", "refusion", "refusion", "mdm", "ar"] + [
        "refusion"
    ] * 4
    options = [
        (r["config"]["ar_correction"], r["config"]["first_token_check"], r["config"]["left_check"])
        for r in result["table"]
    ]
    assert options == [(False, False, False)] * 5 + [
        (True, False, False),
        (True, True, False),
        (True, True, True),
        (True, True, False),
    ]  # the paper's rule, then each option, then the checkpoint's
    firsts = [[(x["index"], x["family"]) for x in r["records"]] for r in result["table"]]
    assert all(f == firsts[0] for f in firsts) and len(firsts[0]) == result["items"] == 4
    l2r = result["table"][2]["config"]
    assert l2r["serial_blocks"] == 2 and l2r["slot_size"] == 8  # 16 tokens, one slot per block
    for label in labels:
        assert label in printed


def test_table_figures_follow_from_records(small_run) -> None:
    result, printed, _ = small_run
    ar_tps = result["table"][0]["tokens_per_s"]
    for row in result["table"]:
        recs = row["records"]
        assert row["accuracy"] == pytest.approx(sum(r["correct"] for r in recs) / len(recs))
        assert row["tokens"] == sum(r["tokens"] for r in recs) and row["nfe"] == sum(r["nfe"] for r in recs)
        assert row["tpf"] == pytest.approx(row["tokens"] / row["nfe"])
        assert row["nfe_per_item"] == pytest.approx(row["nfe"] / len(recs))
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / sum(r["seconds"] for r in recs))
        assert row["vs_ar"] == pytest.approx(row["tokens_per_s"] / ar_tps)
        for fam, acc in row["per_family"].items():
            mine = [r["correct"] for r in recs if r["family"] == fam]
            assert acc == pytest.approx(sum(mine) / len(mine))
        line = next(ln for ln in printed.splitlines() if ln.startswith(row["label"] + " "))
        assert (
            f"{row['vs_ar']:.2f}x" in line
            and f"{row['tpf']:.2f}" in line
            and f"{100 * row['accuracy']:.1f}" in line
        )
    assert result["table"][3]["nfe_per_item"] == 16  # MDM default: one token per step over a 16-token block


def test_sweep_png_and_aup_recomputed_from_points(small_run) -> None:
    result, printed, out = small_run
    sweep = result["sweep"]
    png = Path(sweep["plot"])
    assert png == out / "sweep.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checked = "ReFusion + AR correction + first-token check"
    left = checked + " + left check"
    assert [p["method"] for p in sweep["points"]] == [
        "ReFusion",
        "ReFusion",
        checked,
        checked,
        left,
        left,
        "MDM",
        "MDM",
        "AR baseline",
    ]
    assert [p["config"]["ar_correction"] for p in sweep["points"][:6]] == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert [p["config"]["left_check"] for p in sweep["points"][:6]] == [False] * 4 + [True] * 2
    assert all(len(p["records"]) == sweep["items"] == 2 for p in sweep["points"])
    y_max = max(100 * p["accuracy"] for p in sweep["points"])
    assert sweep["y_max"] == pytest.approx(y_max)
    for method, value in sweep["aup"].items():
        pts = [
            (p["tokens"] / p["nfe"], 100 * sum(r["correct"] for r in p["records"]) / len(p["records"]))
            for p in sweep["points"]
            if p["method"] == method
        ]
        assert value == pytest.approx(aup(pts, y_max))
    assert "AUP: ReFusion" in printed


def test_the_run_writes_its_page_with_the_printed_table(small_run) -> None:
    """`--results`: the page says which command wrote it, at which commit, on which
    machine, when, and holds the table and the sweep as printed."""
    result, printed, out = small_run
    page = (out / "suite.md").read_text()
    command = next(line for line in page.splitlines() if line.startswith("- command: "))
    assert command.startswith("- command: `") and " refusion bench suite --ar-model " in f" {command[12:]}"
    assert command.endswith(f"--results {out / 'suite.md'}`")
    assert "Written by the command below" in page
    assert f"- commit: `{results.commit()}`" in page and "- machine: " in page and "- date: 20" in page
    for row in result["table"]:
        line = next(ln for ln in printed.splitlines() if ln.startswith(row["label"] + " "))
        assert line in page.splitlines()
    assert next(ln for ln in printed.splitlines() if ln.startswith("AUP: ")) in page.splitlines()


def test_the_checkpoints_own_settings_get_a_row_unless_a_row_has_them() -> None:
    base = suite.SUITE_DEFAULTS
    runs = suite.table_runs(base, with_ar=True)
    own = Recommended(
        decode=dict(
            method="refusion",
            gen_length=512,
            slot_size=32,
            serial_blocks=2,
            temperature=0.5,
            ar_correction=True,
            first_token_check=True,
        )
    )
    row = suite.recommended_run(base, own, runs)
    assert row.label == (
        "ReFusion, the checkpoint's settings (slot 32, 2 blocks, 0.9/0.4 + AR correction + first-token check)"
    )
    # the layout, thresholds and options are the checkpoint's; length and sampling the suite's
    assert (row.cfg.slot_size, row.cfg.serial_blocks, row.cfg.ar_correction, row.cfg.first_token_check) == (
        32,
        2,
        True,
        True,
    )
    assert (row.cfg.gen_length, row.cfg.temperature) == (base.gen_length, 0.0)
    same = Recommended(
        decode=dict(slot_size=8, serial_blocks=4, slot_threshold=0.7, token_threshold=0.3, ar_correction=True)
    )
    assert suite.recommended_run(base, same, runs) is None  # a row has these
    assert suite.recommended_run(base, Recommended(decode=own.decode | {"method": "ar"}), runs) is None
    assert (
        suite.recommended_run(base, Recommended(), runs) is None
    )  # no decode_config.json: no row of defaults
    assert suite.recommended_run(base, Recommended(decode={"gen_length": 64}), runs) is None
    windowed = suite.recommended_run(base, Recommended(decode=same.decode | {"infill_window": 8}), runs)
    assert windowed.cfg.infill_window == 8 and windowed.label.endswith("+ AR correction, infill window 8)")


# ---------------------------------------------------------------------------- options and errors
def test_default_ar_missing_skips_row_and_families_filter(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(suite, "DEFAULT_AR_MODEL", "bundled:no-such-model")
    argv = [
        "bench",
        "suite",
        "--limit",
        "2",
        "--families",
        "code,lists",
        "--no-sweep",
        *TINY,
        "--gen-length",
        "8",
        "--json",
        str(tmp_path / "t.json"),
    ]
    assert main(argv) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    keys = [
        "refusion",
        "refusion_l2r",
        "mdm",
        "ar_refusion",
        "refusion_corrected",
        "refusion_checked",
        "refusion_left_checked",
        "refusion_recommended",
    ]
    assert [r["key"] for r in result["table"]] == keys
    assert all(r["vs_ar"] is None for r in result["table"]) and "sweep" not in result
    assert {x["family"] for r in result["table"] for x in r["records"]} <= {"code", "lists"}
    assert "AR baseline row skipped" in capsys.readouterr().err


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("refusion bench: error:")
    return err


def test_missing_ar_model_path_is_a_clear_error(tmp_path, capsys) -> None:
    err = _one_line_error(
        capsys, ["bench", "suite", "--ar-model", str(tmp_path / "nope"), "--limit", "1", "--no-sweep"]
    )
    assert "AR baseline model not found" in err and "nope" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--families", "poetry"], "unknown task families poetry"),
        (["--method", "ar"], "drop --method"),
        (["--max-batch-size", "4"], "batch size 1"),
        (["--chunk", "0"], "--chunk must be a positive integer"),
        (["--sweep-slot", "0.5,high"], "--sweep-slot must be comma-separated numbers"),
        (["--rows", "refusion,nope", "--no-sweep"], "--rows: unknown row(s) nope"),
    ],
)
def test_bad_options_are_clear_errors(capsys, flags: list[str], message: str) -> None:
    assert message in _one_line_error(capsys, ["bench", "suite", "--ar-model", str(BUNDLED_DIR), *flags])


def test_missing_matplotlib_fails_before_decoding(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(suite, "load_from_args", lambda args: pytest.fail("loaded a model before failing"))
    err = _one_line_error(capsys, ["bench", "suite", "--ar-model", str(BUNDLED_DIR), "--limit", "1"])
    assert "refusion[plot]" in err and "--no-sweep" in err


def test_rows_runs_the_rows_named_in_table_order(tmp_path) -> None:
    argv = ["bench", "suite", "--ar-model", str(BUNDLED_DIR), "--limit", "1", "--no-sweep", *TINY]
    argv += ["--rows", "refusion_left_checked,ar_baseline", "--json", str(tmp_path / "t.json")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    table = json.loads((tmp_path / "t.json").read_text())["table"]
    assert [r["key"] for r in table] == ["ar_baseline", "refusion_left_checked"]
    assert table[1]["config"]["left_check"] and table[1]["vs_ar"] is not None
