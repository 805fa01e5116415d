"""Every benchmark by name and protocol: what the runner, the CLI and the benchmarks of
this package look a task up in.

Two protocols: `robust` (our prompts and lenient answer extraction, the same for every
model; every task has it) and `paper` (the authors' evaluation as they ran it,
`paper.py`; their seven benchmarks, not the bundled suite). One instance per benchmark
and protocol, made when this module is first imported.
"""

from __future__ import annotations

from . import benchmarks as robust
from . import paper
from .benchmarks import Benchmark
from .errors import UnknownTaskError

PROTOCOLS = ("robust", "paper")

# the robust benchmarks, in the paper's order, then the bundled suite
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        robust.GSM8K(),
        robust.MATH(),
        robust.MBPP(),
        robust.HumanEval(),
        robust.GPQA(),
        robust.ARCChallenge(),
        robust.MMLUPro(),
        robust.Suite(),
    )
}
PAPER_BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        paper.GSM8K(),
        paper.MATH(),
        paper.MBPP(),
        paper.HumanEval(),
        paper.GPQA(),
        paper.ARCChallenge(),
        paper.MMLUPro(),
    )
}
_BY_PROTOCOL = {"robust": BENCHMARKS, "paper": PAPER_BENCHMARKS}


def task_names() -> list[str]:
    """Every task's name (each has the robust protocol), in the paper's order."""
    return list(BENCHMARKS)


def get_benchmark(name: str, protocol: str = "robust") -> Benchmark:
    """The benchmark `name` under `protocol`; an UnknownTaskError names what exists."""
    if protocol not in PROTOCOLS:
        raise UnknownTaskError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    if name not in BENCHMARKS:
        raise UnknownTaskError(f"unknown task {name!r}; known: {', '.join(BENCHMARKS)}")
    found = _BY_PROTOCOL[protocol].get(name)
    if found is None:
        raise UnknownTaskError(
            f"{name} has no {protocol} protocol (it is ours, not the paper's): use --protocol robust"
        )
    return found
