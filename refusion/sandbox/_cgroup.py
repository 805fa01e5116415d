"""One memory limit for all of a check's processes together: a cgroup of its own, made
under ours where this machine lets us (cgroup v2 with the memory controller enabled for
our children, or the v1 memory hierarchy). The sandboxed process joins it before it
starts anything (`_walls.join_cgroup`); the group is removed when the check is over.

Where no cgroup can be made, the sandbox's PID 1 holds the same limit by watching its
processes (`_walls.split`); `checks.isolation()` says which one this machine has.
"""

from __future__ import annotations

import itertools
import os
import time
from functools import lru_cache

_LIMIT = {2: "memory.max", 1: "memory.limit_in_bytes"}
_NO_SWAP = {2: ("memory.swap.max", "0"), 1: ("memory.memsw.limit_in_bytes", None)}
_EVENTS = {2: "memory.events", 1: "memory.oom_control"}
_names = itertools.count()


def hierarchies(cgroups: str, mountinfo: str) -> list[tuple[int, str]]:
    """(version, folder of our own group) for each cgroup hierarchy with memory control,
    from /proc/self/cgroup and /proc/self/mountinfo."""
    ours = {}
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        ours[controllers] = path
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        point, fstype, options = fields[4], fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2" and "" in ours:
            found.append((2, point + ours[""]))
        elif fstype == "cgroup" and "memory" in options:
            memory = next((p for c, p in ours.items() if "memory" in c.split(",")), None)
            if memory is not None:
                found.append((1, point + memory))
    return found


@lru_cache(maxsize=1)
def parent() -> tuple[int, str] | None:
    """(version, folder) under which this process may make a group with a memory limit."""
    try:
        with open("/proc/self/cgroup") as f, open("/proc/self/mountinfo") as g:
            found = hierarchies(f.read(), g.read())
    except (OSError, ValueError):
        return None
    for version, folder in found:
        probe = os.path.join(folder, f"refusion-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        usable = os.path.exists(os.path.join(probe, _LIMIT[version]))
        remove(probe)
        if usable:
            return version, folder
    return None


def make(limit_bytes: int) -> str:
    """A new group under `parent()` whose processes together get `limit_bytes` of memory
    (no swap on top)."""
    found = parent()
    assert found is not None  # isolation() chose the cgroup wall because parent() found one
    version, folder = found
    group = os.path.join(folder, f"refusion-sandbox-{os.getpid()}-{next(_names)}")
    os.mkdir(group)
    try:
        _write(group, _LIMIT[version], str(limit_bytes))
        name, value = _NO_SWAP[version]
        if os.path.exists(os.path.join(group, name)):
            _write(group, name, value or str(limit_bytes))
    except OSError:
        remove(group)
        raise
    return group


def oom_killed(group: str) -> bool:
    """Whether the kernel killed a process of the group for going over its limit."""
    version = 2 if os.path.exists(os.path.join(group, "memory.max")) else 1
    try:
        with open(os.path.join(group, _EVENTS[version])) as f:
            counts = dict(line.split() for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return False
    return int(counts.get("oom_kill", 0)) > 0


def remove(group: str) -> None:
    """Remove an empty group (its last processes may still be exiting: retry a while)."""
    for _ in range(100):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _write(group: str, name: str, value: str) -> None:
    with open(os.path.join(group, name), "w") as f:
        f.write(value)
