"""The tensor-only forward (`Transformer.packed_hidden`) and its compiled form
(`EngineConfig.compile`): the same hidden states and cache entries as the ragged forward,
and the same AR and ReFusion decodings, token for token."""

import collections
import dataclasses
import json
import warnings

import pytest
import torch
from conftest import randomise_
from golden_data import CASES, golden_config, load_tiny

from refusion import ModelConfig, Transformer
from refusion.cli.flags import add_decode_arguments, engine_config_from_args
from refusion.decode import DecodeConfig, EngineConfig, generate
from refusion.decode.forward import CompiledStep


def _model(kind: str) -> Transformer:
    gqa = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = ModelConfig(
        model_type=kind,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        qk_norm=kind == "qwen3",
        attention_bias=kind == "qwen2",
        max_position_embeddings=256,
        eos_token_id=1,
        **gqa,
    )
    model = Transformer(config)
    randomise_(model, seed=3)
    return model.eval()


def _filled(model: Transformer, lengths: list[int], capacity: int, seed: int = 0):
    """A cache whose rows hold `lengths` entries of random tokens."""
    gen = torch.Generator().manual_seed(seed)
    cache = model.new_cache(len(lengths), capacity)
    T = max(lengths)
    model.cached_hidden(
        torch.randint(2, 64, (len(lengths), T), generator=gen),
        torch.arange(T).expand(len(lengths), -1),
        cache,
        n_new=lengths,
    )
    return cache


def _reference(model: Transformer, cache, tokens: list[list[int]], positions: list[list[int]]):
    """Each row recomputed alone without a cache (its entries, then its new tokens): the new
    tokens' hidden states, row after row; and a cache that holds each whole row, filled
    from empty in one forward: the entries a cached forward must have written."""
    rows_t, rows_p, hidden = [], [], []
    for b, (t, p) in enumerate(zip(tokens, positions)):
        L = cache.lengths[b]
        rows_t.append(cache.tokens[b, :L].tolist() + t)
        rows_p.append(cache.positions[b, :L].tolist() + p)
        if t:
            hidden.append(model.hidden(torch.tensor([rows_t[-1]]), torch.tensor([rows_p[-1]]))[0, L:])
    n = [len(r) for r in rows_t]
    pad = lambda xs: torch.tensor([x + [0] * (max(n) - len(x)) for x in xs])  # noqa: E731
    whole = model.new_cache(len(n), cache.capacity)
    model.cached_hidden(pad(rows_t), pad(rows_p), whole, n_new=n)
    return torch.cat(hidden), whole


def _assert_entries_equal(cache, whole, lengths: list[int], n_new: list[int]) -> None:
    for b, (L, n) in enumerate(zip(lengths, n_new)):
        for layer in range(len(cache.k)):
            torch.testing.assert_close(
                cache.k[layer][b, :, : L + n], whole.k[layer][b, :, : L + n], rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                cache.v[layer][b, :, : L + n], whole.v[layer][b, :, : L + n], rtol=1e-5, atol=1e-5
            )
        assert cache.tokens[b, : L + n].tolist() == whole.tokens[b, : L + n].tolist()
        assert cache.positions[b, : L + n].tolist() == whole.positions[b, : L + n].tolist()


