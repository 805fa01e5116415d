"""`refusion chat`: the loop driven by scripted input on the bundled model (history kept
or not, trimmed to the context, a message too long, Ctrl-C during a reply and at the
prompt), and the command end to end with piped stdin."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable, Iterable

import pytest

import refusion
from refusion.cli.commands.chat import SINGLE_TURN_NOTE, chat_loop, keeps_history
from refusion.cli.dispatch import main
from refusion.decode import Engine
from refusion.model.prompts import chat_ids
from refusion.settings.recommended import recommended_of

CONTEXT = 512  # the bundled model's
SORT = "Sort these numbers from smallest to largest: 55, 25, 75, 93"
REVERSE = "Reverse the order of these words: snow, ship, cake, moon, king"


@pytest.fixture(scope="module")
def bundled():
    return refusion.load()


@pytest.fixture
def engine(bundled):
    """An engine over the bundled model whose add_request records the prompt ids it gets."""
    model, tok = bundled
    eng = Engine(model, tok)
    eng.prompts = []
    add = eng.add_request

    def recording(prepared, cfg=None, **kw):
        eng.prompts.append(list(prepared.ids))
        return add(prepared, cfg, **kw)

    eng.add_request = recording
    return eng


def cfg_of(bundled, gen_length: int = 16):
    return recommended_of(bundled[0]).decode_config(gen_length=gen_length)


def script(lines: Iterable[str | BaseException]) -> Callable[[str], str]:
    """A `read` that answers each prompt with the next line (raising it if it is an
    exception), then EOF."""
    it = iter(lines)

    def read(_prompt: str) -> str:
        item = next(it, EOFError())
        if isinstance(item, BaseException):
            raise item
        return item

    return read


def run_chat(engine, bundled, lines, **kw):
    out, err = io.StringIO(), io.StringIO()
    cfg = kw.pop("cfg", None) or cfg_of(bundled)
    turns = chat_loop(engine, cfg, read=script(lines), write=out, err=err, **kw)
    return turns, out.getvalue(), err.getvalue()


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def long_message(tok, tokens: int) -> str:
    """A distinct message whose prompt is about `tokens` tokens long."""
    words = [f"{i}" for i in range(tokens // 2)]
    while len(chat_ids(tok, [user("Sort these numbers: " + ", ".join(words))])) > tokens:
        words.pop()
    return "Sort these numbers: " + ", ".join(words)


# ---------------------------------------------------------------------- history
def test_without_history_each_turn_is_sent_alone(engine, bundled):
    tok = bundled[1]
    turns, out, _ = run_chat(engine, bundled, [SORT, REVERSE], keep_history=False, system="be brief")
    system = {"role": "system", "content": "be brief"}
    assert engine.prompts == [chat_ids(tok, [system, user(SORT)]), chat_ids(tok, [system, user(REVERSE)])]
    assert turns == []
    # one reply per message, each ended by a newline (a reply may take several lines), then EOF's newline
    replies = [o.text for o in refusion.generate(bundled[0], tok, engine.prompts, cfg_of(bundled))]
    assert out == "".join(r + "\n" for r in replies) + "\n"


def test_with_history_the_conversation_is_sent(engine, bundled):
    tok = bundled[1]
    turns, _, err = run_chat(engine, bundled, [SORT, REVERSE], keep_history=True)
    assert [u for u, _ in turns] == [SORT, REVERSE]
    first_reply = turns[0][1]
    assert engine.prompts[1] == chat_ids(
        tok, [user(SORT), {"role": "assistant", "content": first_reply}, user(REVERSE)]
    )
    assert "dropped" not in err


def test_oldest_turns_are_dropped_when_the_context_fills(engine, bundled):
    tok = bundled[1]
    cfg = cfg_of(bundled)
    messages = [long_message(tok, 170 - i) for i in range(4)]  # distinct, ~170 tokens each
    turns, out, err = run_chat(engine, bundled, messages, keep_history=True, system="be brief")
    notes = [line for line in err.splitlines() if "dropped" in line]
    assert notes and all(f"to fit the model's context of {CONTEXT} positions" in n for n in notes)
    assert "error" not in err
    assert len(engine.prompts) == 4  # every message answered: the session went on
    assert all(len(ids) + cfg.region_length <= CONTEXT for ids in engine.prompts)
    assert turns[-1][0] == messages[-1] and turns[0][0] != messages[0]
    assert tok.decode(engine.prompts[-1]).startswith(
        "<|im_start|>system\nbe brief"
    )  # the system message stays


def test_a_message_too_long_is_refused_and_the_chat_goes_on(engine, bundled):
    tok = bundled[1]
    huge = " ".join(["snow ship cake moon king"] * 200)
    turns, out, err = run_chat(engine, bundled, [SORT, huge, REVERSE], keep_history=True)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "too long" in errors[0] and str(CONTEXT) in errors[0]
    assert len(engine.prompts) == 2  # the long one never reached the engine
    assert [u for u, _ in turns] == [SORT, REVERSE]  # the history survived it
    assert engine.prompts[1] == chat_ids(
        tok, [user(SORT), {"role": "assistant", "content": turns[0][1]}, user(REVERSE)]
    )


def test_a_library_error_is_one_line_and_the_chat_goes_on(engine, bundled):
    add = engine.add_request
    calls = []

    def failing_once(ids, cfg=None, **kw):
        calls.append(1)
        if len(calls) == 1:
            from refusion.errors import ConfigError

            raise ConfigError("something the user can fix")
        return add(ids, cfg, **kw)

    engine.add_request = failing_once
    turns, _, err = run_chat(engine, bundled, [SORT, REVERSE], keep_history=True)
    assert "error: something the user can fix" in err
    assert [u for u, _ in turns] == [REVERSE]


# ---------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_during_a_reply_cancels_only_that_reply(engine, bundled):
    tok = bundled[1]
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        outs = step()
        if len(calls) == 2:  # a real step ran, then Ctrl-C: its outputs are lost
            raise KeyboardInterrupt
        return outs

    engine.step = interrupted_step
    cfg = cfg_of(bundled, gen_length=64)  # several steps
    turns, out, err = run_chat(engine, bundled, [SORT, REVERSE], keep_history=True, cfg=cfg)
    assert "[reply cancelled]" in err
    assert not engine.has_unfinished() and engine.num_running == 0
    assert engine.prompts[1] == chat_ids(tok, [user(REVERSE)])  # neither half of the cancelled turn
    assert [u for u, _ in turns] == [REVERSE] and turns[0][1]


def test_ctrl_c_at_the_prompt_asks_again(engine, bundled):
    turns, out, err = run_chat(engine, bundled, [KeyboardInterrupt(), SORT, ""], keep_history=True)
    assert out.startswith("\n")
    assert [u for u, _ in turns] == [SORT] and len(engine.prompts) == 1
    assert "cancelled" not in err


def test_an_empty_line_ends_the_session(engine, bundled):
    turns, _, _ = run_chat(engine, bundled, ["", SORT], keep_history=True)
    assert turns == [] and engine.prompts == []


# ---------------------------------------------------------------------- the command
def test_history_follows_the_flags_and_the_model():
    assert keeps_history(None, True) == (False, SINGLE_TURN_NOTE)
    assert keeps_history(None, False) == (True, None)
    assert keeps_history(True, True) == (True, None)
    assert keeps_history(False, False) == (False, None)


@pytest.fixture
def recorded(monkeypatch):
    """Prompt ids every Engine gets, for commands run through `main`."""
    prompts: list[list[int]] = []
    add = Engine.add_request

    def recording(self, prepared, cfg=None, **kw):
        prompts.append(list(prepared.ids))
        return add(self, prepared, cfg, **kw)

    monkeypatch.setattr(Engine, "add_request", recording)
    return prompts


@pytest.mark.parametrize("flag", [None, "--history"])
def test_a_single_turn_model_keeps_no_history_unless_asked(bundled, recorded, monkeypatch, capsys, flag):
    tok = bundled[1]
    assert recommended_of(bundled[0]).single_turn
    monkeypatch.setattr("builtins.input", script([SORT, REVERSE]))
    assert main(["chat", "--gen-length", "16", *([flag] if flag else [])]) == 0
    err = capsys.readouterr().err
    assert err.count(recommended_of(bundled[0]).about) == 1
    if flag is None:
        assert err.count(SINGLE_TURN_NOTE) == 1
        assert recorded[1] == chat_ids(tok, [user(REVERSE)])
    else:
        assert SINGLE_TURN_NOTE not in err
        assert len(recorded[1]) > len(chat_ids(tok, [user(SORT), user(REVERSE)]))
        assert recorded[1][: len(chat_ids(tok, [user(SORT)]))] == chat_ids(tok, [user(SORT)])


def test_chat_with_piped_input_answers_each_line_and_exits_0():
    done = subprocess.run(
        [sys.executable, "-m", "refusion.cli", "chat", "--gen-length", "16"],
        input=f"{SORT}\n{REVERSE}\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    replies = done.stdout.split("> ")[1:]
    assert len(replies) == 3 and all(r.strip() for r in replies[:2]) and not replies[2].strip()
    assert "error" not in done.stderr
