"""The ReFusion decoder against the authors' reference (golden decodings), against itself
one prompt at a time, and against a full recompute of its KV cache."""

import collections
import dataclasses
import json

import pytest
import torch
from golden_data import CASES, golden_config, load_tiny

from refusion.decode import DecodeConfig, Engine, generate


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def decode_alone(engine: Engine, c: dict, cfg: DecodeConfig):
    """One golden case through `engine` (a subclass that watches its steps)."""
    assert c["mask_id"] == engine.mask_id  # the golden cases use the tiny model's MASK
    engine.add_request(c["prompt_ids"], cfg, request_id="0", trace=True)
    out = None
    with torch.inference_mode():
        while engine.has_unfinished():
            out = next((o for o in engine.step() if o.finished), out)
    return out


@pytest.mark.parametrize("i", range(len(CASES)))
def test_golden_case(tiny, i):
    c = CASES[i]
    out = generate(tiny, None, [c["prompt_ids"]], golden_config(c))[0]
    assert out.token_ids == c["expected_ids"]


def test_golden_cases_take_every_path(tiny):
    """The golden set exercises both commit paths and EOS; if it did not, matching it would prove less."""
    paths, eos_stops = collections.Counter(), 0
    for c in CASES:
        out = generate(tiny, None, [c["prompt_ids"]], golden_config(c), trace=True)[0]
        paths.update(e.path for e in out.trace)
        eos_stops += out.finish_reason == "stop"
    assert paths["fast"] > 0 and paths["infill"] > 0 and eos_stops > 0


def test_golden_batched_equals_reference(tiny):
    """All cases that share a config decoded in one batch (prompts of different lengths)."""
    groups = collections.defaultdict(list)
    for c in CASES:
        groups[json.dumps(dataclasses.asdict(golden_config(c)), sort_keys=True, default=str)].append(c)
    for cs in groups.values():
        outs = generate(tiny, None, [c["prompt_ids"] for c in cs], golden_config(cs[0]))
        assert [o.token_ids for o in outs] == [c["expected_ids"] for c in cs]


def test_golden_cases_in_one_mixed_batch(tiny):
    """All 42 golden cases, each with its own config (7 configs: slot sizes, blocks,
    thresholds, EOS ids, lengths), decoded in one engine batch of 16 rows: every output
    equals the authors' reference."""
    outs = generate(tiny, None, [c["prompt_ids"] for c in CASES], [golden_config(c) for c in CASES])
    assert [o.token_ids for o in outs] == [c["expected_ids"] for c in CASES]


class CheckingEngine(Engine):
    """After every commit, the new cache entries must equal a direct computation: the
    fast path's entries = the committed tokens fed on top of the cache as it was before
    verification; each infilled slot's entries = that slot fed on top of the cache as it
    was before infilling (its own fork: it never sees the slots infilled beside it)."""

    checks = 0

    def _check_new_entries(self, before, path):
        cache, model = self.cache, self.model
        for b, row in enumerate(self.rows):
            old, new = before.lengths[b], cache.lengths[b]
            if new == old:
                continue
            toks, pos = cache.tokens[b, old:new], cache.positions[b, old:new]
            slot_of = (pos - len(row.req.prompt)) // row.s
            # the fast path commits one contiguous forward; infill commits one segment per slot
            cuts = (
                [0, new - old]
                if path == "fast"
                else [0] + (slot_of.diff().nonzero().flatten() + 1).tolist() + [new - old]
            )
            for a, e in zip(cuts, cuts[1:]):
                ref = before.select([b])
                model.cached_hidden(toks[None, a:e], pos[None, a:e], ref)
                for layer in range(len(cache.k)):
                    got_k = cache.k[layer][b, :, old + a : old + e]
                    got_v = cache.v[layer][b, :, old + a : old + e]
                    torch.testing.assert_close(
                        got_k, ref.k[layer][0, :, old : old + e - a], rtol=1e-4, atol=1e-5
                    )
                    torch.testing.assert_close(
                        got_v, ref.v[layer][0, :, old : old + e - a], rtol=1e-4, atol=1e-5
                    )
                CheckingEngine.checks += 1

    def _verify(self):
        before = self.cache.select(range(self.cache.batch_size))
        super()._verify()
        self._check_new_entries(before, "fast")

    def _infill(self):
        before = self.cache.select(range(self.cache.batch_size))
        committed = super()._infill()  # a round; the rows' cache changes only at the commit
        self._check_new_entries(before, "infill")
        return committed


