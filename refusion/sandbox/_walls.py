"""The walls the sandboxed process builds around itself before a program runs (copied
beside `_harness.py` as walls.py; it runs in the sandbox, never in the evaluator).

The evaluator starts it in new mount, PID, network and IPC namespaces, as root there
(the machine's root, or the root of a user namespace of its own). In order it:

1. joins the check's memory cgroup, where the evaluator made one: a single limit then
   holds for every process the program will start;
2. builds a root of its own (`enter_view`): read-only binds of the system folders, the
   interpreter and the installed packages, the benchmark's data hidden under empty
   files; fresh tmpfs on /tmp, /var/tmp and /dev/shm; the PID namespace's /proc; a few
   devices (/proc/sys read-only). Nothing else is there: not the checkout, not a home folder, not the
   evaluation's outputs;
3. forks (`split`). The parent stays PID 1 of the namespace: it waits for the program's
   process and ends with it, which ends every other process of the check however it
   detached itself; where no cgroup holds the memory limit, it holds it over all the
   check's processes together. The child goes on to run the program, as
4. a process without privileges (`become_program`): its own uid in a user namespace of
   its own (keyrings made there die with it), a fresh session keyring, no new privileges
   (a setuid program runs without raising them), no capabilities.
"""

import ctypes
import os
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MNT_DETACH, CLONE_NEWUSER = 1 << 18, 1 << 21, 2, 0x10000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 4, 38, 24
KEYCTL_JOIN_SESSION_KEYRING = 1
# statvfs flags -> the mount flags a read-only remount must keep (a user namespace may
# not clear the ones its mounts were locked with)
_KEPT_FLAGS = {
    getattr(os, name, 0): flag  # Linux's names; elsewhere there is nothing to remount
    for name, flag in [
        ("ST_NOSUID", MS_NOSUID),
        ("ST_NODEV", MS_NODEV),
        ("ST_NOEXEC", MS_NOEXEC),
        ("ST_NOATIME", MS_NOATIME),
        ("ST_NODIRATIME", MS_NODIRATIME),
        ("ST_RELATIME", MS_RELATIME),
    ]
}
# the calls glibc has no wrapper for, by machine
_SYSCALLS = {
    "x86_64": {"pivot_root": 155, "keyctl": 250},
    "aarch64": {"pivot_root": 41, "keyctl": 219},
}
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
_PROC_READONLY = ("/proc/sys", "/proc/sysrq-trigger")

_libc = ctypes.CDLL(None, use_errno=True)


def _ok(rc, what):
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _c(s):
    return None if s is None else os.fsencode(s)


def _mount(source, target, fstype=None, flags=0, data=None):
    _ok(_libc.mount(_c(source), _c(target), _c(fstype), ctypes.c_ulong(flags), _c(data)), f"mount {target}")


def _syscall(name, *args):
    machine = os.uname().machine
    number = _SYSCALLS.get(machine, {}).get(name)
    if number is None:
        raise OSError(38, f"{name}: no system call number known for {machine}")
    _ok(min(0, _libc.syscall(ctypes.c_long(number), *args)), name)  # some return an id


# ------------------------------------------------------------------ 1. memory cgroup
def join_cgroup(folder):
    """Move this process into the check's cgroup; its children are born there."""
    with open(os.path.join(folder, "cgroup.procs"), "w") as f:
        f.write("0")


