"""Check untrusted generated programs (HumanEval, MBPP, the suite's code family) with a
verdict the program cannot forge.

A check is two processes. The candidate's program runs in the sandbox (`_harness.py`)
and only answers calls. The benchmark's test runs in a separate, trusted checker process
(`_checker.py`): each call of the candidate's function there sends plain-data arguments
over a pipe and gets plain data back (`wire.py`), and the assertions run on those values.
The checker's verdict reaches the evaluator on a pipe the candidate does not hold: there
is no nonce to steal, no exit code to fake, no object whose `__eq__` says yes.

The sandbox's walls, strongest first, where the OS allows them (`_walls.py` builds the
program's side of them):

- private PID, network and IPC namespaces (`unshare --pid --net --ipc --fork`): a /proc
  that shows only the check's own processes, no network, System V shared memory, queues
  and semaphores that vanish with the check; the namespace's PID 1 is not the program
  but a process that waits for it, so every process of the check, however it detached
  itself, ends when the program's does;
- a private mount namespace with a root of its own: only the system folders, the
  interpreter and the installed packages, read-only (the benchmark's data, `Check.hidden`,
  hidden), fresh empty tmpfs on /tmp, /var/tmp and /dev/shm that vanish with it; the
  checkout, home folders and the evaluation's outputs are not there;
- one memory limit for all the check's processes together: a cgroup of its own
  (`_cgroup.py`) where one can be made, else PID 1 watching their memory;
- a user id of its own (when we are root: an unused uid per worker slot, reused least
  recently used first) in a user namespace of its own with a fresh session keyring, so
  file permissions keep it out of everything it does not own, RLIMIT_NPROC bounds a
  fork bomb, and keys it makes end with it;
- no new privileges (a setuid program runs as the program's uid) and no capabilities;
- resource limits: address space (memory, per process), CPU seconds, file size, no core
  dumps;
- a new session, killed as a process group at the wall-clock timeout;
- in-process guards (`_harness.py`): no process creation, no writes outside its
  directory, no sockets when there is no network namespace.

Which walls are up is probed once per process (`isolation()`), the missing ones said once,
and written into results. Checks run in parallel across cores:
a thread pool where each thread waits on its processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from ..io.staging import remove_dead_writers, writer_tag
from . import _cgroup
from ._processes import kill_uid, run_pair
from .errors import SandboxError
from .records import Check, ExecResult, Isolation, Limits

_HERE = Path(__file__).parent
_HARNESS, _CHECKER, _WIRE = _HERE / "_harness.py", _HERE / "_checker.py", _HERE / "wire.py"
_WALLS = _HERE / "_walls.py"


class _UidPool:
    """Unused uids, one per concurrently running program, distinct across our processes."""

    def __init__(self, size: int = 64) -> None:
        base = 200_000 + (os.getpid() % 50_000) * size
        self._free = list(range(base, base + size))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        """The uid free the longest."""
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            return self._free.pop(0)

    def release(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


_uids = _UidPool()


FOLDER_PREFIX = "refusion-sandbox-"


def _folder(files: dict[str, str | Path], uid: int | None) -> Path:
    """A fresh 0700 folder with the given files (name -> text or a file to copy), named
    after this host and process (`refusion-sandbox-HOST-PID-XXXXXXXX`) so that a later
    run can tell it was left by a run that was killed (`remove_leftovers`)."""
    remove_leftovers()
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{writer_tag()}-"))
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copyfile(content, folder / name)
        else:
            (folder / name).write_text(content, encoding="utf-8")
    if uid is not None:
        os.chown(folder, uid, uid)
    os.chmod(folder, 0o700)
    return folder


@lru_cache(maxsize=1)
def remove_leftovers() -> int:
    """Remove, once per process, the check folders that an evaluation killed mid-check
    left in the temporary folder: they hold a benchmark's test code, and the killed
    process could not remove them. Only folders of this host whose process is gone."""
    removed, _ = remove_dead_writers(Path(tempfile.gettempdir()), FOLDER_PREFIX)
    return removed


def _execute(check: Check, limits: Limits, iso: Isolation) -> ExecResult:
    """One check from start to end: its folders, uid and memory group made, its two
    processes run, and everything it had taken back or removed, whatever happened."""
    uid = _uids.acquire() if iso.own_uid else None
    files: dict[str, str | Path] = {
        "program.py": check.program,
        "harness.py": _HARNESS,
        "wire.py": _WIRE,
        "walls.py": _WALLS,
    }
    program = _folder(files, uid)
    job = {"setup": check.setup, "test": check.test, "calls": list(check.calls)}
    checker = _folder({"job.json": json.dumps(job), "checker.py": _CHECKER, "wire.py": _WIRE}, None)
    group = _cgroup.make(limits.memory_mb << 20) if iso.memory == "cgroup" else None
    try:
        walls = {"cgroup": group, "hidden": [os.path.abspath(p) for p in check.hidden]}
        result = run_pair(program, checker, limits, iso, uid, walls)
        if group and not result.passed and _cgroup.oom_killed(group):
            result.reason = f"memory: the program's processes used more than {limits.memory_mb} MB together"
        return result
    finally:
        if uid is not None:
            if not iso.namespaces:  # in a PID namespace nothing outlives its PID 1
                kill_uid(uid)
            _uids.release(uid)
        if group:
            _cgroup.remove(group)
        shutil.rmtree(program, ignore_errors=True)
        shutil.rmtree(checker, ignore_errors=True)


# ---------------------------------------------------------------------------- probing
_PROBE = Check(
    program="import fractions, json, collections\ndef f(n):\n    return sum(range(n))\n",
    test="assert f(4) == 6\n",
    calls=("f",),
)


def _candidates() -> list[str]:
    names = [
        sys.executable,
        f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}",
        "/usr/bin/python3",
        "/usr/local/bin/python3",
        shutil.which("python3") or "",
    ]
    seen: list[str] = []
    for name in names:
        if name and os.path.exists(name) and name not in seen:
            seen.append(name)
    return seen


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once which walls work here, strongest first; the weakest always works. Where
    some are missing (a container that forbids namespaces, no cgroup to write), say which
    once."""
    if os.name != "posix":
        raise SandboxError("the code sandbox needs a POSIX system (Linux or macOS)")
    options = _options()
    chosen = Isolation(sys.executable, False, False)  # the weakest: nothing to set up
    for option in options:
        try:
            if _execute(_PROBE, Limits(timeout=20), option).passed:
                chosen = option
                break
        except OSError:  # a tool or interpreter that cannot start here
            continue
    if chosen.missing():
        warnings.warn(
            f"the code sandbox has no {'; no '.join(g.removeprefix('no ') for g in chosen.missing())} "
            f"on this machine; walls: {chosen.describe()}",
            RuntimeWarning,
            stacklevel=2,
        )
    return chosen


