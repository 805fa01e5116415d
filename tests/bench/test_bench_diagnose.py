"""Provenance in the decoding trace, and `refusion bench diagnose`.

The trace says how each committed token was accepted and whether its left context was
final (`exact`). The reference: with a token threshold of at least 0.5, greedy, a token
accepted by a score or put in by an AR correction in an exact context is the argmax of a
plain causal forward over the prompt and the output before it, so every such token must
equal that argmax; tokens labelled otherwise are where an answer may part from AR."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from golden_data import CASES, golden_config, load_tiny

from refusion.bench import diagnose
from refusion.cli.dispatch import main
from refusion.decode import generate
from refusion.decode.refusion.provenance import RowTrace
from refusion.decode.request import HOW

PASSED = ("verify", "infill")  # their AR probability exceeded the token threshold


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def ar_probs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """(len(out), V): the AR distribution at every output position, given the prompt and
    the output before it (one plain causal forward, no cache)."""
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)].float().softmax(-1)


LAYOUTS = [
    dict(slot_size=4, serial_blocks=2),  # 4 slots per block
    dict(slot_size=8, serial_blocks=1),  # 4 slots per block
    dict(slot_size=4, serial_blocks=8),  # 1 slot per block
]
OPTIONS = [
    {},
    dict(ar_correction=True, first_token_check=True),
    dict(ar_correction=True, first_token_check=True, left_check=True),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["s4x2", "s8x1", "s4x8"])
@pytest.mark.parametrize("options", OPTIONS, ids=["paper", "both", "both+left"])
def test_provenance_agrees_with_a_direct_forward(tiny, layout, options):
    """In an exact context a token labelled as passing the threshold has AR probability
    above it, one that infilling passed without it has not, and an AR correction is the
    argmax; outside one (several slots per block, without left_check) some slot is
    labelled not exact."""
    tau, seen = 0.1, set()
    for c in CASES[:16]:
        cfg = golden_config(c, gen_length=32, token_threshold=tau, slot_threshold=0.5, **layout, **options)
        out = generate(tiny, None, [c["prompt_ids"]], cfg, trace=True)[0]
        ids, probs = out.token_ids, ar_probs(tiny, c["prompt_ids"], out.token_ids)
        for ev in out.trace:
            assert ev.path in ("fast", "infill")
            for (start, n), hs, exact in zip(ev.spans, ev.how, ev.exact):
                assert len(hs) == n and all(h in HOW for h in hs)
                for p, h in enumerate(hs, start):
                    if p >= len(ids):
                        continue
                    seen.add((h, exact))
                    prob = float(probs[p, ids[p]])
                    if not exact or abs(prob - tau) < 1e-4:
                        continue
                    if h in PASSED:
                        assert prob > tau, (c["prompt_ids"], p, h, prob)
                    elif h == "infill-first":
                        assert prob <= tau, (c["prompt_ids"], p, h, prob)
                    elif h == "corrected":
                        assert ids[p] == int(probs[p].argmax()), (c["prompt_ids"], p)
    # with one slot per block, or left_check, every slot is decided after its left neighbour
    in_order = layout["serial_blocks"] == 8 or options.get("left_check", False)
    assert any(not exact for _, exact in seen) != in_order
    assert {("verify", True), ("infill", True), ("infill-first", True)} & seen
    if options:
        assert ("corrected", True) in seen


def test_the_paper_rule_labels_its_unchecked_tokens(tiny):
    """Across the golden prompts the paper's rule passes first tokens on plan confidence and
    failing ones in infilling; the options replace tokens by AR predictions."""
    hows = {False: set(), True: set()}
    for c in CASES[:12]:
        for both in (False, True):
            cfg = golden_config(c, **(OPTIONS[1] if both else {}))
            for ev in generate(tiny, None, [c["prompt_ids"]], cfg, trace=True)[0].trace:
                hows[both].update(h for hs in ev.how for h in hs)
    assert {"plan", "infill-first", "infill"} <= hows[False] and "corrected" not in hows[False]
    assert "corrected" in hows[True]


def test_provenance_costs_nothing_untraced(tiny, monkeypatch):
    """Without a trace, none of the provenance code runs; with one, it does (the patch bites)."""

    def boom(*a, **k):
        raise AssertionError("provenance worked out without a trace")

    for name in ("first_tokens", "verified", "decided", "infilled"):
        monkeypatch.setattr(RowTrace, name, boom)
    c = CASES[0]
    for options in OPTIONS:
        generate(tiny, None, [c["prompt_ids"]], golden_config(c, **options))
    with pytest.raises(AssertionError, match="without a trace"):
        generate(tiny, None, [c["prompt_ids"]], golden_config(c), trace=True)


def test_first_difference_and_categories():
    assert diagnose.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert diagnose.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert diagnose.first_difference([1, 2], [1, 2, 9]) == 2
    assert diagnose.categorise("verify", False, True) == "left-not-final"
    assert diagnose.categorise("plan", True, True) == "plan-first"
    assert diagnose.categorise("infill-first", True, True) == "infill-first"
    assert diagnose.categorise("corrected", True, False) == "sampling"
    assert diagnose.categorise("verify", True, False) == "verify-threshold"


def run_cli(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


def test_diagnose_command_on_the_bundled_model(tmp_path):
    """The paper's rule parts from AR on some of the first 16 items, and every difference
    is counted once; the bundled model's own settings (lossless) part on none."""
    path = tmp_path / "paper.json"
    code, text = run_cli(["bench", "diagnose", "--limit", "16", "--json", str(path)])
    assert code == 0 and "left-not-final" in text
    data = json.loads(path.read_text())
    total = data["table"][-1]
    assert total["family"] == "all" and total["differ"] == len(data["differences"]) > 0
    assert sum(total["categories"].values()) == total["differ"]
    assert sum(r["differ"] for r in data["table"][:-1]) == total["differ"]
    for d in data["differences"]:
        assert d["text"] != d["ar_text"] and d["category"] in diagnose.CATEGORIES
    own = tmp_path / "own.json"
    code, _ = run_cli(["bench", "diagnose", "--limit", "16", "--checkpoint-settings", "--json", str(own)])
    data = json.loads(own.read_text())
    assert code == 0 and data["table"][-1]["differ"] == 0 and data["config"]["slot_size"] == 32


def test_diagnose_refuses_a_bad_limit():
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["bench", "diagnose", "--limit", "0"])
    assert code == 2 and "--limit" in err.getvalue()


def test_diagnose_greedy_ar_setting_has_nothing_to_explain(tmp_path):
    path = tmp_path / "ar.json"
    code, _ = run_cli(["bench", "diagnose", "--limit", "4", "--method", "ar", "--json", str(path)])
    assert code == 0 and json.loads(path.read_text())["differences"] == []


def test_decode_config_is_unchanged_by_tracing(tiny):
    """Tracing records; it never changes a token (the golden decodings, traced)."""
    for c in CASES[:6]:
        cfg = golden_config(c)
        assert generate(tiny, None, [c["prompt_ids"]], cfg, trace=True)[0].token_ids == c["expected_ids"]
