"""One trainer per output directory: an exclusive `flock` on OUT/.train.lock, taken before
a run touches OUT and held until it ends. The kernel drops the lock when the process
exits, however it exits (SIGKILL included), so a file left behind is never a stale lock;
the pid written into it only names the holder in the refusal.

A run that ends (finished or failed) deletes the file while it still holds the lock, so
OUT holds only what the run wrote. A trainer that opened the file just before it was
deleted would lock a file no longer at that path; it sees that (the path names another
file, or none) and takes the lock again on the file that is there."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".train.lock"


class OutLock:
    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock without waiting: None when taken, else the holder's pid as it wrote
        it ("unknown" if it has not yet)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                return holder or "unknown"
            if self._still_at_path(fd):
                break
            os.close(fd)  # its holder deleted it as we opened it: lock the one there now
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return None

    def _still_at_path(self, fd: int) -> bool:
        """Whether the file locked through `fd` is the one at the path."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)

    def release(self) -> None:
        """Delete the file, then drop the lock (closing the descriptor drops it)."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
