"""What a system costs in CPU (issue 20): the user and system time of its whole process tree, read
from /proc (through psutil), over a scenario, less what the same tree spends idle over as long.

A tree is given by its roots (respool's API and workers, its Redis and Postgres when the bench
started them; LiteLLM's proxy). Its time at a moment is, over every live process of the tree, its own
user and system time plus its reaped children's (`children_user`, `children_system`): a process that
ends during the scenario (a Postgres backend) is still counted, by its parent, once it is waited for.
A difference of two readings is what the tree spent between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass
class Tree:
    """The processes of one system: each root and (unless `descendants` is false) its descendants,
    found afresh at each reading."""

    roots: list[psutil.Process]
    descendants: bool = True

    def processes(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for root in self.roots:
            try:
                family = root.children(recursive=True) if self.descendants else []
            except psutil.Error:
                continue  # the root is gone: it counts no more
            for process in [root, *family]:
                found.setdefault(process.pid, process)
        return list(found.values())

    def seconds(self) -> float:
        """CPU seconds the tree has used so far (user + system, with its reaped children's)."""
        total = 0.0
        for process in self.processes():
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
            if self.descendants:
                total += times.children_user + times.children_system
        return total


def own() -> Tree:
    """The load generator: this process alone (its threads). The bench's other children (upstream,
    respool, LiteLLM) are systems of their own, not its cost."""
    return Tree([psutil.Process()], descendants=False)


@dataclass
class Reading:
    """Where every tree stood at one moment."""

    at: float
    seconds: dict[str, float]


def read(trees: dict[str, Tree]) -> Reading:
    return Reading(time.monotonic(), {name: tree.seconds() for name, tree in trees.items()})


def spent(before: Reading, after: Reading, idle: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds each tree spent between two readings, less its idle rate (seconds per second)
    over as long, never below zero."""
    elapsed = after.at - before.at
    rates = idle or {}
    return {
        name: max(0.0, after.seconds[name] - before.seconds[name] - rates.get(name, 0.0) * elapsed)
        for name in before.seconds
    }


def idle_rates(trees: dict[str, Tree], seconds: float) -> dict[str, float]:
    """What each tree spends per second while nothing is asked of it (measured over `seconds`)."""
    before = read(trees)
    time.sleep(seconds)
    after = read(trees)
    elapsed = after.at - before.at
    return {name: (after.seconds[name] - before.seconds[name]) / elapsed for name in trees}


def per_unit(spent_seconds: float, units: int, scale: float) -> float | None:
    """`spent_seconds` per unit (a token, a request) in `scale` units of time (1e6: µs, 1e3: ms)."""
    return None if units <= 0 else round(spent_seconds / units * scale, 1)
