"""The workdir lock: a live holder is refused by name, a dead or silent one is taken over."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxcls import workdir
from jaxcls.workdir import WorkdirLock, WorkdirLocked

HOLD = "import sys, time; from jaxcls.workdir import WorkdirLock; WorkdirLock(sys.argv[1], 'holder').acquire(); " \
       "print('held', flush=True); time.sleep(600)"


def test_a_second_program_is_refused_naming_the_holder_until_it_ends(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirLocked, match=rf"{tmp_path} is in use by holder pid {holder.pid} on "
                                                rf"{socket.gethostname()} since 20\d\d-"):
            WorkdirLock(tmp_path, "second").acquire()
    finally:
        holder.kill()  # as kill -9: the lock file stays behind, naming a dead process
        holder.wait()
    assert json.loads((tmp_path / "lock").read_text())["pid"] == holder.pid
    lock = WorkdirLock(tmp_path, "second")
    assert lock.acquire().startswith(f"took over the stale lock of holder pid {holder.pid} on {socket.gethostname()}")
    assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "lock").exists()


def test_a_pid_taken_by_a_later_process_does_not_hold_the_lock(tmp_path):
    """After a kill -9, a restarted container on the same host name can give the next trainer the dead holder's pid:
    the lock names a process that started before this one, so it is stale."""
    lock = {"what": "jaxcls.train", "host": socket.gethostname(), "pid": os.getpid(), "started": time.time() - 3600}
    if workdir._started(os.getpid()) is None:
        pytest.skip("no /proc to read a process's start time from")
    (tmp_path / "lock").write_text(json.dumps(lock))
    taker = WorkdirLock(tmp_path, "train")
    assert taker.acquire().startswith(f"took over the stale lock of jaxcls.train pid {os.getpid()}")
    taker.release()
    (tmp_path / "lock").write_text(json.dumps({**lock, "started": time.time()}))  # this process took it: alive
    with pytest.raises(WorkdirLocked, match=f"in use by jaxcls.train pid {os.getpid()}"):
        WorkdirLock(tmp_path, "train").acquire()
    assert abs(workdir._started(os.getpid()) - time.time()) < 24 * 3600  # a real start time, not 0 or garbage


TAKE_OVER = ("import sys, time; from jaxcls import workdir; judge = workdir.WorkdirLock.holder_if_alive\n"
             "def slow(self):  # a wide window between judging the lock stale and replacing it\n"
             "    holder = judge(self); time.sleep(1.5); return holder\n"
             "workdir.WorkdirLock.holder_if_alive = slow\n"
             "try:\n"
             "    workdir.WorkdirLock(sys.argv[1], 'train').acquire(); print('acquired', flush=True)\n"
             "    sys.stdin.read()  # held until the test has both answers\n"
             "except workdir.WorkdirLocked as e:\n"
             "    print('refused', flush=True)\n")


def test_two_starters_on_a_stale_lock_do_not_both_take_it_over(tmp_path):
    (tmp_path / "lock").write_text(json.dumps({"what": "jaxcls.train", "host": socket.gethostname(), "pid": 2**22 + 1,
                                               "started": 0}))  # above Linux's largest pid: dead
    starters = [subprocess.Popen([sys.executable, "-c", TAKE_OVER, str(tmp_path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outcomes = sorted(p.stdout.readline().strip() for p in starters)
    finally:
        for p in starters:
            p.stdin.close()
            p.wait(timeout=120)
    assert outcomes == ["acquired", "refused"]


def test_a_holder_on_another_host_counts_while_it_refreshes_the_lock(tmp_path):
    (tmp_path / "lock").write_text(json.dumps({"what": "jaxcls.train", "host": "node-17", "pid": 1, "started": 0}))
    with pytest.raises(WorkdirLocked, match=r"jaxcls.train pid 1 on node-17 .*; stop it first, or use another "
                                            r"workdir \(a holder on another host that stopped refreshing it is taken "
                                            r"over 5 minutes after its last refresh\)$"):
        WorkdirLock(tmp_path, "train").acquire()
    silent = time.time() - workdir.STALE_AFTER - 1
    os.utime(tmp_path / "lock", (silent, silent))
    lock = WorkdirLock(tmp_path, "train")
    assert "took over the stale lock of jaxcls.train pid 1 on node-17" in lock.acquire()
    lock.release()


def test_release_leaves_a_lock_taken_over_by_another(tmp_path):
    lock = WorkdirLock(tmp_path, "train")
    lock.acquire()
    (tmp_path / "lock").write_text(json.dumps({"host": "node-17", "pid": 1}))
    lock.release()
    assert (tmp_path / "lock").exists()
