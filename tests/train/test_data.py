"""Reading, tokenising, splitting and batching training data (refusion/data.py)."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from refusion.train.dataset import (
    DataError,
    DataStats,
    IndexStream,
    collate,
    iter_records,
    load_dataset,
    split_eval,
)

RECORDS = [
    {"query": "Hello there", "response": "Hello world!"},
    {"query": "Two plus three?", "response": "five"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The cat?"},
            {"role": "assistant", "content": "sat on the mat"},
        ]
    },
]


def write_jsonl(path: Path, lines: list) -> Path:
    with path.open("wb") as f:
        for line in lines:
            if not isinstance(line, bytes):
                line = (line if isinstance(line, str) else json.dumps(line)).encode()
            f.write(line)
            f.write(b"\n")
    return path


def expected_ids(tokenizer, record) -> tuple[list[int], list[int]]:
    if "messages" in record:
        prompt_msgs, response = record["messages"][:-1], record["messages"][-1]["content"]
    else:
        prompt_msgs, response = [{"role": "user", "content": record["query"]}], record["response"]
    text = tokenizer.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return prompt, tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize("form", ["jsonl", "json"])
def test_records_are_tokenised_with_the_chat_template_and_eos(tmp_path, tiny_tokenizer, form):
    if form == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(RECORDS, indent=2))
    else:
        path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    ds, stats = load_dataset(path, tiny_tokenizer, max_length=512)
    assert len(ds) == stats.kept == stats.records == 3
    for i, record in enumerate(RECORDS):
        prompt, response = expected_ids(tiny_tokenizer, record)
        ids, m = ds[i]
        assert ids.tolist() == prompt + response and m == len(prompt)
    # the generation prompt closes the prompt; the response ends with EOS
    assert tiny_tokenizer.decode(ds[0][0][: ds[0][1]]).endswith("<|im_start|>assistant\n")
    assert ds[0][0][-1] == tiny_tokenizer.eos_token_id


def test_the_authors_sample_file_reads(tiny_tokenizer):
    ds, stats = load_dataset(
        "/work/shared/data/refusion_train_sample.json", tiny_tokenizer, max_length=1 << 20
    )
    assert stats.kept == stats.records == len(ds) > 0 and not stats.bad


def test_bad_records_are_counted_and_skipped(tmp_path, tiny_tokenizer):
    good = {"query": "q", "response": "fine"}
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            good,
            {"query": "no response"},
            {"response": "no query"},
            {"query": "q", "response": "   "},
            b'{"query": "q", "response": "caf\xe9"}',  # latin-1, not UTF-8
            '{"query": "q", "response": ',
            "[1, 2]",
            {"query": 3, "response": "x"},
            {"messages": [{"role": "assistant", "content": "hi"}]},
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
            "",
            good,
            {"query": "q", "response": "long " * 200},
        ],
    )
    ds, stats = load_dataset(path, tiny_tokenizer, max_length=64)
    assert len(ds) == stats.kept == 2
    assert stats.records == 12  # the blank line is not a record
    assert stats.too_long == 1
    assert stats.bad == {
        "missing key 'response'": 1,
        "missing key 'query'": 1,
        "empty response": 1,
        "not UTF-8": 1,
        "invalid JSON": 1,
        "not a JSON object": 1,
        "'query' or 'response' is not a string": 1,
        "no prompt message before the assistant's": 1,
        "the last message is not the assistant's": 1,
    }
    summary = stats.summary()
    assert (
        "2 of 12 records kept" in summary
        and "1 too long" in summary
        and "line 2: missing key 'response'" in summary
    )


def test_missing_unreadable_or_empty_files_raise_data_error(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl", tiny_tokenizer, 64)
    with pytest.raises(DataError, match="is a directory"):
        load_dataset(tmp_path, tiny_tokenizer, 64)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"query": "q", "response": "r"},')
    with pytest.raises(DataError, match="not valid JSON"):
        load_dataset(broken, tiny_tokenizer, 64)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"query": "caf\xe9", "response": "r"}]')
    with pytest.raises(DataError, match="not UTF-8"):
        load_dataset(latin, tiny_tokenizer, 64)
    useless = write_jsonl(tmp_path / "useless.jsonl", [{"query": "q"}, "oops"])
    with pytest.raises(DataError, match="no usable example") as err:
        load_dataset(useless, tiny_tokenizer, 64)
    assert "missing key 'response'" in str(err.value) and "invalid JSON" in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no usable example"):
        load_dataset(empty, tiny_tokenizer, 64)


def test_a_tokenizer_without_chat_template_gets_plain_prompts(tmp_path, tiny_tokenizer):
    tiny_tokenizer.chat_template = None
    ds, stats = load_dataset(write_jsonl(tmp_path / "d.jsonl", RECORDS[:1]), tiny_tokenizer, 512)
    assert "no chat template" in stats.summary()
    assert tiny_tokenizer.decode(ds[0][0][: ds[0][1]]) == "Hello there\n"


def test_jsonl_is_streamed(tmp_path):
    """Reading a 20 MB JSONL file never holds much more than a line in memory."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"query": "q" * 1000, "response": "r" * 1000}).encode() + b"\n"
    with path.open("wb") as f:
        for _ in range(10_000):
            f.write(line)
    stats = DataStats(str(path))
    tracemalloc.start()
    n = sum(1 for _ in iter_records(path, stats))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n == stats.records == 10_000
    assert peak < 2_000_000, f"peak {peak} bytes while reading {path.stat().st_size} bytes"


