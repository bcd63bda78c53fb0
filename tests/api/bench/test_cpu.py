"""The bench's CPU accounting (api/bench/cpu.py) on real processes: a tree's time counts its live
processes and the children they reaped, and what it spent idle is taken out."""

from __future__ import annotations

import subprocess
import sys

import psutil

from api.bench import cpu

# A parent that starts a child which burns about 0.4 s of CPU and exits (the parent reaps it), then
# burns about 0.2 s itself, says so, and sleeps.
BURNING = """
import subprocess, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"], check=True)
burn(0.2)
print("done", flush=True)
time.sleep(60)
"""


def test_a_tree_counts_its_processes_and_the_children_they_reaped() -> None:
    with subprocess.Popen([sys.executable, "-c", BURNING], stdout=subprocess.PIPE, text=True) as parent:
        tree = cpu.Tree([psutil.Process(parent.pid)])
        trees = {"tree": tree, "me": cpu.own()}  # this process alone: its children are not its cost
        before = cpu.read(trees)
        assert parent.stdout is not None and parent.stdout.readline().strip() == "done"
        after = cpu.read(trees)
        spent = cpu.spent(before, after)["tree"]
        assert cpu.spent(before, after)["me"] < 0.3  # it waited on a pipe meanwhile
        assert 0.55 <= spent <= 2.0, spent  # the child's 0.4 s (reaped) and the parent's 0.2 s, at least
        idle = cpu.idle_rates({"tree": tree}, 0.5)["tree"]
        assert idle < 0.05  # it sleeps now
        assert cpu.spent(before, after, {"tree": 1.0})["tree"] < spent  # an idle rate is taken out
        assert cpu.spent(before, after, {"tree": 1000.0})["tree"] == 0.0  # never below zero
        parent.kill()


def test_a_root_that_is_gone_counts_no_more_and_per_unit_scales() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as process:
        tree = cpu.Tree([psutil.Process(process.pid)])
        assert tree.processes()
        process.kill()
    assert tree.processes() == [] and tree.seconds() == 0.0
    assert cpu.per_unit(0.0015, 10, 1e6) == 150.0  # 1.5 ms over 10 tokens: 150 µs a token
    assert cpu.per_unit(1.0, 0, 1e3) is None
