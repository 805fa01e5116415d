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
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import _cgroup
from .errors import SandboxError

_HERE = Path(__file__).parent
_HARNESS, _CHECKER, _WIRE = _HERE / "_harness.py", _HERE / "_checker.py", _HERE / "wire.py"
_WALLS = _HERE / "_walls.py"
_TAIL = 2000  # characters of stdout/stderr kept in a result


@dataclass(frozen=True)
class Limits:
    """What one check may use."""

    timeout: float = 10.0  # wall-clock seconds for the whole check, interpreters' start included
    memory_mb: int = 1024  # memory of the program's processes together, and address space of
    # each (the checker gets twice as much)
    max_processes: int = 16  # processes + threads of its uid (RLIMIT_NPROC)
    max_output_mb: int = 16  # largest file it may write, its stdout/stderr included


@dataclass(frozen=True)
class Check:
    """One program and the trusted test that judges it.

    `program` (the candidate's code, with whatever it needs to define its functions) runs
    in the sandbox. `test` runs in the checker after `setup` (trusted code too: imports,
    helpers the test uses); each name in `calls` is there a proxy of the program's
    function of that name. `hidden`: files or folders the program must not read even
    where the sandbox shows the installed packages (a benchmark's data, which holds its
    reference solutions)."""

    program: str
    test: str
    calls: tuple[str, ...]
    setup: str = ""
    hidden: tuple[str, ...] = ()


@dataclass
class ExecResult:
    """How one check ended. `status` is passed, failed or timeout; `reason` starts with
    what failed: timeout, memory, exit, signal, load, not plain data, assertion, error."""

    status: str
    returncode: int | None  # the program's process
    duration: float
    stdout: str = ""
    stderr: str = ""
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class Isolation:
    """The walls this machine allows; see the module docstring."""

    python: str  # interpreter that runs the programs
    namespaces: bool  # private network, PID and IPC namespaces
    own_uid: bool  # each worker slot runs as its own unprivileged uid
    # a private mount namespace with a root of its own, PID 1 that outlives nothing, a user
    # namespace and session keyring of the program's own
    mounts: bool = False
    memory: str = "per process"  # "cgroup", "watched by PID 1" or "per process"

    def describe(self) -> str:
        shared = "per process" if self.memory == "per process" else f"all processes together, {self.memory}"
        walls = [f"memory limit: {shared}", "no new privileges", "rlimits", "process group", "guards"]
        walls.append("trusted checker")
        if self.namespaces:
            walls.insert(0, "net+pid+ipc namespaces")
        if self.mounts:
            walls.insert(
                0,
                "own root (interpreter and packages read-only, fresh /proc and tmpfs), "
                "own user namespace and keyring",
            )
        if self.own_uid:
            walls.insert(0, "own uid")
        return ", ".join(walls)

    def missing(self) -> list[str]:
        """The walls this machine does not allow, each with what it costs."""
        gaps = []
        if not self.namespaces:
            gaps.append("no PID/network/IPC namespaces (processes and System V IPC may outlive a check)")
        if not self.mounts:
            gaps.append("no private root (programs see the machine's files, /tmp and /proc)")
        if self.memory == "per process":
            gaps.append("no cgroup or PID namespace (the memory limit is per process)")
        return gaps


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
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # one thread per numeric library: thread pools would hit RLIMIT_NPROC
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _prefix(iso: Isolation) -> list[str]:
    """The namespaces to start the program in (the harness drops to its uid itself,
    after building its mounts)."""
    if not iso.namespaces:
        return []
    argv = ["unshare", "--net", "--pid", "--ipc", "--fork", "--kill-child"]
    if iso.mounts:
        argv += ["--mount", "--mount-proc"]
    if os.geteuid() != 0:
        argv.append("--map-root-user")
    return argv + ["--"]


def _folder(files: dict[str, str | Path], uid: int | None) -> Path:
    """A fresh 0700 folder with the given files (name -> text or a file to copy)."""
    folder = Path(tempfile.mkdtemp(prefix="refusion-sandbox-"))
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copyfile(content, folder / name)
        else:
            (folder / name).write_text(content, encoding="utf-8")
    if uid is not None:
        os.chown(folder, uid, uid)
    os.chmod(folder, 0o700)
    return folder


def _execute(check: Check, limits: Limits, iso: Isolation) -> ExecResult:
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
        result = _execute_in(program, checker, limits, iso, uid, walls)
        if group and not result.passed and _cgroup.oom_killed(group):
            result.reason = f"memory: the program's processes used more than {limits.memory_mb} MB together"
        return result
    finally:
        if uid is not None:
            if not iso.namespaces:  # in a PID namespace nothing outlives its PID 1
                _kill_uid(uid)
            _uids.release(uid)
        if group:
            _cgroup.remove(group)
        shutil.rmtree(program, ignore_errors=True)
        shutil.rmtree(checker, ignore_errors=True)


