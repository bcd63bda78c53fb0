"""The startup heap's freeze (worker/heap.py): garbage left by startup is collected, not frozen for
good; what is alive is out of later collections' sight; what comes after is collected as before."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from worker.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A garbage reference cycle (only a collection frees it) and a way to see whether it lives."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap as it was for the tests after


def test_startup_garbage_is_collected_and_the_living_are_frozen(thawed: None) -> None:
    left_by_startup = cycle()
    alive = Node()
    freeze_startup_heap()
    assert left_by_startup() is None  # collected, not frozen for the process's life
    assert gc.get_freeze_count() > 0
    assert not any(found is alive for found in gc.get_objects())  # out of the collector's sight


def test_garbage_made_after_the_freeze_is_still_collected(thawed: None) -> None:
    freeze_startup_heap()
    later = cycle()
    assert later() is not None
    gc.collect()
    assert later() is None
