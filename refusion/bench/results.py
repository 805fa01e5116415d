"""Pages of measurements (`docs/results/*.md`), written by the `refusion bench` commands
that measure them.

A figure without its command, commit, machine and date cannot be checked or repeated, and
one copied by hand drifts from what the command printed. So `--results [PAGE]` on a bench
command keeps what the command prints and, when it has finished, writes it into PAGE (by
default `docs/results/<topic>.md`) under a header block that says which command wrote it,
at which commit, on which machine, and when. The block is marked: running the same command
again replaces its own block and leaves the rest of the page (older, dated measurements and
what they say) as it was; another command's block goes on top, newest first.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path("docs") / "results"
CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout whose code ran, when it is one
_BEGIN, _END = "<!-- bench-results begin {} -->", "<!-- bench-results end {} -->"


def add_results_argument(parser: argparse.ArgumentParser, page: str) -> None:
    """`--results [PAGE.md]`; without a value, the command's own topic page in docs/results/."""
    parser.add_argument(
        "--results",
        nargs="?",
        const=str(RESULTS_DIR / page),
        default=None,
        metavar="PAGE.md",
        help=f"also write what this prints to a markdown page, under the command line, commit, machine "
        f"and date (default: {RESULTS_DIR / page}); a block this command wrote before is replaced",
    )


def writes_results(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A bench command's `run` that, given `--results`, writes what it printed to the page
    once it has succeeded (on the process that prints, when several take part)."""

    @functools.wraps(run)
    def run_and_write(args: argparse.Namespace) -> int:
        from ..parallel import is_main

        if not getattr(args, "results", None) or not is_main():
            return run(args)
        header = Header.now(command_line(args))  # before the run: its commit and start
        with _teed_stdout() as printed:
            code = run(args)
        if code == 0:
            page = write_block(Path(args.results), header, printed.getvalue())
            print(f"results page: {page}")
        return code

    return run_and_write


@dataclass(frozen=True)
class Header:
    """What makes a figure checkable: the command as run, the code, the machine, the date."""

    command: str
    commit: str
    machine: str
    date: str

    @classmethod
    def now(cls, command: str) -> Header:
        """The header of a run of `command` starting now, on this machine and checkout."""
        return cls(command, commit(), machine(), datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def command_line(args: argparse.Namespace) -> str:
    """`refusion bench ...` exactly as run (the dispatcher keeps the arguments), after the
    thread count where it was set: these benchmarks' figures depend on it."""
    argv = getattr(args, "_argv", None)
    line = "refusion " + (
        shlex.join(argv)
        if argv is not None
        else f"bench {getattr(args, 'bench', '?')} (run from Python: flags not recorded)"
    )
    threads = os.environ.get("OMP_NUM_THREADS")
    return f"OMP_NUM_THREADS={threads} {line}" if threads else line


def commit(checkout: Path = CHECKOUT) -> str:
    """The checkout's short commit, with `-dirty` when a tracked file outside docs/ differs
    from it (pages written by earlier runs do not change the code measured); "unknown"
    outside a git checkout."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=checkout, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed else "")


def machine() -> str:
    """CPU model and cores, GPU (when torch sees one), torch version and threads, OS."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    threads = torch.get_num_threads()
    return (
        f"{cpu_model()}, {usable} of {os.cpu_count()} logical CPUs usable; {gpu}; torch {torch.__version__} "
        f"with {threads} thread{'s' * (threads != 1)}; Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)
    except OSError:
        found = None
    return found.group(1).strip() if found else (platform.processor() or platform.machine() or "unknown CPU")


def write_block(page: Path, header: Header, printed: str) -> Path:
    """Write the command's block into `page`: in place of the block the same command wrote
    before, else above the page's first section or block (a new page gets a title)."""
    key = hashlib.sha1(_without_results(header.command).encode()).hexdigest()[:12]
    block = render_block(key, header, printed)
    text = page.read_text() if page.exists() else f"# Results: {page.stem}\n\n"
    begin, end = re.escape(_BEGIN.format(key)), re.escape(_END.format(key))
    old = re.search(rf"{begin}.*?{end}\n?", text, flags=re.S)
    if old:
        text = text[: old.start()] + block + text[old.end() :]
    else:
        first = re.search(r"^(## |<!-- bench-results begin )", text, flags=re.M)
        at = first.start() if first else len(text)
        text = text[:at] + block + ("\n" if first else "") + text[at:]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return page


def render_block(key: str, header: Header, printed: str) -> str:
    """The header block, then the command's output verbatim in a fence longer than any run
    of backticks in it."""
    verb = re.search(r"refusion (bench \S+)", header.command)
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", printed)), default=0))
    return "\n".join(
        [
            _BEGIN.format(key),
            f"## `refusion {verb.group(1) if verb else 'bench'}`, {header.date}",
            "",
            "Written by the command below (`--results`); running it again replaces this section.",
            "",
            f"- command: `{header.command}`",
            f"- commit: `{header.commit}`",
            f"- machine: {header.machine}",
            f"- date: {header.date}",
            "",
            fence + "text",
            printed.rstrip("\n"),
            fence,
            _END.format(key),
            "",
        ]
    )


def _without_results(command: str) -> str:
    """The command line less its `--results [PAGE]`: the same measurement, wherever it is written."""
    return re.sub(r" --results(=\S+| (?!-)\S+)?", "", command)


class _Tee(io.TextIOBase):
    """A stdout that also keeps what is written to it."""

    def __init__(self, out) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()

    def getvalue(self) -> str:
        return self.kept.getvalue()


@contextlib.contextmanager
def _teed_stdout() -> Iterator[_Tee]:
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee
