"""`refusion chat [MODEL]`: an interactive chat that streams each reply as it becomes final.

The loop (`chat_loop`) takes its input and output as arguments, so it runs the same under
a terminal, a pipe or a test. A turn that fails (a library error, a message too long for
the context, Ctrl-C during the reply) is reported on one line and leaves the conversation
as it was: the chat only ends on an empty line or end of input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from ...decode.fit import NoRoomError
from ...errors import ContextLengthError, ReFusionError
from ...settings.decode import DecodeConfig
from ..flags import (
    add_decode_arguments,
    add_model_arguments,
    check_mask_before_load,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
)

if TYPE_CHECKING:
    from ...decode import Engine, RequestOutput
    from ...decode.admit import PreparedRequest

Message = dict[str, str]
Turn = tuple[str, str]  # (user, assistant)
SINGLE_TURN_NOTE = (
    "this model knows single turns only: each message is answered on its own "
    "(--history to keep the conversation)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default: the bundled model)")
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--stats", action="store_true", help="print NFE, TPF and TPS after each reply")
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "--history",
        action="store_true",
        default=None,
        help="keep the conversation, even for a model that knows single turns only",
    )
    g.add_argument(
        "--no-history",
        dest="history",
        action="store_false",
        default=None,
        help="answer each message on its own (the system message and that message)",
    )
    add_decode_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ...decode.follow import engine_for
    from ...settings.recommended import recommended_of

    args.model = args.model or args.model_pos
    decode_config_from_args(args)  # bad flags fail before the model loads
    check_mask_before_load(args)
    model, tokenizer = load_from_args(args)
    cfg = decode_config_from_args(args, model=model)
    engine = engine_for(model, tokenizer, engine_config_from_args(args))
    rec = recommended_of(model)
    keep, note = keeps_history(args.history, rec.single_turn)
    if rec.about:
        print(f"model: {rec.about}", file=sys.stderr)
    if note:
        print(note, file=sys.stderr)
    print("refusion chat: an empty line or Ctrl-D ends the session; Ctrl-C stops a reply.", file=sys.stderr)
    if sys.stdin.isatty():
        enable_line_editing()
    chat_loop(engine, cfg, keep_history=keep, system=args.system, stats=args.stats)
    return 0


def keeps_history(flag: bool | None, single_turn: bool) -> tuple[bool, str | None]:
    """Whether to keep the conversation, and a note to show when the model's own settings
    decided it: a single-turn model fed a conversation answers worse than one fed the last
    message alone, so it gets that unless the user asks otherwise."""
    if flag is not None:
        return flag, None
    if single_turn:
        return False, SINGLE_TURN_NOTE
    return True, None


def enable_line_editing() -> None:
    """Arrow keys edit the line and recall earlier ones (input() uses readline once it is
    imported); where the platform has no readline the chat works without it."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass


# ---------------------------------------------------------------------- the loop
def chat_loop(
    engine: Engine,
    cfg: DecodeConfig,
    *,
    keep_history: bool = True,
    system: str | None = None,
    stats: bool = False,
    read: Callable[[str], str] | None = None,
    write: TextIO | None = None,
    err: TextIO | None = None,
) -> list[Turn]:
    """Read a message, stream its reply, until an empty line or end of input. Returns the
    turns kept (empty without history). `read` defaults to input(), `write` and `err` to
    stdout and stderr, looked up at call time (so a redirected stream is honoured)."""
    read = read or input
    write, err = write or sys.stdout, err or sys.stderr
    turns: list[Turn] = []
    while True:
        try:
            user = read("> ")
        except KeyboardInterrupt:  # like Python's prompt: a fresh line, ask again
            write.write("\n")
            continue
        except EOFError:
            write.write("\n")
            break
        if not user.strip():
            break
        try:
            kept = answer(engine, cfg, system, turns if keep_history else [], user, stats, write, err)
        except ReFusionError as e:
            print(f"error: {e}", file=err)
            continue
        if keep_history:
            turns = kept
    return turns


def answer(
    engine: Engine,
    cfg: DecodeConfig,
    system: str | None,
    turns: list[Turn],
    user: str,
    stats: bool,
    write: TextIO,
    err: TextIO,
) -> list[Turn]:
    """One turn: fit the prompt into the context, stream the reply, and return the turns
    with this one added. A cancelled reply returns `turns` unchanged (nothing dropped,
    nothing added); errors propagate with the conversation untouched."""
    context = engine.model.config.max_position_embeddings
    prepared, dropped = fit_prompt(engine, cfg, system, turns, user)
    if dropped:
        print(
            f"[dropped {dropped} earlier turn{'s' if dropped > 1 else ''} to fit the model's context "
            f"of {context} positions]",
            file=err,
        )
    out = stream_reply(engine, prepared, write)
    if out is None:
        print("[reply cancelled]", file=err)
        return turns
    if stats:
        s = out.stats
        print(
            f"[{prepared.cfg.method}] tokens={s.tokens} nfe={s.nfe} tpf={s.tpf:.2f} tps={s.tps:.1f}", file=err
        )
    return turns[dropped:] + [(user, out.text)]


def messages_of(system: str | None, turns: list[Turn], user: str) -> list[Message]:
    """The conversation the model sees: the system message, the kept turns, the new one."""
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": user}]


def fit_prompt(
    engine: Engine, cfg: DecodeConfig, system: str | None, turns: list[Turn], user: str
) -> tuple[PreparedRequest, int]:
    """The conversation prepared (`Engine.prepare`), and how many of the oldest turns were
    dropped to make room. Earlier turns go before the reply is shortened: a full-length
    answer to the new message matters more than the oldest context. Raises
    ContextLengthError ("message too long", with what would fit) when even the new
    message alone leaves less than one decoding unit."""
    for dropped in range(len(turns) + 1):
        messages = messages_of(system, turns[dropped:], user)
        try:
            return engine.prepare(messages, cfg), dropped
        except NoRoomError:
            continue
    try:
        return engine.prepare(messages, cfg, lower=True), len(turns)
    except NoRoomError as e:
        raise ContextLengthError(f"message too long: {e}") from None


def stream_reply(engine: Engine, prepared: PreparedRequest, write: TextIO) -> RequestOutput | None:
    """Stream one reply to `write`; its final RequestOutput, or None when Ctrl-C cancelled
    it. Any failure during the steps leaves the engine empty and ready for the next turn."""
    rid = engine.add_request(prepared)
    out = None
    try:
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    write.write(o.delta)
                    write.flush()
                    out = o
    except KeyboardInterrupt:
        clear(engine, rid)
        write.write("\n")
        return None
    except BaseException:
        clear(engine, rid)
        if out is not None:  # end the partial reply's line before the error's
            write.write("\n")
        raise
    write.write("\n")
    return out


def clear(engine: Engine, rid: str) -> None:
    """Abort the request, drain what the engine still owes, and drop its cache: a step
    stopped half-way may have left the cache half-written."""
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.abort_running()
