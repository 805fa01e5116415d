"""ReFusion's decoding options beyond the paper: `ar_correction` (a token that fails
verification in infilling is replaced by the AR prediction), `first_token_check` (a
slot's first token is checked against its left neighbour's AR prediction) and
`infill_window` (infilling drafts and verifies at most that many tokens a round).

Off, they change nothing (the golden tests hold the paper rule). On, the KV cache must
still equal a direct computation, a batch must decode what each request decodes alone,
and, with one slot per block and a token threshold of at least 0.5, greedy ReFusion must
decode exactly what greedy AR decoding of the same weights does: every accepted token is
then the AR argmax (probability > 0.5) or its replacement, so the options make ReFusion
a lossless drafter for its own AR head."""

import pytest
import torch
from golden_data import CASES, golden_config, load_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_decode_refusion import CheckingEngine, decode_alone

from refusion.decode import DecodeConfig, generate
from refusion.decode.options import BeyondPaper

BOTH = dict(ar_correction=True, first_token_check=True)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


class Counting:
    """Counts the tokens the options replaced: in infilling (`BeyondPaper.passing`), after
    global verification (`BeyondPaper.before_infill`, with ar_correction) and in the plan
    (`BeyondPaper.check_selected`)."""

    def __init__(self, monkeypatch):
        self.corrected = self.first_replaced = self.first_slot = 0
        passing, check, before_infill = (
            BeyondPaper.passing,
            BeyondPaper.check_selected,
            BeyondPaper.before_infill,
        )

        def counted_passing(rule, f, pred, off, scores):
            n, corrected = passing(rule, f, pred, off, scores)
            self.corrected += corrected is not None
            return n, corrected

        def counted_check(rule, row):
            before = row.plan.drafts[row.selected, 0].clone()
            checked = check(rule, row)
            self.first_replaced += int((row.plan.drafts[row.selected, 0] != before).sum())
            return checked

        def counted_before_infill(rule, *args):
            self.first_slot += rule.corrects
            before_infill(rule, *args)

        monkeypatch.setattr(BeyondPaper, "passing", counted_passing)
        monkeypatch.setattr(BeyondPaper, "before_infill", counted_before_infill)
        monkeypatch.setattr(BeyondPaper, "check_selected", counted_check)


@pytest.mark.parametrize(
    "options",
    [dict(ar_correction=True), BOTH, dict(BOTH, infill_window=2), dict(infill_window=1)],
    ids=["ar_correction", "both", "both+window", "window"],
)
def test_kv_reuse_equals_direct_computation_with_the_options(tiny, monkeypatch, options):
    """Every committed entry equals a direct computation, corrected tokens included (a
    corrected token's entry is recomputed, not the draft's kept)."""
    counter = Counting(monkeypatch)
    CheckingEngine.checks = 0
    changed = 0
    for c in CASES[::2]:
        out = decode_alone(CheckingEngine(tiny), c, golden_config(c).replace(**options))
        changed += out.token_ids != c["expected_ids"]
    assert CheckingEngine.checks > 20
    if options.get("ar_correction"):
        assert counter.corrected > 10 and counter.first_slot > 5
    assert changed > 0  # the options did act, and changed outputs
    if options.get("first_token_check"):
        assert counter.first_replaced > 0


def test_corrected_rows_and_paper_rows_share_a_batch(tiny):
    """The golden cases in one batch, half of them with both options: the paper rows still
    equal the authors' reference, the others what they decode alone."""
    cfgs = [golden_config(c).replace(**(BOTH if i % 2 else {})) for i, c in enumerate(CASES)]
    outs = generate(tiny, None, [c["prompt_ids"] for c in CASES], cfgs)
    for i, (c, cfg, out) in enumerate(zip(CASES, cfgs, outs)):
        if i % 2 == 0:
            assert out.token_ids == c["expected_ids"]
        else:
            assert out.token_ids == generate(tiny, None, [c["prompt_ids"]], cfg)[0].token_ids


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 297), min_size=1, max_size=24),
    s=st.sampled_from([2, 4, 8]),
    n_slots=st.integers(1, 6),
    tau=st.floats(0.5, 0.95),
    eos=st.sampled_from([298, 165, 250, 93]),
    window=st.sampled_from([None, 1, 2, 3]),
)
def test_one_slot_per_block_with_both_options_is_greedy_ar(tiny, prompt, s, n_slots, tau, eos, window):
    """Also with an infill window: a round short of the slot's end corrects the token
    after its drafts, which is the AR prediction too."""
    cfg = DecodeConfig(
        gen_length=n_slots * s,
        slot_size=s,
        serial_blocks=n_slots,
        token_threshold=tau,
        slot_threshold=0.9,
        stop_token_ids=(eos,),
        infill_window=window,
        **BOTH,
    )
    with torch.inference_mode():
        refusion = generate(tiny, None, [prompt], cfg)[0]
        ar = generate(tiny, None, [prompt], cfg.replace(method="ar"))[0]
    assert refusion.token_ids == ar.token_ids


def test_the_paper_rule_is_not_lossless(tiny):
    """The same layout without the options departs from greedy AR on some golden prompts,
    so the test above checks something the options do."""
    differ = 0
    for c in CASES[:12]:
        cfg = DecodeConfig(
            gen_length=32,
            slot_size=4,
            serial_blocks=8,
            token_threshold=0.6,
            slot_threshold=0.9,
            stop_token_ids=(c["eos_id"],),
        )
        differ += (
            generate(tiny, None, [c["prompt_ids"]], cfg)[0].token_ids
            != generate(tiny, None, [c["prompt_ids"]], cfg.replace(method="ar"))[0].token_ids
        )
    assert differ > 0
