"""Summarise py-spy's raw (folded) stacks: the functions that cost most, by own and by inclusive time
(a developer's tool beside tools/pair.py).

    .venv/bin/python tools/spyagg.py FILE [--top 30] [--grep TEXT]
"""

from __future__ import annotations

import argparse
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--grep", default="", help="only stacks through a frame containing this")
    args = parser.parse_args()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(args.file) as lines_:
        lines = list(lines_)
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if args.grep and not any(args.grep in frame for frame in frames):
            continue
        count = int(count_text)
        frames = [
            frame for frame in frames if not frame.startswith("process ") and not frame.startswith("thread ")
        ]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    print(f"{total} samples")
    print("-- own")
    for frame, count in own.most_common(args.top):
        print(f"{100 * count / total:5.1f}%  {frame}")
    print("-- inclusive")
    for frame, count in inclusive.most_common(args.top):
        print(f"{100 * count / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