# ------------------------------------------------------------------ 2. the view
def enter_view(settings):
    """Make a fresh tmpfs the root of this mount namespace, holding only what a program
    needs, read-only; the old root is detached and gone."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    visible = _visible(settings["site_packages"])  # looked up before /tmp is covered
    hidden = [os.path.realpath(p) for p in settings["hidden"]]
    # the real /tmp stays reachable (an interpreter or venv may live in it, a checkout's
    # .venv in a clone under /tmp) once the new root covers it: bound at /var/tmp, unused
    stash = "/var/tmp" if os.path.isdir("/var/tmp") else None
    if stash:
        _mount("/tmp", stash, None, MS_BIND | MS_REC)
    new = "/tmp"  # exists everywhere; the tmpfs mounted on it becomes the new root
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    size = max(1 << 20, settings["file_bytes"])
    for path in _TMPFS:  # first: what is shown under /tmp is bound on top of its fresh tmpfs
        os.makedirs(new + path, exist_ok=True)
        _mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    for path in visible:
        under_tmp = path == "/tmp" or path.startswith("/tmp/")
        _show(new, path, stash + path[len("/tmp") :] if stash and under_tmp else path)
    for path in hidden:
        _hide(new, path)
    _devices(new)
    os.makedirs(new + "/proc")
    _mount("/proc", new + "/proc", None, MS_BIND | MS_REC)
    for path in filter(lambda p: os.path.exists(new + p), _PROC_READONLY):  # read, never written
        _mount(new + path, new + path, None, MS_BIND)
        _readonly(new + path)
    os.makedirs(new + "/.old")
    _syscall("pivot_root", _c(new), _c(new + "/.old"))
    os.chdir("/")
    _ok(_libc.umount2(_c("/.old"), MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    _readonly("/")


def _visible(site_packages):
    """The folders a program may see: the system's, the running interpreter's, and the
    installed packages (outermost first, so inner ones already shown are skipped)."""
    paths = list(_SYSTEM)
    paths += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    paths += [os.path.dirname(os.path.realpath(sys.executable))] + list(site_packages)
    return sorted({os.path.abspath(p) for p in paths if os.path.lexists(p)}, key=len)


def _show(new, path, source):
    """`path` (found at `source`) at the same place in the new root: a symlink as a
    symlink, a folder as a read-only bind. A path already visible (inside a folder shown
    before) is left."""
    target = new + path
    parts = path.strip("/").split("/")
    if any(os.path.islink(new + "/" + "/".join(parts[:i])) for i in range(1, len(parts))):
        return  # under a symlink: shown where the link points, if at all
    if os.path.lexists(target) and path not in _TMPFS:
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if not os.path.isdir(source):
        return
    os.makedirs(target, exist_ok=True)
    _mount(source, target, None, MS_BIND)
    _readonly(target)


def _hide(new, path):
    """An empty, read-only file or folder over `path` (a real path), where the view shows it."""
    target = new + path
    if not os.path.exists(target):
        return
    if os.path.isdir(target):
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")
    else:
        empty = new + "/.empty"
        if not os.path.exists(empty):
            open(empty, "w").close()
        _mount(empty, target, None, MS_BIND)
        _readonly(target)


def _devices(new):
    os.makedirs(new + "/dev", exist_ok=True)  # /dev/shm may have made it
    for name in _DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        _mount("/dev/" + name, f"{new}/dev/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", new + "/dev/fd")
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", f"{new}/dev/{name}")


def _readonly(target):
    kept = os.statvfs(target).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(ms for st, ms in _KEPT_FLAGS.items() if kept & st and ms not in (MS_NOSUID, MS_NODEV))
    _mount(None, target, None, flags)


# ------------------------------------------------------------------ 3. PID 1
def split(memory_bytes, watch_memory):
    """Fork; in the child return. The parent never returns: it is the namespace's init
    until the program's process ends, then exits with its status, which ends the
    namespace and every process still in it."""
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        return
    for fd in range(3, 256):  # the pipes are the program's alone
        try:
            os.close(fd)
        except OSError:
            pass
    while True:
        if watch_memory:
            _wait_watching(child, memory_bytes)
        else:
            _reap(child, 0)


def _wait_watching(child, memory_bytes):
    _reap(child, os.WNOHANG)
    used = _memory_in_use()
    if used > memory_bytes:
        os.write(
            2,
            f"\nMemoryError: the program's processes used {used >> 20} MB together, "
            f"over the limit of {memory_bytes >> 20} MB\n".encode(),
        )
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace
        os._exit(1)
    time.sleep(0.01)


def _reap(child, flags):
    """Reap ended processes; end with the program's own process."""
    while True:
        try:
            pid, status = os.waitpid(-1, flags)
        except ChildProcessError:
            os._exit(1)
        if pid == 0:
            return
        if pid == child:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _memory_in_use():
    """Memory of every process in this PID namespace but ours (each one's proportional
    share of what it shares), plus System V shared memory that no process holds."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != "1":
            total += _pss(pid)
    try:
        with open("/proc/sysvipc/shm") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        total += sum(int(row[3]) for row in rows if len(row) > 6 and row[6] == "0")
    except OSError:
        pass
    return total


def _pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ------------------------------------------------------------------ 4. no privileges
def become_program(uid, own_keys):
    """Drop to the program's identity: `uid` (when given); with `own_keys`, in a user
    namespace of its own and with a fresh session keyring; then no new privileges and
    no capabilities."""
    if uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if not sys.platform.startswith("linux"):
        return  # the rest is Linux's
    if own_keys:
        if uid:
            _own_user_namespace(uid)
        _syscall("keyctl", ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
    _ok(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    _drop_capabilities()


def _own_user_namespace(uid):
    """The same uid, in a user namespace that owns nothing but what the program makes
    there (its keyrings): they end with it."""
    _ok(_libc.unshare(CLONE_NEWUSER), "unshare a user namespace")
    # a process that changed its uid is not dumpable, and its /proc files stay root's
    _ok(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{uid} {uid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities():
    """Empty bounding set (nothing executed regains a capability) and empty sets."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # refused without CAP_SETPCAP: then
        # nothing can be regained anyway (no new privileges)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _ok(_libc.capset(ctypes.byref(header), data), "drop capabilities")