def _options() -> list[Isolation]:
    """Every combination of walls worth probing, strongest first, then our own interpreter."""
    have_unshare = sys.platform.startswith("linux") and shutil.which("unshare") is not None
    root = os.geteuid() == 0
    cgroup = _cgroup.parent() is not None
    options = []
    for python in _candidates():
        for ns, mounts in [(True, True), (True, False), (False, False)] if have_unshare else [(False, False)]:
            for own_uid in [True, False] if root else [False]:
                fallback = "watched by PID 1" if mounts else "per process"
                for memory in ["cgroup", fallback] if cgroup else [fallback]:
                    options.append(Isolation(python, ns, own_uid, mounts, memory))
    options.sort(key=lambda o: (not o.mounts, not o.own_uid, not o.namespaces, o.memory != "cgroup"))
    return options


# ---------------------------------------------------------------------------- public API
def run_check(check: Check, limits: Limits = Limits()) -> ExecResult:
    """Run one check: the program in the sandbox, its test in the trusted checker."""
    return _execute(check, limits, isolation())


def run_checks(
    checks: Sequence[Check],
    limits: Limits = Limits(),
    workers: int | None = None,
    on_done: Callable[[int, ExecResult], None] | None = None,
) -> list[ExecResult]:
    """Run many checks in parallel (default: one per available core); results in order."""
    iso = isolation()
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def one(i: int) -> ExecResult:
        result = _execute(checks[i], limits, iso)
        if on_done is not None:
            on_done(i, result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, i) for i in range(len(checks))]
        return [future.result() for future in futures]
