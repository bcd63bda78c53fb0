"""The collector in a respool process (worker/heap.py): imports run without it and what they made is
frozen; garbage left by the start is collected, not frozen for good; what is alive then is out of
later collections' sight; what comes after is collected as before."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from worker.heap import freeze_startup_heap, frozen_imports


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


def test_imports_run_without_the_collector_and_what_they_made_is_frozen(thawed: None) -> None:
    assert gc.isenabled()
    with frozen_imports():
        assert not gc.isenabled()
        made = Node()
    assert gc.isenabled()
    assert not any(found is made for found in gc.get_objects())


def test_the_collector_comes_back_however_the_imports_end(thawed: None) -> None:
    with pytest.raises(ImportError), frozen_imports():
        import worker.no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off(thawed: None) -> None:
    gc.disable()
    try:
        with frozen_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