def test_kv_reuse_equals_direct_computation(tiny):
    CheckingEngine.checks = 0
    for c in CASES[::3]:
        out = decode_alone(CheckingEngine(tiny), c, golden_config(c))
        assert out.token_ids == c["expected_ids"]
    assert CheckingEngine.checks > 20


def test_fast_path_cache_equals_full_recompute(tiny):
    """With token_threshold 0 every draft passes, so every commit is a fast-path commit and
    the committed cache must equal one forward over the committed sequence in physical order."""
    c = CASES[1]
    cfg = golden_config(c).replace(token_threshold=0.0, slot_threshold=0.5)
    caches = []

    class Spy(Engine):
        def _verify(self):
            super()._verify()
            caches.append(self.cache.select([0]))

    out = decode_alone(Spy(tiny), c, cfg)
    assert {e.path for e in out.trace} == {"fast"}
    with torch.inference_mode():
        for cache in caches:
            n = cache.lengths[0]
            toks, pos = cache.tokens[0, :n], cache.positions[0, :n]
            fresh = tiny.new_cache(1, n)
            tiny.cached_hidden(toks[None], pos[None], fresh)  # the committed sequence in one forward
            for layer in range(len(cache.k)):
                torch.testing.assert_close(
                    cache.k[layer][0, :, : len(toks)], fresh.k[layer][0, :, : len(toks)], rtol=1e-4, atol=1e-5
                )
                torch.testing.assert_close(
                    cache.v[layer][0, :, : len(toks)], fresh.v[layer][0, :, : len(toks)], rtol=1e-4, atol=1e-5
                )


def test_committed_cache_holds_output_in_generation_order(tiny):
    """The cache's committed sequence, sorted by position, is prompt + output."""
    c = CASES[5]
    seen = []

    class Spy(Engine):
        def _infill(self):
            committed = super()._infill()
            n = self.cache.lengths[0]
            seen.append((self.cache.tokens[0, :n].clone(), self.cache.positions[0, :n].clone()))
            return committed

    decode_alone(Spy(tiny), c, golden_config(c))
    toks, pos = seen[-1]
    order = pos.argsort()
    P = len(c["prompt_ids"])
    by_pos = toks[order].tolist()
    assert by_pos[:P] == c["prompt_ids"]
    assert by_pos[P:][: len(c["expected_ids"])] == c["expected_ids"][: len(by_pos) - P]
    assert sorted(pos.tolist()) == list(range(len(pos)))  # every position once


def test_no_verify_feed_runs_past_an_eos_it_could_commit(tiny, monkeypatch):
    """A global verify pass stops its last slot at the first drafted EOS, an infilling pass
    its drafts: no token after it can be committed from that pass. An infilling verify pass
    after a draft pass feeds only the drafts (the draft pass cached the accepted tokens).
    The golden cases, which stop at EOS, then feed fewer tokens and still decode the
    authors' reference."""
    from refusion.decode.refusion import Infill, ReFusionRow

    feeds, cut = [], collections.Counter()
    verify_feed, draft, verify = ReFusionRow.verify_feed, Infill._draft, Infill._verify

    def recorded(row):
        feed = verify_feed(row)
        feeds.append((feed.tokens, row.req.eos_ids, len(row.selected), row.s))
        return feed

    def drafted(infill, forks, fcache):
        draft(infill, forks, fcache)
        for f in forks:
            tail = f.tokens[f.accepted : f.drafted]
            assert all(t not in f.row.req.eos_ids for t in tail[:-1])
            cut["infill"] += f.drafted < f.row.s and bool(tail) and tail[-1] in f.row.req.eos_ids

    def verified(infill, forks, fcache):
        for f in forks:
            if f.head is not None and not f.complete:
                assert f.kept == f.accepted  # nothing but tokens[accepted:drafted] is fed
                cut["drafts only"] += 1
        verify(infill, forks, fcache)

    monkeypatch.setattr(ReFusionRow, "verify_feed", recorded)
    monkeypatch.setattr(Infill, "_verify", verified)
    monkeypatch.setattr(Infill, "_draft", drafted)
    for c in CASES:
        assert generate(tiny, None, [c["prompt_ids"]], golden_config(c))[0].token_ids == c["expected_ids"]
    for toks, eos_ids, n_slots, s in feeds:
        last_slot = toks[(n_slots - 1) * s :]
        assert all(t not in eos_ids for t in last_slot[:-1])
        cut["global"] += len(toks) < n_slots * s
        if len(toks) < n_slots * s:
            assert last_slot[-1] in eos_ids
    assert cut["global"] > 0 and cut["infill"] > 0 and cut["drafts only"] > 0
