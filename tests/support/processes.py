"""Looking at processes through /proc, for tests that check nothing is left running."""

from __future__ import annotations

from pathlib import Path


def is_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie counts as gone, since this machine's PID 1 may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
