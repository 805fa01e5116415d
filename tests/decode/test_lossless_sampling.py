"""Lossless at any temperature: sampled ReFusion with settings lossless at any temperature
verifies by speculative sampling (`refusion.judge.Speculative`), so the text it draws has
exactly the distribution of AR sampling of the same weights.

Shown against the exact AR distribution of the first three tokens on a model whose
vocabulary the test enumerates (a chi-square goodness-of-fit bound far in the tail: a
true match passes it almost surely, a wrong distribution of this size does not), against
AR sampling on the bundled model (two samples), and by the same checks failing for the
threshold verification sampled rows had before. Seeded draws stay the same alone and in
a batch, and the cache stays equal to recomputing it."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import tiny_config
from golden_data import CASES, golden_config, load_tiny

import refusion
from refusion.decode import DecodeConfig, EngineConfig, generate
from refusion.decode.refusion import judge
from refusion.decode.sampling import Sampler
from refusion.model.transformer import Transformer

LOSSLESS = dict(ar_correction=True, first_token_check=True, token_threshold=0.5)
V = 8  # the enumerated model's vocabulary (6: EOS, 7: MASK)
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def enumerable() -> Transformer:
    """A random ReFusion model of 8 tokens, weights large enough that its MASK drafts and its
    AR predictions part (so drafts are rejected and the residual draws are exercised)."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=V, max_position_embeddings=64, eos_token_id=6, mask_token_id=7)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def _config(temperature: float, top_p: float, **changes) -> DecodeConfig:
    """Two blocks of one slot of two: a first-token check at each block's start, global
    verification, infilling with its corrections; no EOS, so every draw has three tokens."""
    return DecodeConfig(
        method="refusion",
        gen_length=4,
        slot_size=2,
        serial_blocks=2,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=(),
        **(LOSSLESS | changes),
    )


def exact_ar(model: Transformer, cfg: DecodeConfig) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) under AR sampling with cfg's temperature and top-p, by enumeration."""
    sampler = Sampler(cfg.replace(seed=0), torch.device("cpu"))

    def dist(ctx: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([ctx]), torch.arange(len(ctx))[None])[0, -1:]
        return sampler.probs(logits)[0].tolist()

    out = {}
    for a, pa in enumerate(dist(PROMPT)):
        for b, pb in enumerate(dist(PROMPT + [a]) if pa else []):
            for c, pc in enumerate(dist(PROMPT + [a, b]) if pb else []):
                if pc:
                    out[(a, b, c)] = pa * pb * pc
    return out