def _start_program(
    folder: Path,
    fds: tuple[int, int],
    limits: Limits,
    iso: Isolation,
    uid: int | None,
    walls: dict,
    out,
    err,
) -> subprocess.Popen:
    """The program's process; `walls`: this check's cgroup and hidden paths."""
    settings = walls | {
        "memory_bytes": limits.memory_mb << 20,
        "watch_memory": iso.memory == "watched by PID 1",
        "cpu_seconds": int(limits.timeout) + 1,
        "file_bytes": limits.max_output_mb << 20,
        "max_processes": limits.max_processes,
        "uid": uid or 0,
        "mounts": iso.mounts,
        "block_network": not iso.namespaces,
        "site_packages": _site_packages(),
        "calls_fd": fds[0],
        "replies_fd": fds[1],
    }
    env = _ENV | {
        "HOME": str(folder),
        "TMPDIR": str(folder),
        "REFUSION_SANDBOX_SETTINGS": json.dumps(settings),
    }
    argv = _prefix(iso) + [iso.python, "-I", "-S", "-B", str(folder / "harness.py")]
    return subprocess.Popen(
        argv,
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        pass_fds=fds,
        start_new_session=True,
    )


def _start_checker(
    folder: Path, fds: tuple[int, int, int], limits: Limits, iso: Isolation
) -> subprocess.Popen:
    settings = {
        "memory_bytes": 2 * (limits.memory_mb << 20),
        "site_packages": _site_packages(),
        "calls_fd": fds[0],
        "replies_fd": fds[1],
        "verdict_fd": fds[2],
    }
    env = _ENV | {
        "HOME": str(folder),
        "TMPDIR": str(folder),
        "REFUSION_CHECKER_SETTINGS": json.dumps(settings),
    }
    return subprocess.Popen(
        [iso.python, "-I", "-S", "-B", str(folder / "checker.py")],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=fds,
        start_new_session=True,
    )


def _execute_in(
    folder: Path,
    checker_folder: Path,
    limits: Limits,
    iso: Isolation,
    uid: int | None,
    walls: dict,
) -> ExecResult:
    calls_r, calls_w = os.pipe()  # checker -> program
    replies_r, replies_w = os.pipe()  # program -> checker
    verdict_r, verdict_w = os.pipe()  # checker -> us
    start = time.perf_counter()
    timed_out = False
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        try:
            program = _start_program(folder, (calls_r, replies_w), limits, iso, uid, walls, out, err)
        finally:
            os.close(calls_r)
            os.close(replies_w)
        try:
            checker = _start_checker(checker_folder, (calls_w, replies_r, verdict_w), limits, iso)
        finally:
            for fd in (calls_w, replies_r, verdict_w):
                os.close(fd)
        try:
            checker.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(checker.pid)
            checker.wait()
            try:  # a program that ended by itself has its status; one still serving is done
                program.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            ended_by_itself = program.returncode
            _kill_group(program.pid)
            program.wait()
    duration = time.perf_counter() - start
    verdict = _read_verdict(verdict_r)
    stdout, stderr = _tail(folder / "stdout"), _tail(folder / "stderr")
    if timed_out:
        return ExecResult(
            "timeout",
            ended_by_itself,
            duration,
            stdout,
            stderr,
            f"timeout: still running after {limits.timeout:g}s",
        )
    if verdict is None:
        checker_err = (checker.stderr.read() or b"").decode("utf-8", "replace") if checker.stderr else ""
        return ExecResult(
            "failed",
            ended_by_itself,
            duration,
            stdout,
            stderr,
            f"error: the checker gave no verdict ({_last_line(checker_err) or f'exit {checker.returncode}'})",
        )
    if verdict["passed"]:
        return ExecResult("passed", ended_by_itself, duration, stdout, stderr, "")
    reason = verdict["reason"]
    if reason.startswith("exit"):
        reason = _how_it_ended(ended_by_itself, stderr) or reason
    return ExecResult("failed", ended_by_itself, duration, stdout, stderr, reason)


def _read_verdict(fd: int) -> dict | None:
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(1 << 16)
        verdict = json.loads(data)
        return verdict if isinstance(verdict, dict) and isinstance(verdict.get("passed"), bool) else None
    except (OSError, ValueError):
        return None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else ""


@lru_cache(maxsize=1)
def _site_packages() -> list[str]:
    """Our site-packages, put on the child's sys.path directly: `-S` skips the site module,
    whose .pth processing would triple every program's start-up time."""
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _how_it_ended(rc: int | None, stderr: str) -> str | None:
    """Why the program's process ended before the test finished, from its status."""
    if rc is None:
        return None
    if rc < 0 or rc > 128:  # a signal, or unshare's shell-style status for a signalled child
        num = -rc if rc < 0 else rc - 128
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = f"signal {num}"
        if name == "SIGXCPU":
            return "timeout: the program used up its CPU seconds (SIGXCPU)"
        return f"signal: the program was killed by {name}"
    if "MemoryError" in stderr:
        return "memory: the program ran out of memory (MemoryError)"
    last = _last_line(stderr)
    return f"exit: the program exited with code {rc} before the test finished" + (
        f" ({last})" if last else ""
    )


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * _TAIL))
            return f.read().decode("utf-8", "replace")[-_TAIL:]
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by uid until none is left (a fork bomb keeps forking)."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid and not _is_zombie(entry.name):
                        os.kill(int(entry.name), signal.SIGKILL)
                        found = True
                except (FileNotFoundError, ProcessLookupError):
                    pass
        if not found:
            return
        time.sleep(0.01)


def _is_zombie(pid: str) -> bool:
    """A killed process lingers as a zombie until reaped; it runs nothing, so it may stay."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


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
