"""The script the sandbox runs in each child process (copied into the child's temp dir).

It is ordinary Python, but it never runs inside the evaluator: `sandbox.py` writes this
file next to `program.py` and starts a fresh interpreter on it. In order it: reads its
settings from the environment (and removes them), lowers its own resource limits, installs
best-effort guards against writes outside its directory, process creation and (where the
OS gave us no private network namespace) sockets, then executes `program.py`. Only when
the program ran to its end does it write the nonce to the result pipe: a program that
calls sys.exit, os._exit, crashes or is killed before its tests finished cannot pass.

The guards are a seatbelt against generated code doing something silly; the real walls
are the separate user id, the namespaces and the rlimits that `sandbox.py` arranges.
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
    if not limits["own_uid"]:
        # shared uid: the limit counts every process of this user, so leave room for them
        uid = os.getuid()
        nproc += sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
    cap(resource.RLIMIT_NPROC, nproc)


def _owner(pid):
    try:
        return os.stat("/proc/" + pid).st_uid
    except OSError:
        return None


def _install_guards(root, block_network):
    import shutil
    import subprocess

    realpath = os.path.realpath

    def inside(path):
        if isinstance(path, int):
            return True
        p = realpath(os.fspath(path))
        return p == root or p.startswith(root + os.sep)

    def deny(module, name, what):
        if not hasattr(module, name):
            return

        def denied(*args, **kwargs):
            raise PermissionError(f"sandbox: {what} is disabled ({name})")

        setattr(module, name, denied)

    def confine(module, name, n_paths=1):
        original = getattr(module, name, None)
        if original is None:
            return

        def confined(*args, **kwargs):
            for path in args[:n_paths]:
                if not inside(path):
                    raise PermissionError(f"sandbox: {name} outside the sandbox directory: {path!r}")
            return original(*args, **kwargs)

        setattr(module, name, confined)

    import posix

    spawners = ["system", "popen", "fork", "forkpty", "vfork", "posix_spawn", "posix_spawnp",
                "kill", "killpg", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid"]
    spawners += [n for n in dir(os) if n.startswith(("exec", "spawn"))]
    for module in (os, posix):
        for name in spawners:
            deny(module, name, "starting or signalling processes")
        for name in ("remove", "unlink", "rmdir", "removedirs", "truncate", "chmod", "chown",
                     "lchown", "mkdir", "makedirs", "mkfifo", "mknod", "utime"):
            confine(module, name)
        for name in ("rename", "renames", "replace", "link", "symlink"):
            confine(module, name, n_paths=2)
    for name in ("rmtree", "chown"):
        confine(shutil, name)
    for name in ("move", "copy", "copy2", "copyfile", "copytree", "copymode", "copystat"):
        confine(shutil, name, n_paths=2)
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        deny(subprocess, name, "starting processes")

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

    if block_network:
        import _socket
        import socket

        class NoSocket(_socket.socket):
            def __init__(self, *args, **kwargs):
                raise PermissionError("sandbox: network access is disabled")

        socket.socket = _socket.socket = NoSocket
        for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
            deny(socket, name, "network access")


def _main():
    env = os.environ
    nonce = env.pop("REFUSION_SANDBOX_NONCE").encode()
    result_fd = int(env.pop("REFUSION_SANDBOX_FD"))
    settings = json.loads(env.pop("REFUSION_SANDBOX_SETTINGS"))
    write, exit_now = os.write, os._exit
    root = os.path.realpath(os.getcwd())
    with open("program.py", encoding="utf-8") as f:
        source = f.read()

    def finish(code):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        exit_now(code)

    try:
        code = compile(source, "program.py", "exec")
    except BaseException:
        traceback.print_exc()
        finish(2)
    sys.path.extend(settings["site_packages"])
    _set_limits(settings)
    _install_guards(root, settings["block_network"])
    del settings, env, source
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        print(f"sandbox: SystemExit({e.code!r}) before the program finished", file=sys.stderr)
        finish(3)
    except BaseException:
        traceback.print_exc()
        finish(1)
    write(result_fd, nonce)
    finish(0)


if __name__ == "__main__":
    _main()
