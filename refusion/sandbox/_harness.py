"""The candidate's side of a check, run in the sandbox (copied into its folder with
`wire.py` and `_walls.py`; it never runs inside the evaluator).

In order it: reads its settings and the program; builds its walls (`_walls.py`: the
check's cgroup, a root of its own, PID 1 left behind to end every process of the check
with it, then its own uid and user namespace, no new privileges, no capabilities); lowers
its resource limits; installs best-effort guards; runs the program's definitions; then
answers calls. Each call comes
from the trusted checker as one line (a function name and plain-data arguments) and is
answered with one line: the plain-data result (an object of the program's own
making stays here, and the checker gets a reference it can only pass back), or the
exception raised. The verdict is the checker's alone: nothing this process writes is more than an
answer to a call.

The guards are a seatbelt against generated code doing something silly; the walls are
the namespaces, the user id, the cgroup and the rlimits.
"""

import builtins
import io
import json
import os
import resource
import sys
import traceback


def _set_limits(limits):
    def cap(kind, value):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass

    cap(resource.RLIMIT_AS, limits["memory_bytes"])
    cap(resource.RLIMIT_CPU, limits["cpu_seconds"])
    cap(resource.RLIMIT_FSIZE, limits["file_bytes"])
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, 256)
    nproc = limits["max_processes"]
    if not limits["uid"]:
        # shared uid: the limit counts every process of this user, so leave room for them
        uid = os.getuid()
        nproc += sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
    cap(resource.RLIMIT_NPROC, nproc)


def _owner(pid):
    try:
        return os.stat("/proc/" + pid).st_uid
    except OSError:
        return None


def _enter_workdir(uid):
    """A fresh folder in the private /tmp, owned by the program's uid."""
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    if uid:
        os.chown(work, uid, uid)
    os.chdir(work)
    return work


# ------------------------------------------------------------------ guards
_SPAWNERS = (
    "system",
    "popen",
    "fork",
    "forkpty",
    "vfork",
    "posix_spawn",
    "posix_spawnp",
    "kill",
    "killpg",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
)  # and every os.exec* and os.spawn*
_CHANGE_A_PATH = (
    "remove",
    "unlink",
    "rmdir",
    "removedirs",
    "truncate",
    "chmod",
    "chown",
    "lchown",
    "mkdir",
    "makedirs",
    "mkfifo",
    "mknod",
    "utime",
)
_CHANGE_TWO_PATHS = ("rename", "renames", "replace", "link", "symlink")


def _install_guards(root, block_network):
    """The guards, in order: os and posix start and signal no process and change no file
    outside `root`; shutil's file operations are confined the same way; subprocess starts
    nothing; open writes only inside `root`; without a network namespace, no sockets."""
    import posix
    import shutil
    import subprocess

    inside = _inside_of(root)
    spawners = list(_SPAWNERS) + [n for n in dir(os) if n.startswith(("exec", "spawn"))]
    for module in (os, posix):
        _guard_os_module(module, spawners, inside)
    _confine_shutil(shutil, inside)
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        _deny(subprocess, name, "starting processes")
    _guard_open(posix, inside)
    if block_network:
        _block_network()


def _inside_of(root):
    """A test of whether a path is `root` or under it (a file descriptor passes), with the
    realpath of now: the program cannot swap it for its own."""
    realpath = os.path.realpath

    def inside(path):
        if isinstance(path, int):
            return True
        p = realpath(os.fspath(path))
        return p == root or p.startswith(root + os.sep)

    return inside


def _deny(module, name, what):
    """module.name, where it exists, raises PermissionError."""
    if not hasattr(module, name):
        return

    def denied(*args, **kwargs):
        raise PermissionError(f"sandbox: {what} is disabled ({name})")

    setattr(module, name, denied)


def _confine(module, name, inside, n_paths=1):
    """module.name, where it exists, refuses a path outside the sandbox's folder among its
    first `n_paths` arguments."""
    original = getattr(module, name, None)
    if original is None:
        return

    def confined(*args, **kwargs):
        for path in args[:n_paths]:
            if not inside(path):
                raise PermissionError(f"sandbox: {name} outside the sandbox directory: {path!r}")
        return original(*args, **kwargs)

    setattr(module, name, confined)


def _guard_os_module(module, spawners, inside):
    """os or posix: no process started or signalled, no uid changed, no file changed
    outside the folder."""
    for name in spawners:
        _deny(module, name, "starting or signalling processes")
    for name in _CHANGE_A_PATH:
        _confine(module, name, inside)
    for name in _CHANGE_TWO_PATHS:
        _confine(module, name, inside, n_paths=2)


def _confine_shutil(shutil, inside):
    for name in ("rmtree", "chown"):
        _confine(shutil, name, inside)
    for name in ("move", "copy", "copy2", "copyfile", "copytree", "copymode", "copystat"):
        _confine(shutil, name, inside, n_paths=2)


def _guard_open(posix, inside):
    """open, io.open, os.open and posix.open write only inside the folder (reads pass)."""
    real_open = builtins.open
    real_os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"sandbox: writing outside the sandbox directory: {file!r}")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & write_flags and not inside(path):
            raise PermissionError(f"sandbox: writing outside the sandbox directory: {path!r}")
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open


