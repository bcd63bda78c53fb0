"""Write tests/durations.json, the seconds each test file took, from a run's JUnit XML report: the
suite's files are handed to its test processes longest first (tests/conftest.py), so that the run
does not end on one process finishing a file of minutes while the others have run dry.

    .venv/bin/pytest -n 3 --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python tools/durations.py /tmp/junit.xml

A file the report does not name keeps its old figure; a new file without one goes after those with
one. The figures only order the files: a stale one costs time, never a test.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", help="pytest's --junitxml output")
    args = parser.parse_args()
    seconds: Counter[str] = Counter()
    for case in ElementTree.parse(args.report).iter("testcase"):
        # classname is the test's module (and class), dotted: tests.api.test_up or ...test_x.TestY
        module = case.get("classname", "")
        path = "/".join(part for part in module.split(".") if not part[:1].isupper()) + ".py"
        seconds[path] += float(case.get("time", "0"))
    known = json.loads(OUT.read_text()) if OUT.exists() else {}
    known.update({path: round(total, 1) for path, total in seconds.items()})
    ordered = dict(sorted(known.items(), key=lambda item: -item[1]))
    OUT.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{len(seconds)} files measured, {sum(seconds.values()):.0f} s in all -> {OUT}")


if __name__ == "__main__":
    main()
