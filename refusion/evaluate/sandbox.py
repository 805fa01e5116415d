"""Run untrusted generated programs (HumanEval, MBPP) and tell whether they ran to the end.

Each program gets its own fresh interpreter in its own temporary directory, started by
`_harness.py`. The walls, strongest first, where the OS allows them:

- a private network and PID namespace (`unshare --net --pid --fork --kill-child`): no
  network at all, and every process the program starts dies with it;
- a user id of its own (when we are root: `setpriv` to an unused uid per worker slot), so
  file permissions keep it out of everything it does not own, RLIMIT_NPROC bounds a fork
  bomb, and afterwards every process of that uid is killed;
- resource limits: address space (memory), CPU seconds, file size, no core dumps;
- a new session, killed as a process group at the wall-clock timeout;
- in-process guards (`_harness.py`): no process creation, no writes outside its
  directory, no sockets when there is no network namespace.

Which walls are up is probed once per process (`isolation()`) and written into results.
Programs run in parallel across cores: a thread pool where each thread waits on its child.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_HARNESS = Path(__file__).with_name("_harness.py")
_TAIL = 2000  # characters of stdout/stderr kept in a result


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    timeout: float = 10.0  # wall-clock seconds, start of the interpreter included
    memory_mb: int = 1024  # address space
    max_processes: int = 16  # processes + threads of its uid (RLIMIT_NPROC)
    max_output_mb: int = 16  # largest file it may write, its stdout/stderr included


@dataclass
class ExecResult:
    """How one program ended. `status` is passed, failed or timeout."""

    status: str
    returncode: int | None
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
    namespaces: bool  # private network + PID namespaces
    own_uid: bool  # each worker slot runs as its own unprivileged uid

    def describe(self) -> str:
        walls = ["rlimits", "process group", "guards"]
        if self.namespaces:
            walls.insert(0, "net+pid namespaces")
        if self.own_uid:
            walls.insert(0, "own uid")
        return ", ".join(walls)


class _UidPool:
    """Unused uids, one per concurrently running program, distinct across our processes."""

    def __init__(self, size: int = 64) -> None:
        base = 200_000 + (os.getpid() % 50_000) * size
        self._free = list(range(base, base + size))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            return self._free.pop()

    def release(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


_uids = _UidPool()


def _prefix(iso: Isolation, uid: int | None) -> list[str]:
    argv: list[str] = []
    if iso.namespaces:
        argv += ["unshare", "--net", "--pid", "--fork", "--kill-child"]
        if os.geteuid() != 0:
            argv.append("--map-root-user")
        argv.append("--")
    if uid is not None:
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return argv


def _execute(source: str, limits: Limits, iso: Isolation) -> ExecResult:
    uid = _uids.acquire() if iso.own_uid else None
    workdir = tempfile.mkdtemp(prefix="refusion-sandbox-")
    try:
        return _execute_in(workdir, source, limits, iso, uid)
    finally:
        if uid is not None:
            _kill_uid(uid)
            _uids.release(uid)
        shutil.rmtree(workdir, ignore_errors=True)


def _execute_in(workdir: str, source: str, limits: Limits, iso: Isolation, uid: int | None) -> ExecResult:
    work = Path(workdir)
    (work / "program.py").write_text(source, encoding="utf-8")
    shutil.copyfile(_HARNESS, work / "harness.py")
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
    nonce = secrets.token_hex(16)
    settings = {
        "memory_bytes": limits.memory_mb << 20,
        "cpu_seconds": int(limits.timeout) + 1,
        "file_bytes": limits.max_output_mb << 20,
        "max_processes": limits.max_processes,
        "own_uid": uid is not None,
        "block_network": not iso.namespaces,
        "site_packages": _site_packages(),
    }
    read_end, write_end = os.pipe()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        # one thread per numeric library: thread pools would hit RLIMIT_NPROC
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "REFUSION_SANDBOX_NONCE": nonce,
        "REFUSION_SANDBOX_FD": str(write_end),
        "REFUSION_SANDBOX_SETTINGS": json.dumps(settings),
    }
    argv = _prefix(iso, uid) + [iso.python, "-I", "-S", "-B", "harness.py"]
    start = time.perf_counter()
    timed_out = False
    with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, pass_fds=(write_end,), start_new_session=True)
        finally:
            os.close(write_end)
        try:
            proc.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
    duration = time.perf_counter() - start
    os.set_blocking(read_end, False)
    try:
        marker = os.read(read_end, 64)
    except BlockingIOError:
        marker = b""
    finally:
        os.close(read_end)
    stdout, stderr = _tail(work / "stdout"), _tail(work / "stderr")
    rc = proc.returncode
    if timed_out:
        status, reason = "timeout", f"still running after {limits.timeout:g}s"
    elif marker == nonce.encode() and rc == 0:
        status, reason = "passed", ""
    else:
        status, reason = "failed", _failure_reason(rc, stderr)
    return ExecResult(status, rc, duration, stdout, stderr, reason)


@lru_cache(maxsize=1)
def _site_packages() -> list[str]:
    """Our site-packages, put on the child's sys.path directly: `-S` skips the site module,
    whose .pth processing would triple every program's start-up time."""
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _failure_reason(rc: int | None, stderr: str) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc is not None and rc > 128:  # a shell-style status from unshare for a signalled child
        return f"killed by signal {rc - 128}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if lines:
        return lines[-1][-300:]
    return "exited before the program finished" if rc == 0 else f"exit code {rc}"


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
_PROBE = "import fractions, json, collections\nassert sum(range(4)) == 6\n"


def _candidates() -> list[str]:
    names = [sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}",
             "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    seen: list[str] = []
    for name in names:
        if name and os.path.exists(name) and name not in seen:
            seen.append(name)
    return seen


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once which walls work here, strongest first; the weakest always works."""
    if os.name != "posix":
        from .errors import SandboxError

        raise SandboxError("the code sandbox needs a POSIX system (Linux or macOS)")
    root = os.geteuid() == 0
    have_unshare = sys.platform.startswith("linux") and shutil.which("unshare") is not None
    have_setpriv = root and shutil.which("setpriv") is not None
    options = []
    for python in _candidates():
        for ns in ([True, False] if have_unshare else [False]):
            for own_uid in ([True, False] if have_setpriv else [False]):
                options.append(Isolation(python, ns, own_uid))
    # prefer the strongest walls, then our own interpreter
    options.sort(key=lambda o: (not o.own_uid, not o.namespaces))
    for option in options:
        try:
            if _execute(_PROBE, Limits(timeout=20), option).passed:
                return option
        except OSError:  # a tool or interpreter that cannot start here
            continue
    return Isolation(sys.executable, False, False)


# ---------------------------------------------------------------------------- public API
def run_program(source: str, limits: Limits = Limits()) -> ExecResult:
    """Run one program in the sandbox; it passes when it runs to its end without error."""
    return _execute(source, limits, isolation())


def run_programs(
    sources: Sequence[str],
    limits: Limits = Limits(),
    workers: int | None = None,
    on_done: Callable[[int, ExecResult], None] | None = None,
) -> list[ExecResult]:
    """Run many programs in parallel (default: one per available core); results in order."""
    iso = isolation()
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    results: list[ExecResult | None] = [None] * len(sources)

    def one(i: int) -> None:
        results[i] = _execute(sources[i], limits, iso)
        if on_done is not None:
            on_done(i, results[i])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for future in [pool.submit(one, i) for i in range(len(sources))]:
            future.result()
    return results  # type: ignore[return-value]