def _block_network():
    """No socket can be made (where no network namespace keeps the program offline)."""
    import _socket
    import socket

    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("sandbox: network access is disabled")

    # replacing the class is the guard: a socket made from it raises
    socket.socket = _socket.socket = NoSocket  # type: ignore[misc, assignment]
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        _deny(socket, name, "network access")


# ------------------------------------------------------------------ serving calls
class _Objects:
    """What the checker may name: the program's top-level names, and the objects of its
    own making that calls returned (kept here; the checker holds only references)."""

    def __init__(self, namespace):
        self.namespace, self.kept = namespace, []

    def resolve(self, key):
        if type(key) is list and len(key) >= 2 and key[0] == "n" and key[1] in self.namespace:
            return self.namespace[key[1]]
        if (
            type(key) is list
            and len(key) >= 2
            and key[0] == "h"
            and type(key[1]) is int
            and 0 <= key[1] < len(self.kept)
        ):
            return self.kept[key[1]]
        raise NameError(f"the program defines no {key[1] if type(key) is list and len(key) > 1 else key!r}")

    def ref(self, value):
        """A reference to `value`, marked "iter" when it is an iterator (a generator, a
        `map`): the checker may then draw its items one by one (`_next_item`)."""
        self.kept.append(value)
        key = ["h", len(self.kept) - 1, type(value).__name__]
        if hasattr(type(value), "__next__") and hasattr(type(value), "__iter__"):
            key.append("iter")
        return key


def _reply(wire, objects, result):
    try:
        return {"ok": wire.to_json(result, ref=objects.ref)}
    except wire.NotPlainData as e:
        return {"notplain": str(e)}
    except RecursionError:
        return {"notplain": "nested too deep"}


def _next_item(wire, objects, key):
    """The reply to a request for an iterator's next item: the item, "stop" at its end,
    or the exception it raised."""
    try:
        iterator = objects.resolve(key)
    except (TypeError, NameError) as e:
        return {"raise": [type(e).__name__, str(e)]}
    try:
        item = next(iterator)
    except StopIteration:
        return {"stop": True}
    except Exception as e:  # the program's own error, as a call's
        return {"raise": [type(e).__name__, str(e)[:1000]]}
    return _reply(wire, objects, item)


def _answer(wire, objects, message):
    """The reply to one message: a call, or a request for an iterator's next item."""
    if "next" in message:
        return _next_item(wire, objects, message["next"])
    try:
        fn = objects.resolve(message["call"])
        args = wire.from_json(message["args"], resolve=objects.resolve)
        kwargs = wire.from_json(message["kwargs"], resolve=objects.resolve)
    except (KeyError, TypeError, NameError, wire.NotPlainData) as e:
        return {"raise": [type(e).__name__, str(e)]}
    if not callable(fn):
        return {"raise": ["TypeError", f"{type(fn).__name__} is not callable"]}
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # the program's own error: the checker decides what it means
        return {"raise": [type(e).__name__, str(e)[:1000]]}
    return _reply(wire, objects, result)


def _serve(wire, namespace, calls, replies):
    objects = _Objects(namespace)
    while True:
        line = wire.read_line(calls)
        if not line:
            return
        replies.write(wire.dumps(_answer(wire, objects, wire.loads(line))))
        replies.flush()


def _exit(code):
    """Flush what the program printed (kept for the record), then end at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _main():
    settings = json.loads(os.environ.pop("REFUSION_SANDBOX_SETTINGS"))
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import walls  # noqa: E402 - the isolation steps copied beside this file
    import wire  # noqa: E402 - the plain-data codec copied beside this file

    sys.path.remove(here)
    with open(os.path.join(here, "program.py"), encoding="utf-8") as f:
        source = f.read()
    calls = os.fdopen(settings["calls_fd"], "rb")
    replies = os.fdopen(settings["replies_fd"], "wb")
    uid = settings["uid"]
    root = os.path.realpath(os.getcwd())
    try:
        if settings["cgroup"]:
            walls.join_cgroup(settings["cgroup"])
        if settings["mounts"]:
            walls.enter_view(settings)
            root = _enter_workdir(uid)
            walls.split(settings["memory_bytes"], settings["watch_memory"])
        walls.become_program(uid, settings["mounts"])
    except OSError as e:
        print(f"sandbox: cannot set up the isolation: {e}", file=sys.stderr)
        _exit(97)
    try:
        code = compile(source, "program.py", "exec")
    except BaseException as e:
        replies.write(wire.dumps({"load_error": f"{type(e).__name__}: {e}"}))
        replies.flush()
        _exit(2)
    sys.path.extend(settings["site_packages"])
    _set_limits(settings)
    _install_guards(root, settings["block_network"])
    del settings, source
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except BaseException as e:
        traceback.print_exc()
        replies.write(wire.dumps({"load_error": f"{type(e).__name__}: {str(e)[:500]}"}))
        replies.flush()
        _exit(1)
    replies.write(wire.dumps({"ready": True}))
    replies.flush()
    _serve(wire, namespace, calls, replies)
    _exit(0)


if __name__ == "__main__":
    _main()
