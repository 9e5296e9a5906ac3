"""The processes a launcher started, read from /proc (Linux): its session, its rank
processes, which of them are still alive (train/test_cli_launch.py,
train/test_cli_run_lock.py)."""

from __future__ import annotations

import os


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process of session ``sid`` but its leader
    (the launcher runs in a session of its own, so this is all it started, at any depth)."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == sid:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(d)] = cmd
    return found


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def rank_pids(sid: int) -> list[int]:
    """The rank processes of launcher ``sid``: the children of its fork server."""
    procs = session_processes(sid)
    servers = {pid for pid, cmd in procs.items() if "forkserver" in cmd and parent_pid(pid) == sid}
    return sorted(pid for pid in procs if parent_pid(pid) in servers)


def still_alive(pids) -> list[int]:
    """Those of ``pids`` not yet ended: ended is gone, or a zombie whose every thread has
    left (a killed process's main thread is a zombie before its other threads have closed
    its files, its locks with them)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1:
                    alive.append(pid)
        except OSError:
            pass
    return alive


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(d))
    return found
