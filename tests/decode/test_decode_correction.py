"""ReFusion's decoding options beyond the paper: `ar_correction` (a token that fails
verification in infilling is replaced by the AR prediction), `first_token_check` (a
slot's first token is checked against its left neighbour's AR prediction) and
`infill_window` (infilling drafts and verifies at most that many tokens a round) and
`left_check` (a slot decided while its left neighbour was not final is held and verified
again once it is).

Off, they change nothing (the golden tests hold the paper rule). On, the KV cache must
still equal a direct computation, a batch must decode what each request decodes alone,
and, with one slot per block and a token threshold of at least 0.5, greedy ReFusion must
decode exactly what greedy AR decoding of the same weights does: every accepted token is
then the AR argmax (probability > 0.5) or its replacement, so the options make ReFusion
a lossless drafter for its own AR head. With left_check as well, that holds for any slot
layout (several slots per block, decided in parallel)."""

import pytest
import torch
from conftest import randomise_, tiny_config
from golden_data import CASES, golden_config, load_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_decode_refusion import CheckingEngine, decode_alone

from refusion.decode import DecodeConfig, generate
from refusion.decode.refusion.options import ARCorrection, FirstTokenCheck
from refusion.model.transformer import Transformer

BOTH = dict(ar_correction=True, first_token_check=True)
LEFT = dict(BOTH, left_check=True)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


class Counting:
    """Counts the tokens the options replaced: in infilling (`ARCorrection.passing`), after
    global verification (`ARCorrection.before_infill`) and in the plan
    (`FirstTokenCheck.check_selected`)."""

    def __init__(self, monkeypatch):
        self.corrected = self.first_replaced = self.first_slot = 0
        passing, check, before_infill = (
            ARCorrection.passing,
            FirstTokenCheck.check_selected,
            ARCorrection.before_infill,
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
            self.first_slot += 1
            before_infill(rule, *args)

        monkeypatch.setattr(ARCorrection, "passing", counted_passing)
        monkeypatch.setattr(ARCorrection, "before_infill", counted_before_infill)
        monkeypatch.setattr(FirstTokenCheck, "check_selected", counted_check)


@pytest.mark.parametrize(
    "options",
    [
        dict(ar_correction=True),
        BOTH,
        dict(BOTH, infill_window=2),
        dict(infill_window=1),
        dict(left_check=True),
        dict(LEFT, infill_window=2),
    ],
    ids=["ar_correction", "both", "both+window", "window", "left", "both+left+window"],
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


def greedy_ar(model, prompt, cfg: DecodeConfig) -> list[int]:
    return generate(model, None, [prompt], cfg.replace(method="ar"))[0].token_ids


def layout(s: int, per_block: int, blocks: int, **options) -> DecodeConfig:
    """`blocks` serial blocks of `per_block` slots of `s` tokens."""
    return DecodeConfig(gen_length=s * per_block * blocks, slot_size=s, serial_blocks=blocks, **options)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 297), min_size=1, max_size=24),
    s=st.sampled_from([4, 8, 16]),
    per_block=st.sampled_from([2, 3, 4]),
    blocks=st.integers(1, 3),
    tau=st.floats(0.5, 0.95),
    slot_threshold=st.floats(0.0, 1.0),
    eos=st.sampled_from([298, 165, 250, 93]),
    window=st.sampled_from([None, 1, 3]),
)
def test_left_check_is_greedy_ar_for_any_slot_layout(
    tiny, prompt, s, per_block, blocks, tau, slot_threshold, eos, window
):
    cfg = layout(
        s,
        per_block,
        blocks,
        token_threshold=tau,
        slot_threshold=slot_threshold,
        stop_token_ids=(eos,),
        infill_window=window,
        **LEFT,
    )
    with torch.inference_mode():
        assert generate(tiny, None, [prompt], cfg)[0].token_ids == greedy_ar(tiny, prompt, cfg)


def sharp_random_model(seed: int) -> Transformer:
    """A random model whose output head is scaled up, so that its AR probabilities often
    pass a threshold of 0.5 (a plain random model's are near uniform: every token would
    be an AR correction)."""
    config = tiny_config(mask_token_id=63)
    model = Transformer(config)
    randomise_(model, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return model.eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_left_check_is_greedy_ar_on_random_models(seed):
    model = sharp_random_model(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 62, (n,), generator=gen).tolist() for n in (3, 7, 12)]
    parted = 0
    for s, per_block, blocks in [(4, 4, 2), (8, 2, 2), (16, 2, 1), (8, 4, 1)]:
        for tau in (0.5, 0.8):
            cfg = layout(s, per_block, blocks, token_threshold=tau, slot_threshold=0.5, stop_token_ids=(1,))
            for p in prompts:
                with torch.inference_mode():
                    want = greedy_ar(model, p, cfg)
                    assert generate(model, None, [p], cfg.replace(**LEFT))[0].token_ids == want
                    parted += generate(model, None, [p], cfg.replace(**BOTH))[0].token_ids != want
    assert parted > 0  # without left_check the same layouts part from AR: the test has teeth


@pytest.fixture(scope="module")
def bundled():
    from refusion.io import load

    return load()


@pytest.mark.parametrize("s,per_block,blocks", [(4, 8, 4), (8, 4, 4), (16, 2, 4), (8, 2, 8)])
def test_left_check_is_greedy_ar_on_the_bundled_model(bundled, s, per_block, blocks):
    """Held-out suite prompts, all four families, with the model's own thresholds and
    window; without left_check the same layout parts from AR on some of them."""
    from refusion.tasks import load_test_items

    model, tokenizer = bundled
    prompts = [it.prompt for it in load_test_items(12)]
    cfg = layout(s, per_block, blocks, token_threshold=0.5, slot_threshold=0.7, infill_window=12)
    with torch.inference_mode():
        want = [o.token_ids for o in generate(model, tokenizer, prompts, cfg.replace(method="ar"))]
        got = [o.token_ids for o in generate(model, tokenizer, prompts, cfg.replace(**LEFT))]
        without = [o.token_ids for o in generate(model, tokenizer, prompts, cfg.replace(**BOTH))]
    assert got == want
    assert without != want
