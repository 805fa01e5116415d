r"""The code sandbox: untrusted programs run walled off, judged by a trusted checker.

One mechanism for every caller: the evaluator's code benchmarks (HumanEval, MBPP) and
the synthetic suite's code family (`refusion.tasks`) both hand it a `Check`.

    from refusion.sandbox import Check, Limits, run_check
    result = run_check(
        Check(program="def f(n):\n    return n + 1\n", test="assert f(1) == 2\n", calls=("f",)),
        Limits(timeout=3.0),
    )
    result.passed, result.reason

`checks.py` probes the walls and runs each check, `_processes.py` starts its two
processes and reads the verdict, `records.py` holds the plain records (`Check`, `Limits`,
`Isolation`, `ExecResult`); `_harness.py` (the program's side) and `_checker.py` (the
test's side) run as scripts in their own interpreters, and `wire.py` is the plain data
between them. It imports nothing above `refusion.errors`.
"""

from .checks import isolation, run_check, run_checks
from .errors import SandboxError
from .records import Check, ExecResult, Isolation, Limits

__all__ = [
    "Check",
    "ExecResult",
    "Isolation",
    "Limits",
    "SandboxError",
    "isolation",
    "run_check",
    "run_checks",
]
