"""CPU time of processes and everything they started, from /proc (Linux only).

A process's CPU time here is its utime + stime, plus cutime + cstime (the children it
has already reaped), plus the same for each live descendant. Every second of CPU is then
counted once: a descendant's time moves into its parent's cutime when it is reaped.
"""

from __future__ import annotations

import os

_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree, from one walk over /proc.

    Args:
        roots: name -> pid of the process at the top of each tree.
    Returns:
        name -> seconds; 0.0 for a process that is gone.
    """
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _stat(pid)
        if fields is None:
            continue  # exited during the walk
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(f) for f in fields[11:15])
    out = {}
    for name, root in roots.items():
        total, stack = 0, [root]
        while stack:
            pid = stack.pop()
            total += ticks.get(pid, 0)
            stack.extend(children.get(pid, ()))
        out[name] = total / _TCK
    return out


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name: [state, ppid, ..., utime at 11, stime, cutime, cstime]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def machine_cpu_seconds() -> float:
    """CPU seconds every processor of the machine has spent busy (not idle or waiting on
    I/O) since boot, from /proc/stat: set against a process tree's own, it tells what
    everything else on the machine took over the same window."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TCK  # user..steal, less idle and iowait
