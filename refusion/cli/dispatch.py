"""`refusion <verb>`: a thin dispatch table over the library.

Each verb lives in `refusion/cli/commands/<verb>.py` with `add_arguments(parser)` and
`run(args) -> int`. Only the verb being run has its flags built, and no module imports
torch before its `run`, so `refusion --help` and `refusion VERB --help` answer at once.
Library errors (`ReFusionError`) become one line on stderr and exit code 2. A reader
that closes the pipe early (`refusion info | head -c 1`) ends the command quietly with
exit code 141, as a Unix tool killed by SIGPIPE reports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import warnings

from ..errors import ReFusionError

VERBS = {
    "info": "print a checkpoint's architecture, size, vocabulary, context and MASK id",
    "convert": "prepare an AR checkpoint for ReFusion training (add <|mask|>)",
    "generate": "generate text from prompts (refusion, ar or mdm decoding)",
    "chat": "interactive chat that streams",
    "distill": "training data made by the model itself: its greedy answers to prompts",
    "train": "train with the ReFusion objective (or plain AR)",
    "adapter": "a LoRA run's adapters as a small directory that loads over its base",
    "eval": "evaluate on a benchmark",
    "bench": (
        "benchmarks that print figures side by side: "
        "decode, train, speed, suite, curve, diagnose, served, load"
    ),
    "serve": "OpenAI-compatible HTTP server",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every verb's name and help; the flags only of the verb that `argv` names (all of
    them when argv is None)."""
    parser = argparse.ArgumentParser(
        prog="refusion", description="ReFusion: parallel autoregressive slot decoding."
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    words = [a for a in argv if not a.startswith("-")] if argv is not None else None
    chosen = words[0] if words else None
    for verb, help_text in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=f"refusion.cli.commands.{verb}")
        if argv is None or verb == chosen:
            module = _command(verb)
            if verb == "bench":
                module.add_arguments(p, words[1] if words and len(words) > 1 else None)
            else:
                module.add_arguments(p)
            p.epilog = getattr(module, "EPILOG", None)  # what a verb's --help says after its flags
    return parser


def _command(verb: str):
    return importlib.import_module(f"refusion.cli.commands.{verb}")


def _one_line_warnings(verb: str) -> None:
    """Warnings as one line each, `refusion VERB: warning: ...`, as errors are printed."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"refusion {verb}: warning: {str(message).strip()}", file=file or sys.stderr)

    warnings.showwarning = show


# what a shell reports for a process that SIGPIPE ended (128 + 13)
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run the verb `argv` names and return its exit code.

    A closed stdout (the reader of a pipe has gone) is no error of ours: as the signal
    module's notes on SIGPIPE recommend, stdout is pointed at /dev/null, so that Python's
    own flush at exit does not fail again, and the exit code is 141, which is what `cat`
    or `grep` killed by SIGPIPE give, so `set -o pipefail` sees the same from all of
    them. Python ignores SIGPIPE, and restoring its default instead would also kill the
    process on a closed socket (`serve`)."""
    try:
        try:
            return _dispatch(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except SystemExit as e:
        # argparse swallows an OSError while it prints help (one longer than the stream's
        # buffer fails in the write itself), then exits 0: the pipe broke all the same
        if e.code not in (0, None) or not _stdout_closed():
            raise
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone, so that a BrokenPipeError
    from anything else (a child process's stdin, say) is not taken for it. Where poll
    cannot tell (no poll, as on Windows), the error is taken to be stdout's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # not a file descriptor: no pipe to break
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _silence_stdout() -> None:
    """Send what is left in stdout's buffer, and anything printed later, to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _dispatch(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    _one_line_warnings(args.verb)
    args._argv = argv  # a verb that starts copies of itself (serve's replicas) passes them on
    try:
        size = (getattr(args, "tensor_parallel_size", None) or 1) * (
            getattr(args, "data_parallel_size", None) or 1
        )
        if size > 1:
            return _run_split(args, size)
        return int(_command(args.verb).run(args) or 0)
    except ReFusionError as e:
        print(f"refusion {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"refusion {args.verb}: interrupted", file=sys.stderr)
        return 130


# verbs whose run is the same on every rank of a split model (no terminal, no socket)
SPLIT_VERBS = ("generate", "eval", "bench")
# the benchmarks that run on a split model (`bench suite` also over data-parallel replicas)
SPLIT_BENCHES = ("suite", "decode")
# verbs that own a terminal or a socket: rank 0 runs them, the other ranks follow its engine
LEADER_VERBS = ("chat", "serve")


def _run_split(args: argparse.Namespace, size: int) -> int:
    """Run the verb on `size` processes (data-parallel replicas x tensor-parallel ranks),
    or, under torchrun, in this one of its processes. A tensor-parallel group runs the
    verb on the same inputs, its first rank printing and writing; replicas share the
    work (`eval`)."""
    from ..errors import ConfigError
    from ..parallel import join_torchrun, spawn

    if args.verb in LEADER_VERBS:
        return _lead(args, size)
    if args.verb not in SPLIT_VERBS:
        raise ConfigError(
            f"--tensor-parallel-size is not yet supported by `refusion {args.verb}`; "
            f"it is by {', '.join(SPLIT_VERBS + LEADER_VERBS)}"
        )
    if args.verb == "bench" and args.bench not in SPLIT_BENCHES:
        raise ConfigError(
            f"`refusion bench {args.bench}` runs in one process; --tensor-parallel-size is taken by "
            + " and ".join(f"`bench {b}`" for b in SPLIT_BENCHES)
        )
    if join_torchrun(getattr(args, "device", "cpu")):
        import torch.distributed as dist

        if dist.get_world_size() != size:
            raise ConfigError(
                f"torchrun started {dist.get_world_size()} processes; the flags ask for {size} "
                "(data-parallel x tensor-parallel size)"
            )
        return int(_command(args.verb).run(args) or 0)
    stdin_copy = None
    if str(getattr(args, "prompt_file", None)) == "-":  # the ranks have no terminal: read stdin here
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(sys.stdin.read())
        args.prompt_file = stdin_copy = type(args.prompt_file)(f.name)
    try:
        return int(spawn(size, _run_rank, args, device=getattr(args, "device", "cpu")) or 0)
    finally:
        if stdin_copy is not None:
            os.unlink(stdin_copy)


def _lead(args: argparse.Namespace, size: int) -> int:
    """This process runs the verb as rank 0; the other ranks (started here, or by
    torchrun) follow its engine."""
    from ..decode.follow import follow, lead, release
    from ..errors import ConfigError
    from ..parallel import join_torchrun
    from .flags import engine_from_args

    device = getattr(args, "device", "cpu")
    if (getattr(args, "data_parallel_size", None) or 1) > 1:
        if args.verb != "serve":
            raise ConfigError(f"`refusion {args.verb}` takes --tensor-parallel-size only")
        if join_torchrun(device):
            raise ConfigError(
                "under torchrun, `refusion serve` takes --tensor-parallel-size only: run "
                "`refusion serve --data-parallel-size N` on its own, and it starts its replicas"
            )
        return int(_command("serve").run_replicas(args) or 0)
    if join_torchrun(device):
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return follow(args, engine_from_args)
        procs = []
    else:
        procs = lead(size, args, engine_from_args, device)
    try:
        return int(_command(args.verb).run(args) or 0)
    finally:
        release(procs)


def _run_rank(args: argparse.Namespace) -> int:
    _one_line_warnings(args.verb)
    return int(_command(args.verb).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
