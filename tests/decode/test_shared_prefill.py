"""Several fresh rows that feed the same prompt in one forward (the n choices of a request)
share one prefill (`forward.shared_prefills`): the prompt is fed once and its KV entries
and logits copied, and each row decodes exactly what it decodes alone."""

from __future__ import annotations

import pytest
import torch

import refusion
from refusion.decode import EngineConfig, generate
from refusion.decode.forward import shared_prefills
from refusion.settings.recommended import recommended_of


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"method": "ar"},
        {"logprobs": 2, "frequency_penalty": 0.5},
        {"method": "mdm", "mdm_block_length": 32},
    ],
)
def test_rows_of_one_prompt_decode_what_each_decodes_alone(bundled, extra):
    model, tok = bundled
    rec = recommended_of(model)
    ex = list(rec.examples.values())
    prompts = [ex[0]] * 3 + [ex[1]] * 2 + [ex[2]]
    cfgs = [rec.decode_config(gen_length=64, temperature=0.8, seed=i, **extra) for i in range(len(prompts))]
    together = generate(model, tok, prompts, cfgs, engine_config=EngineConfig(max_batch_size=8))
    alone = [generate(model, tok, [p], c)[0] for p, c in zip(prompts, cfgs)]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids
        if extra.get("logprobs"):
            assert [x.source for x in t.logprobs] == [x.source for x in a.logprobs]
            assert torch.allclose(
                torch.tensor([x.logprob or 0.0 for x in t.logprobs]),
                torch.tensor([x.logprob or 0.0 for x in a.logprobs]),
            )
    if extra.get("method") != "mdm":  # MDM has no cache: nothing to share
        fed = [o.stats.fed for o in together]
        prompt_len = len(
            tok.apply_chat_template([{"role": "user", "content": ex[0]}], add_generation_prompt=True)
        )
        assert fed[1] <= fed[0] - prompt_len + 1  # its prompt came with row 0's forward


def test_only_fresh_rows_feeding_alike_share():
    class Cache:
        lengths = [0, 0, 5, 0, 0]

    tokens = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2, 3]]
    positions = [[0, 1, 2]] * 5
    want = [(2, 3)] * 4 + [(1, 3)]
    # row 2 has a cache already, row 3 feeds other tokens, row 4 wants other logits
    assert shared_prefills(tokens, positions, want, Cache()) == {1: 0}
    assert shared_prefills(tokens, positions, want, None) == {}