def goodness_of_fit(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, cells expecting fewer than 5 draws
    pooled; a draw AR sampling cannot make counts as infinite."""
    if any(k not in expected for k in counts):
        return math.inf, 1
    stat, df, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for k, p in expected.items():
        e = p * n
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + counts.get(k, 0)
        else:
            stat, df = stat + (counts.get(k, 0) - e) ** 2 / e, df + 1
    if pooled_e > 0:
        stat, df = stat + (pooled_o - pooled_e) ** 2 / pooled_e, df + 1
    return stat, df


def bound(df: int) -> float:
    """Six standard deviations over a chi-square's mean: a true match passes it with
    probability around 1 - 1e-7 at these sizes."""
    return df + 6 * math.sqrt(2 * df)


def draws(model: Transformer, cfg: DecodeConfig, n: int, adaptive: bool = False) -> Counter:
    """n seeded draws; with fixed widths (adaptive=False) every block drafts, so that every
    token goes through verification (adaptive widths may decode a block as AR does)."""
    seeded = [cfg.replace(seed=i) for i in range(n)]
    engine = EngineConfig(max_batch_size=64, adaptive_drafts=adaptive)
    outs = generate(model, None, [PROMPT] * n, seeded, engine_config=engine)
    return Counter(tuple(o.token_ids[:3]) for o in outs)


@pytest.mark.parametrize(
    "temperature,top_p,adaptive", [(0.7, 1.0, False), (1.5, 1.0, False), (0.7, 0.9, False), (1.5, 0.9, True)]
)
def test_sampled_refusion_draws_the_exact_ar_distribution(enumerable, temperature, top_p, adaptive):
    cfg = _config(temperature, top_p)
    assert cfg.lossless == "any temperature"
    n = 3000
    stat, df = goodness_of_fit(draws(enumerable, cfg, n, adaptive), exact_ar(enumerable, cfg), n)
    assert df > 30 and stat < bound(df), (stat, df)


def test_the_fit_tells_apart_a_wrong_rule(enumerable, monkeypatch):
    """The check has the power to see a wrong distribution: the paper's rule sampled, and
    speculative verification with the classic slip of redrawing a rejected draft from p
    instead of the residual max(0, p - q), both fail it."""
    cfg = _config(0.7, 1.0)
    exact, n = exact_ar(enumerable, cfg), 3000
    paper = _config(0.7, 1.0, ar_correction=False, first_token_check=False, token_threshold=0.4)
    stat, df = goodness_of_fit(draws(enumerable, paper, n), exact, n)
    assert stat > bound(df), (stat, df)
    monkeypatch.setattr(
        judge.Speculative, "replace", lambda self, logits, q: int(self.sampler.pick(logits)[0])
    )
    stat, df = goodness_of_fit(draws(enumerable, cfg, n), exact, n)
    assert stat > bound(df), (stat, df)


def test_a_sampled_request_draws_the_same_alone_and_in_a_batch():
    tiny = load_tiny()
    cfgs = [golden_config(c, **LOSSLESS, temperature=1.0, top_p=0.9, seed=i) for i, c in enumerate(CASES[:8])]
    cfgs = [c.replace(serial_blocks=c.region_length // c.slot_size) for c in cfgs]  # one slot per block
    assert all(c.lossless == "any temperature" for c in cfgs)
    prompts = [c["prompt_ids"] for c in CASES[:8]]
    alone = [generate(tiny, None, [p], c)[0].token_ids for p, c in zip(prompts, cfgs)]
    together = generate(tiny, None, prompts, cfgs, engine_config=EngineConfig(max_batch_size=8))
    assert [o.token_ids for o in together] == alone
    reseeded = generate(tiny, None, prompts, [c.replace(seed=c.seed + 100) for c in cfgs])
    assert [o.token_ids for o in reseeded] != alone  # the draws are the seeds', not fixed ones


def test_sampled_lossless_kv_reuse_equals_direct_computation():
    from test_decode_refusion import CheckingEngine, decode_alone

    tiny = load_tiny()
    CheckingEngine.checks = 0
    for i, c in enumerate(CASES[:6]):
        cfg = golden_config(c, **LOSSLESS, temperature=1.0, seed=i)
        cfg = cfg.replace(serial_blocks=cfg.region_length // cfg.slot_size)
        decode_alone(CheckingEngine(tiny), c, cfg)
    assert CheckingEngine.checks > 10


def _two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's homogeneity statistic of two samples over the categories, those with
    fewer than 10 draws in both together pooled (a table of one cell: 0, 0)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells: dict = {}
    for k in set(a) | set(b):
        key = k if a[k] + b[k] >= 10 else "rest"
        x, y = cells.get(key, (0, 0))
        cells[key] = (x + a[k], y + b[k])
    cells = {k: v for k, v in cells.items() if sum(v)}
    stat = 0.0
    for x, y in cells.values():
        total = x + y
        for obs, n in ((x, n_a), (y, n_b)):
            e = total * n / (n_a + n_b)
            stat += (obs - e) ** 2 / e
    return stat, len(cells) - 1


@pytest.mark.slow
def test_the_bundled_models_sampled_refusion_and_ar_draw_alike(monkeypatch):
    """Seeded draws of the shipped settings at temperature 1.5 and of AR sampling on eight
    held-out suite prompts: each early position's token, and each pair of neighbours, in the
    same proportions (two-sample chi-squares, summed over prompts and positions); the
    threshold verification sampled rows had before does not pass (its drafts accepted on
    the plain softmax are kept more often than the tempered AR distribution draws them)."""
    from refusion.tasks import load_test_items

    model, tok = refusion.load()
    shipped = refusion.decode.Engine(model, tok).default_config
    cfg = shipped.replace(temperature=1.5, gen_length=shipped.slot_size)
    assert cfg.lossless == "any temperature"
    prompts, n, positions = [it.prompt for it in load_test_items()[:8]], 100, 12

    def sample(c: DecodeConfig) -> list[list[list[int]]]:
        fixed = EngineConfig(max_batch_size=64, adaptive_drafts=False)  # every block drafts and verifies
        every = [p for p in prompts for _ in range(n)]
        outs = generate(
            model, tok, every, [c.replace(seed=i) for i in range(len(every))], engine_config=fixed
        )
        return [[o.token_ids for o in outs[j * n : (j + 1) * n]] for j in range(len(prompts))]

    ar = sample(cfg.replace(method="ar"))

    def verdict(rf: list[list[list[int]]]) -> tuple[float, int]:
        stat, df = 0.0, 0
        for mine, theirs in zip(rf, ar):
            for i in range(positions):
                for width in (1, 2):  # a token, and it with its right neighbour
                    a = Counter(tuple(t[i : i + width]) for t in mine)
                    b = Counter(tuple(t[i : i + width]) for t in theirs)
                    s, d = _two_sample(a, b)
                    stat, df = stat + s, df + d
        return stat, df

    stat, df = verdict(sample(cfg))
    assert df > 30 and stat < bound(df), (stat, df)
    threshold = lambda c, sampler: judge.Threshold(sampler, c.token_threshold)  # noqa: E731
    monkeypatch.setattr("refusion.decode.refusion.row.judge_for", threshold)
    stat, df = verdict(sample(cfg))
    assert stat > bound(df), (stat, df)
