"""`refusion bench served`: a real server at one client and the engine with fixed widths on
the same prompts, side by side."""

from __future__ import annotations

import re

from refusion.cli.dispatch import main


def test_bench_served_prints_both_sides_and_a_lone_client_takes_the_fixed_forwards(capfd):
    assert main(["bench", "served", "--prompts", "2", "--rounds", "1", "--max-tokens", "32"]) == 0
    out = capfd.readouterr().out
    assert "draft widths adaptive" in out
    served = re.search(r"\| server, one client \| (\d+) \| (\d+) \|", out)
    fixed = re.search(r"\| engine, fixed widths \| (\d+) \| (\d+) \|", out)
    assert served and fixed and int(fixed.group(1)) > 0
    assert served.groups() == fixed.groups()  # same forwards, same tokens
    assert "requests with the same forwards on both sides: 2 of 2" in out
