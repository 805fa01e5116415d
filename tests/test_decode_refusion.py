"""The ReFusion decoder against the authors' reference (golden decodings), against itself
one prompt at a time, and against a full recompute of its KV cache."""

import collections
import json

import pytest
import torch
from golden_data import CASES, load_tiny

from refusion.decode import DecodeConfig, generate
from refusion.decode.engine import Forward, Progress
from refusion.decode.refusion import ReFusionDecoder
from refusion.decode.sampling import Sampler


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def case_config(c: dict) -> DecodeConfig:
    return DecodeConfig(
        method="refusion", gen_length=c["gen_length"], slot_size=c["slot_size"], serial_blocks=c["serial_blocks"],
        slot_threshold=c["slot_threshold"], token_threshold=c["token_threshold"], eos_id=c["eos_id"], mask_id=c["mask_id"],
    )


@pytest.mark.parametrize("i", range(len(CASES)))
def test_golden_case(tiny, i):
    c = CASES[i]
    out = generate(tiny, None, [c["prompt_ids"]], case_config(c))[0]
    assert out.token_ids == c["expected_ids"]


def test_golden_cases_take_every_path(tiny):
    """The golden set exercises both commit paths and EOS; if it did not, matching it would prove less."""
    paths, eos_stops = collections.Counter(), 0
    for c in CASES:
        out = generate(tiny, None, [c["prompt_ids"]], case_config(c), trace=True)[0]
        paths.update(e.path for e in out.trace)
        eos_stops += out.finish_reason == "stop"
    assert paths["fast"] > 0 and paths["infill"] > 0 and eos_stops > 0


def test_golden_batched_equals_reference(tiny):
    """All cases that share a config decoded in one batch (prompts of different lengths)."""
    groups = collections.defaultdict(list)
    for c in CASES:
        groups[json.dumps(case_config(c).__dict__, sort_keys=True, default=str)].append(c)
    for cs in groups.values():
        outs = generate(tiny, None, [c["prompt_ids"] for c in cs], case_config(cs[0]))
        assert [o.token_ids for o in outs] == [c["expected_ids"] for c in cs]


class CheckingDecoder(ReFusionDecoder):
    """After every commit, the new cache entries must equal a direct computation: the
    fast path's entries = the committed tokens fed on top of the cache as it was before
    verification; each infilled slot's entries = that slot fed on top of the cache as it
    was before infilling (its own fork: it never sees the slots infilled beside it)."""

    checks = 0

    def _check_new_entries(self, before, cache, rows):
        model = self.fwd.model
        for b, row in enumerate(rows):
            old, new = before.lengths[b], cache.lengths[b]
            if new == old:
                continue
            toks, pos = cache.tokens[b, old:new], cache.positions[b, old:new]
            slot_of = (pos - len(row.prompt)) // self.s
            # the fast path commits one contiguous forward; infill commits one segment per slot
            cuts = [0, new - old] if self._last == "fast" else [0] + (slot_of.diff().nonzero().flatten() + 1).tolist() + [new - old]
            for a, e in zip(cuts, cuts[1:]):
                ref = before.select([b])
                model.hidden(toks[None, a:e], pos[None, a:e], ref)
                for layer in range(len(cache.k)):
                    got_k = cache.k[layer][b, :, old + a : old + e]
                    got_v = cache.v[layer][b, :, old + a : old + e]
                    torch.testing.assert_close(got_k, ref.k[layer][0, :, old : old + e - a], rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(got_v, ref.v[layer][0, :, old : old + e - a], rtol=1e-4, atol=1e-5)
                CheckingDecoder.checks += 1

    def verify(self, rows, plans, selections, cache):
        before, self._last = cache.select(range(cache.batch_size)), "fast"
        out = super().verify(rows, plans, selections, cache)
        self._check_new_entries(before, cache, rows)
        return out

    def infill(self, rows, to_infill, cache):
        before, self._last = cache.select(range(cache.batch_size)), "infill"
        super().infill(rows, to_infill, cache)
        self._check_new_entries(before, cache, rows)


@torch.inference_mode()
def test_kv_reuse_equals_direct_computation(tiny):
    CheckingDecoder.checks = 0
    for c in CASES[::3]:
        cfg = case_config(c)
        progress = Progress(1, {c["eos_id"]})
        fwd = Forward(tiny, progress, pad_id=c["mask_id"])
        CheckingDecoder(fwd, progress, Sampler(cfg, 1, tiny.device), cfg, c["mask_id"], {c["eos_id"]}).decode([c["prompt_ids"]], [0])
        assert progress.output_ids(0) == c["expected_ids"]
    assert CheckingDecoder.checks > 20


@torch.inference_mode()
def test_fast_path_cache_equals_full_recompute(tiny):
    """With token_threshold 0 every draft passes, so every commit is a fast-path commit and
    the committed cache must equal one forward over the committed sequence in physical order."""
    c = CASES[1]
    cfg = case_config(c).replace(token_threshold=0.0, slot_threshold=0.5)
    progress = Progress(1, {c["eos_id"]}, trace=True)
    fwd = Forward(tiny, progress, pad_id=c["mask_id"])
    caches = []

    class Spy(ReFusionDecoder):
        def verify(self, rows, plans, selections, cache):
            out = super().verify(rows, plans, selections, cache)
            caches.append(cache.select([0]))
            return out

    Spy(fwd, progress, Sampler(cfg, 1, tiny.device), cfg, c["mask_id"], {c["eos_id"]}).decode([c["prompt_ids"]], [0])
    assert {e.path for e in progress.traces[0]} == {"fast"}
    for cache in caches:
        toks, pos = cache.row_entries(0)
        fresh = tiny.new_cache(1, len(toks))
        tiny.hidden(toks[None], pos[None], fresh)
        for layer in range(len(cache.k)):
            torch.testing.assert_close(cache.k[layer][0, :, : len(toks)], fresh.k[layer][0, :, : len(toks)], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cache.v[layer][0, :, : len(toks)], fresh.v[layer][0, :, : len(toks)], rtol=1e-4, atol=1e-5)


def test_committed_cache_holds_output_in_generation_order(tiny):
    """The cache's committed sequence, sorted by position, is prompt + output."""
    c = CASES[5]
    cfg = case_config(c)
    progress = Progress(1, {c["eos_id"]})
    fwd = Forward(tiny, progress, pad_id=c["mask_id"])
    seen = []

    class Spy(ReFusionDecoder):
        def infill(self, rows, to_infill, cache):
            super().infill(rows, to_infill, cache)
            seen.append(cache.row_entries(0))

    with torch.inference_mode():
        Spy(fwd, progress, Sampler(cfg, 1, tiny.device), cfg, c["mask_id"], {c["eos_id"]}).decode([c["prompt_ids"]], [0])
    toks, pos = seen[-1]
    order = pos.argsort()
    P = len(c["prompt_ids"])
    by_pos = toks[order].tolist()
    assert by_pos[:P] == c["prompt_ids"]
    assert by_pos[P:][: len(c["expected_ids"])] == c["expected_ids"][: len(by_pos) - P]
    assert sorted(pos.tolist()) == list(range(len(pos)))  # every position once
