"""The two processes of one check: the program, started inside its walls, and the
trusted checker, joined by pipes; waited for, ended, and how they ended read as an
`ExecResult` (see `checks` for the walls)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from .records import ExecResult, Isolation, Limits

_TAIL = 2000  # characters of stdout/stderr kept in a result
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


def run_pair(
    folder: Path,
    checker_folder: Path,
    limits: Limits,
    iso: Isolation,
    uid: int | None,
    walls: dict,
) -> ExecResult:
    """Run the program (in `folder`) and the checker (in `checker_folder`) joined by pipes
    until the checker's verdict or the timeout, end both, and say how the check ended."""
    calls_r, calls_w = os.pipe()  # checker -> program
    replies_r, replies_w = os.pipe()  # program -> checker
    verdict_r, verdict_w = os.pipe()  # checker -> us
    start = time.perf_counter()
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
        timed_out, ended_by_itself = _wait_and_end(program, checker, limits.timeout)
    duration = time.perf_counter() - start
    verdict = _read_verdict(verdict_r)
    return _result(folder, checker, verdict, timed_out, ended_by_itself, duration, limits)


def _wait_and_end(
    program: subprocess.Popen, checker: subprocess.Popen, timeout: float
) -> tuple[bool, int | None]:
    """Wait for the checker at most `timeout` seconds, then kill both process groups:
    (whether it timed out, the program's status if it had ended by itself)."""
    timed_out = False
    try:
        checker.wait(timeout=timeout)
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
    return timed_out, ended_by_itself


def _result(
    folder: Path,
    checker: subprocess.Popen,
    verdict: dict | None,
    timed_out: bool,
    ended_by_itself: int | None,
    duration: float,
    limits: Limits,
) -> ExecResult:
    """The check's result: the checker's verdict, unless the check timed out or the
    checker gave none; a program's exit is told by how its process ended."""
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


def kill_uid(uid: int) -> None:
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