def _feeds(lengths: list[int], n_new: list[int], seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in n_new]
    return tokens, [list(range(L, L + n)) for L, n in zip(lengths, n_new)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_packed_hidden_equals_each_row_recomputed_alone(kind):
    """Four rows of different lengths feeding 3, 0, 1 and 5 tokens: `packed_hidden` (eager)
    gives every real token the hidden state of its row recomputed alone without a cache,
    writes the entries a one-forward fill of each whole row holds, and advances no row."""
    model = _model(kind)
    lengths, n_new = [5, 9, 2, 7], [3, 0, 1, 5]
    cache = _filled(model, lengths, 24)
    tokens, positions = _feeds(lengths, n_new)
    ref, whole = _reference(model, cache, tokens, positions)
    T = max(n_new)
    where = torch.tensor([b * T + i for b, n in enumerate(n_new) for i in range(n)])
    query_cols = torch.tensor(lengths)[:, None] + torch.arange(T)
    flat = lambda xs: torch.tensor([x for row in xs for x in row])  # noqa: E731
    got = model.packed_hidden(
        flat(tokens), flat(positions), where, query_cols, cache.k, cache.v, cache.tokens, cache.positions
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert cache.lengths == lengths
    _assert_entries_equal(cache, whole, lengths, n_new)


@pytest.mark.parametrize(
    "lengths, n_new, runs, masked",
    [
        ([6, 6, 6, 6, 2], [1, 1, 1, 1, 12], True, True),  # a join: four one-token steps beside a prefill
        ([4, 9, 2], [2, 0, 3], False, True),  # ragged, one run
        ([7, 7, 7], [1, 1, 1], False, False),  # one token per row at equal lengths: no mask needed
    ],
)
@torch.inference_mode()
def test_the_decoders_eager_forward_equals_the_reference(lengths, n_new, runs, masked):
    """What `Forward` runs eagerly for every forward with a cache (`packed_hidden` over
    `KVCache.packed_write`, attention in runs of rows where a prompt is prefilled beside
    one-token steps) gives each row's hidden states recomputed alone without a cache, and
    the entries of a one-forward fill of each whole row."""
    model = _model("qwen3")
    cache = _filled(model, lengths, 40)
    tokens, positions = _feeds(lengths, n_new)
    ref, whole = _reference(model, cache, tokens, positions)
    layout = cache.packed_write(tokens, positions, plan_runs=True)
    assert (layout.segments is not None) == runs and layout.masked == masked
    got = model.packed_hidden(*layout.tensors(), segments=layout.segments, masked=layout.masked)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert cache.lengths == lengths  # written, not kept: the caller advances
    _assert_entries_equal(cache, whole, lengths, n_new)


def test_compiled_ar_decodes_what_eager_decodes(monkeypatch):
    """AR with the compiled forward, five prompts of different lengths through two places
    (rows leave and join: a join prefills in the same forward as the others' next token):
    the same tokens as eager AR, and the same forward counts."""
    model = _model("qwen3")
    prompts = [[5, 6, 7], [9] * 11, [3, 4], list(range(10, 30)), [40, 41, 42, 43]]
    cfg = DecodeConfig(method="ar", gen_length=12, stop_token_ids=(1,))
    two = EngineConfig(max_batch_size=2)
    eager = generate(model, None, prompts, cfg, engine_config=two)
    fed = []
    call = CompiledStep.__call__
    monkeypatch.setattr(
        CompiledStep,
        "__call__",
        lambda self, m, t, p, c: fed.append(tuple(map(len, t))) or call(self, m, t, p, c),
    )
    compiled = generate(model, None, prompts, cfg, engine_config=two.replace(compile=True))
    assert (
        len(fed) > 20 and {(1,), (1, 1)} <= set(fed) and any(max(f) > 1 and len(f) == 2 for f in fed)
    )  # steps and joins
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert [o.stats.nfe for o in compiled] == [o.stats.nfe for o in eager]
    assert [o.stats.fed for o in compiled] == [o.stats.fed for o in eager]


def test_compiled_refusion_reproduces_the_golden_decodings(monkeypatch):
    """ReFusion with every forward compiled (plan, verify, infill forks), the golden cases
    batched by config (prompts of different lengths, up to 4 rows, joins): the authors'
    reference decodings, token for token; and the compiled forward did run them."""
    tiny = load_tiny()
    fed = []
    call = CompiledStep.__call__
    monkeypatch.setattr(
        CompiledStep,
        "__call__",
        lambda self, m, t, p, c: fed.append(tuple(map(len, t))) or call(self, m, t, p, c),
    )
    groups = collections.defaultdict(list)
    for c in CASES:
        groups[json.dumps(dataclasses.asdict(golden_config(c)), sort_keys=True, default=str)].append(c)
    for cs in groups.values():
        outs = generate(
            tiny,
            None,
            [c["prompt_ids"] for c in cs],
            golden_config(cs[0]),
            engine_config=EngineConfig(max_batch_size=4, compile=True),
        )
        assert [o.token_ids for o in outs] == [c["expected_ids"] for c in cs]
    assert len(fed) > 50 and any(len(f) > 1 for f in fed) and any(max(f) > 1 for f in fed)


def test_compile_flag_reaches_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--compile"])).compile is True
    assert engine_config_from_args(parser.parse_args([])).compile is False


def _forwards(step: CompiledStep, model: Transformer, shapes: list[tuple[list[int], list[int], int]]):
    """For each (row lengths, tokens fed per row, capacity): `step` on a filled cache, and
    eager `packed_hidden` on a copy of it; yields the two hidden-state tensors."""
    for i, (lengths, n_new, capacity) in enumerate(shapes):
        cache = _filled(model, lengths, capacity, seed=i)
        twin = cache.select(range(len(lengths)), capacity)
        tokens, positions = _feeds(lengths, n_new, seed=i)
        T = max(n_new)
        flat = lambda xs: torch.tensor([x for row in xs for x in row])  # noqa: E731
        where = torch.tensor([b * T + j for b, n in enumerate(n_new) for j in range(n)])
        ref = model.packed_hidden(
            flat(tokens),
            flat(positions),
            where,
            torch.tensor(lengths)[:, None] + torch.arange(T),
            twin.k,
            twin.v,
            twin.tokens,
            twin.positions,
        )
        yield step(model, tokens, positions, cache), ref


SHAPES = [
    ([3], [1], 20),
    ([5, 2, 7], [1, 1, 1], 20),
    ([4], [6], 20),
    ([2, 6], [3, 5], 20),
]  # one row or several; one token or several


@torch.inference_mode()
def test_a_few_graphs_serve_every_shape():
    """Dynamic shapes: after one forward of each kind (one row or several, one token or
    several), twenty more of new lengths, token counts and capacities (more shapes than
    dynamo's default recompile limit) compile nothing new; each equals the eager forward."""
    from torch._dynamo.utils import counters

    model = _model("llama")
    step = CompiledStep()
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an eager fallback would fail here
        for got, ref in _forwards(step, model, SHAPES):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= len(SHAPES)  # they did compile
    graphs = counters["stats"]["unique_graphs"]
    more = [([3 + i], [1], 30 + 17 * i) for i in range(5)] + [
        ([1 + i, 9, 4], [1, 1, 1], 40 + 9 * i) for i in range(5)
    ]
    more += [([2 + i], [2 + i], 25 + 11 * i) for i in range(5)] + [
        ([i + 1, 3, 8, 2][: i % 3 + 2], [4, i + 2, 1, 7][: i % 3 + 2], 64) for i in range(5)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an eager fallback would fail here
        for got, ref in _forwards(step, model, more):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def test_past_the_recompile_limit_forwards_run_eagerly():
    """At dynamo's recompile limit a fullgraph compile fails hard; the forward warns once
    and runs `packed_hidden` eagerly instead: the same hidden states."""
    model = _model("qwen2")
    step = CompiledStep(graph_limit=1)
    with pytest.warns(RuntimeWarning, match="recompile_limit"):
        results = list(_forwards(step, model, SHAPES))
    assert step.warned
    for got, ref in results:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_failed_compile_says_what_to_do(monkeypatch):
    """Inductor failing to build the graph (no C++ compiler, say) is a clear error that
    names the way out, not a compiler traceback."""
    from refusion.errors import CompileError

    model = _model("llama")
    step = CompiledStep()

    def fail(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(
            "inductor", RuntimeError("no working C++ compiler found"), None
        )

    monkeypatch.setattr(step, "fn", fail)
    cache = _filled(model, [3], 10)
    with pytest.raises(CompileError, match="no working C.. compiler found.*Run without --compile"):
        step(model, [[4]], [[3]], cache)
    assert cache.lengths == [3]


@torch.inference_mode()
def test_a_forward_that_feeds_nothing_writes_nothing():
    model = _model("llama")
    cache = _filled(model, [3, 5], 12)
    before = [t.clone() for t in cache.k]
    out = CompiledStep()(model, [[], []], [[], []], cache)
    assert out.shape == (0, model.config.hidden_size) and cache.lengths == [3, 5]
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))
