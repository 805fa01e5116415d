"""Replacing a directory atomically: write into a staging directory beside the target,
then rename it into place, so a failure never leaves a half-written target.

A save killed mid-write cannot clean up after itself; its staging directory carries its
writer's host and pid, so the next save of the same target removes it once that writer
is gone (`remove_dead_writers`, which the code sandbox uses for its folders too). The
files get the modes any new file would, whatever the writer chose.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def _staging_prefix(out: Path) -> str:
    """What the names of out's staging directories start with."""
    return f".{out.name}.partial-"


def writer_tag() -> str:
    """This host and process, as staging names carry them. The host keeps a cleaner on one
    machine from judging, by its own process table, a writer on another that shares the
    filesystem."""
    return f"{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())}-{os.getpid()}"


def make_staging(out: Path) -> Path:
    """A new, empty `.{name}.partial-{host}-{pid}-{random}` directory next to out.

    Made with os.mkdir(mode=0o777), so it gets the umask's mode as any new directory does
    (tempfile.mkdtemp's would be 0700, and the rename would carry that to out)."""
    while True:
        staging = out.parent / f"{_staging_prefix(out)}{writer_tag()}-{secrets.token_hex(4)}"
        try:
            staging.mkdir(mode=0o777)
            return staging
        except FileExistsError:
            continue


def remove_stale_staging(out: Path) -> None:
    """Remove the staging directories of `out` whose writer is dead, and log in one line
    how much that freed.

    A save killed mid-write (SIGKILL, out of memory, power) cannot clean up after itself,
    and leaves a staging directory as large as the checkpoint. Its name carries its
    writer's host and pid, so the next save of the same target can tell a dead writer's
    directory from a live one's (`remove_dead_writers`). The pid test was chosen over a
    lock file (flock) because it needs no file inside the directory that would have to
    be left out of the checkpoint, and keeps working where locks do not (some network
    filesystems).
    """
    removed, freed = remove_dead_writers(out.parent, _staging_prefix(out))
    if removed:
        folders = "folder" if removed == 1 else "folders"
        log.warning(
            f"removed {removed} staging {folders} of {out} left by an interrupted save "
            f"({freed / 1e6:,.1f} MB)"
        )


def remove_dead_writers(parent: Path, prefix: str) -> tuple[int, int]:
    """Remove the directories of `parent` named `{prefix}{host}-{pid}-{suffix}` (as
    `writer_tag` names them) whose writer is dead; (how many, their bytes).

    A directory is removed only when its host is this one and no process has its pid. A
    live writer's, another host's (its pids mean nothing here), and any other name are
    left alone. A pid reused since the writer died only makes a leftover stay for one
    more sweep; on systems without a safe pid probe nothing is removed.
    """
    pattern = re.compile(rf"{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[0-9A-Za-z_]+")
    host = writer_tag().rsplit("-", 1)[0]
    removed, freed = 0, 0
    try:
        entries = list(parent.iterdir())
    except OSError:
        return 0, 0
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or match["host"] != host or entry.is_symlink() or not entry.is_dir():
            continue
        if _pid_alive(int(match["pid"])):
            continue
        size = _tree_size(entry)
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed, freed = removed + 1, freed + size
    return removed, freed


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any user's). True where it cannot be told
    safely: on Windows os.kill(pid, 0) would send CTRL_C_EVENT rather than probe."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _tree_size(directory: Path) -> int:
    """Bytes in the files under directory (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def follow_umask(staging: Path) -> None:
    """Give every file and directory under staging 0666 / 0777 less the umask, whatever
    the writer chose (safetensors writes its file 0600). The umask is read off staging
    itself, made with mode 0777: asking os.umask would mean setting it, which races with
    other threads creating files."""
    umask = ~stat.S_IMODE(staging.stat().st_mode) & 0o777
    for root, dirs, files in os.walk(staging):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def move_into_place(staging: Path, out: Path) -> None:
    """Rename staging to out; an existing out is moved aside first and restored on failure."""
    if not out.exists():
        staging.rename(out)
        return
    graveyard = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old = graveyard / out.name
    out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        old.rename(out)
        raise
    finally:
        shutil.rmtree(graveyard, ignore_errors=True)
