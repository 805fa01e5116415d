"""`refusion --help` and `refusion VERB --help` answer without importing torch (or
transformers): only the verb being run builds its flags, and they come from torch-free
config dataclasses."""

import subprocess
import sys

import pytest

from refusion.cli.commands.bench import BENCHES
from refusion.cli.dispatch import VERBS

PROBE = """
import contextlib, io, sys
from refusion.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(len(out.getvalue()), ",".join(heavy) or "-")
"""


@pytest.mark.parametrize("argv", [["--help"], *[[verb, "--help"] for verb in VERBS]])
def test_help_imports_no_torch(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    chars, heavy = done.stdout.split()
    assert int(chars) > 100  # a real help text was printed
    assert heavy == "-", f"{' '.join(argv)} imported {heavy}"


def test_the_bench_verb_names_every_benchmark():
    """`refusion --help` lists what `refusion bench` runs, in the order it registers them."""
    named = VERBS["bench"].split(": ", 1)[1].split(", ")
    assert named == list(BENCHES)
