"""Reading tool calls back out of a reply (`serve/protocol/tools.py`): whole, and streamed in
pieces of every size, with text around the calls, a block that is no call, and a reply cut
inside a call."""

from __future__ import annotations

import json

import pytest

from refusion.serve.protocol.tools import CallStream, Tools, split_calls

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TWO = CALL + "\n" + CALL.replace("get_time", "get_date")


def _names(calls):
    return [c["function"]["name"] for c in calls]


def test_a_reply_of_calls_has_no_text():
    content, calls = split_calls(TWO)
    assert content is None and _names(calls) == ["get_time", "get_date"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert calls[0]["id"] != calls[1]["id"]


def test_text_around_a_call_is_kept_and_a_block_that_is_no_call_stays_text():
    content, calls = split_calls("Let me look. " + CALL + " Done.")
    assert content == "Let me look.  Done." and _names(calls) == ["get_time"]
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert split_calls(broken) == (broken, [])


def _streamed(text, size):
    stream, out, calls = CallStream(), [], []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        t, c = stream.feed(piece, final=k == len(pieces) - 1)
        out.append(t)
        calls += c
    return "".join(out), calls


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_streamed_in_pieces_the_calls_come_whole_and_the_text_is_the_same(size):
    text, calls = _streamed("Sure: " + TWO, size)
    assert text.strip() == "Sure:" and _names(calls) == ["get_time", "get_date"]
    assert [c["index"] for c in calls] == [0, 1]
    plain = "a < b and <tool is not a call"
    assert _streamed(plain, size) == (plain, [])
    cut = "Hm " + CALL[:30]  # the reply ended inside a call: it comes out as text at the end
    assert _streamed(cut, size) == (cut, [])


def test_a_forced_call_grammar_names_only_the_chosen_function():
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    named = Tools([fn, other], "g", parallel=False).grammar()
    assert '"const": "g"' in named and '"const": "f"' not in named and "call)*" not in named
    assert '"const": "f"' in Tools([fn, other], "required").grammar()