def test_eval_split_is_seeded_disjoint_and_bounded(tmp_path, tiny_tokenizer):
    records = [{"query": f"q{i}", "response": f"answer {i}"} for i in range(50)]
    ds, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", records), tiny_tokenizer, 512)
    train, held = split_eval(ds, 0.1, 100, seed=3)
    again_train, again_held = split_eval(ds, 0.1, 100, seed=3)
    _, other_held = split_eval(ds, 0.1, 100, seed=4)
    rows = lambda d: {tuple(d[i][0].tolist()) for i in range(len(d))}  # noqa: E731
    assert len(held) == 5 and len(train) == 45
    assert rows(held) | rows(train) == rows(ds) and not rows(held) & rows(train)
    assert rows(held) == rows(again_held) and rows(train) == rows(again_train)
    assert rows(held) != rows(other_held)
    assert len(split_eval(ds, 0.5, 3, seed=0)[1]) == 3
    assert split_eval(ds, 0.0, 100, seed=0)[1] is None


def test_index_stream_is_a_seeded_permutation_per_epoch():
    stream = IndexStream(10, seed=1)
    first = stream.take(0, 30)
    for e in range(3):
        assert sorted(first[10 * e : 10 * e + 10].tolist()) == list(range(10))
    assert not np.array_equal(first[:10], first[10:20])
    # any window equals the same positions of a fresh stream (resuming is exact)
    assert np.array_equal(IndexStream(10, seed=1).take(7, 15), first[7:22])
    assert not np.array_equal(IndexStream(10, seed=2).take(0, 10), first[:10])
    with pytest.raises(DataError):
        IndexStream(0, seed=0)


def test_collate_right_pads(tmp_path, tiny_tokenizer):
    ds, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", RECORDS), tiny_tokenizer, 512)
    tokens, prompt_lens, lengths = collate(ds, [2, 0], pad_id=0)
    assert tokens.dtype == torch.int64 and tokens.shape == (2, int(lengths.max()))
    for row, i in enumerate([2, 0]):
        ids, m = ds[i]
        assert tokens[row, : len(ids)].tolist() == ids.tolist() and int(prompt_lens[row]) == m
        assert tokens[row, len(ids) :].eq(0).all()


# ------------------------------------------------------------------------------ hostile files
DEEP = "[" * 100_000 + "]" * 100_000  # nesting past the JSON parser's recursion limit
LONG = "9" * 5000  # more digits than Python's int() converts
GOOD = '{"query": "q", "response": "fine"}'


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"query": "\\ud800", "response": "x"}', "a lone UTF-16 surrogate"),
        ('{"query": "q", "response": "\\udfff"}', "a lone UTF-16 surrogate"),
        (
            '{"messages": [{"role": "user", "content": "\\ud83d"}, {"role": "assistant", "content": "x"}]}',
            "a lone UTF-16 surrogate",
        ),
        ('{"query": "q", "response": "r", "x": ' + DEEP + "}", "nested too deep"),
        ('{"query": "q", "response": "r", "x": ' + LONG + "}", "number too long"),
    ],
)
def test_a_hostile_record_is_skipped_and_counted(tmp_path, tiny_tokenizer, line, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, line, GOOD])
    ds, stats = load_dataset(path, tiny_tokenizer, 64)
    assert (len(ds), stats.records, stats.bad) == (2, 3, {reason: 1})
    assert f"line 2: {reason}" in stats.summary()


@pytest.mark.parametrize(
    "text, words",
    [
        ("[" + GOOD + ", " + DEEP + "]", "nested deeper"),
        ("[" + GOOD + ', {"x": ' + LONG + "}]", "a number too long"),
    ],
)
def test_a_json_list_the_parser_cannot_take_is_one_line(tmp_path, tiny_tokenizer, text, words):
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_dataset(path, tiny_tokenizer, 64)
    message = str(err.value)
    assert str(path) in message and words in message and "\n" not in message and "--data" in message


def test_a_lone_surrogate_in_a_json_list_skips_that_record(tmp_path, tiny_tokenizer):
    path = tmp_path / "d.json"
    path.write_text("[" + GOOD + ', {"query": "\\ud800", "response": "x"}]')
    ds, stats = load_dataset(path, tiny_tokenizer, 64)
    assert (len(ds), stats.bad) == (1, {"a lone UTF-16 surrogate": 1})


@pytest.mark.parametrize("how", ["/dev/zero", "fifo", "symlink loop"])
def test_a_data_path_that_is_not_a_regular_file_is_one_line(tmp_path, tiny_tokenizer, within, how):
    """/dev/zero is one endless line, a FIFO blocks the read: both are refused unread."""
    path = tmp_path / "d.jsonl"
    if how == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("d.loop")
        (tmp_path / "d.loop").symlink_to("d.jsonl")
    with within(30), pytest.raises(DataError) as err:
        load_dataset(path, tiny_tokenizer, 64)
    message = str(err.value)
    assert str(path) in message and "not a" in message and "--data" in message and "\n" not in message
