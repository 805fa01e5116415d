"""The sandbox's plain records: a `Check` and the `Limits` it runs under, the walls a
machine allows (`Isolation`), and how a check ended (`ExecResult`)."""

from __future__ import annotations

from dataclasses import dataclass


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
    """The walls this machine allows; `checks` describes each."""

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
