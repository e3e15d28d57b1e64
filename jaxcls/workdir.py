"""A run's workdir is written by one program at a time: the lock file ``<workdir>/lock``.

The trainer holds it while it runs (process 0 of a multi-process run) and ``jaxcls.eval`` while it writes.
The file names its holder (host, pid, start time, command) and is touched every ``REFRESH`` seconds. A lock
is stale, and is taken over with a warning, when its holder is a dead process on this host (or its pid now
names a process that started after the lock: a restarted container reuses pids), or, for a holder on another
host, when it has not been touched for ``STALE_AFTER`` seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

REFRESH = 30
STALE_AFTER = 300


class WorkdirLocked(RuntimeError):
    """Another live program holds the workdir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _started(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (Linux's ``/proc``); None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: clock ticks after boot
    except (OSError, IndexError, StopIteration, ValueError):
        return None


def _holds(holder: dict) -> bool:
    """Whether the process ``holder`` names (on this host) is alive and is the one that took the lock: not a later
    process given its pid (``started`` is rounded to the boot time's second, hence the slack)."""
    pid = int(holder.get("pid", -1))
    started = _started(pid)
    return _alive(pid) and (started is None or started <= float(holder.get("started", 0)) + 2)


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('what', '?')} pid {holder.get('pid')} on {holder.get('host')} since {started}"


class WorkdirLock:
    """``acquire()`` raises ``WorkdirLocked`` naming the holder if another live program has the workdir, and
    takes over a stale lock; ``release()`` removes the lock if it is still ours."""

    def __init__(self, workdir: str | os.PathLike, what: str):
        self.path = Path(workdir) / "lock"
        self.holder = {"what": what, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "command": " ".join(sys.argv)}
        self._stop = threading.Event()
        self._thread = None

    def holder_if_alive(self) -> dict | None:
        """The current holder when it is alive (not stale), else None."""
        try:
            holder = json.loads(self.path.read_text())
            touched = self.path.stat().st_mtime
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # gone, or half-written by a holder that died while creating it
        if holder.get("host") == self.holder["host"]:
            return holder if _holds(holder) else None
        return holder if time.time() - touched < STALE_AFTER else None

    def acquire(self) -> str | None:
        """Take the lock; returns a warning line when a stale lock was taken over."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:  # one starter at a time judges a lock and replaces a stale one (else two could both take it over)
            fcntl.flock(folder, fcntl.LOCK_EX)
            return self._acquire()
        finally:
            os.close(folder)

    def _acquire(self) -> str | None:
        stale = None
        for _ in range(3):  # a race with another starter, or a stale lock removed in between
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder_if_alive()
                if holder is not None:
                    raise WorkdirLocked(f"{self.path.parent} is in use by {describe(holder)} "
                                        f"({holder.get('command', '')}); stop it first, or use another workdir"
                                        + ("" if holder.get("host") == self.holder["host"] else
                                           f" (a holder on another host that stopped refreshing it is taken over "
                                           f"{STALE_AFTER // 60} minutes after its last refresh)"))
                stale = self.path.read_text(errors="replace") if self.path.exists() else None
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.holder, f)
            self._thread = threading.Thread(target=self._refresh, daemon=True, name="workdir-lock")
            self._thread.start()
            if stale is None:
                return None
            try:
                return f"took over the stale lock of {describe(json.loads(stale))}"
            except json.JSONDecodeError:
                return "took over a stale, unreadable lock"
        raise WorkdirLocked(f"{self.path}: could not take the lock (another program keeps creating it)")

    def _refresh(self):
        while not self._stop.wait(REFRESH):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
            if (holder.get("host"), holder.get("pid")) == (self.holder["host"], self.holder["pid"]):
                self.path.unlink()
        except (FileNotFoundError, json.JSONDecodeError):
            pass
