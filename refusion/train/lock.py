"""One trainer per output directory: an exclusive `flock` on OUT/.train.lock, taken before
a run touches OUT and held until it ends. The kernel drops the lock when the process
exits, however it exits (SIGKILL included), so there is no stale lock to clean up; the pid
written into the file only names the holder in the refusal."""

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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            return holder or "unknown"
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return None

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops it); the file stays, harmless."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
