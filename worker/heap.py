"""The garbage collector in a long-running respool process (README, CPU cost).

A process starts by importing what it needs (FastAPI, pydantic, the `openai` types, SQLAlchemy, RQ):
240,000 objects the collector tracks, living as long as the process does. Its oldest generation
holds them, and each full collection walks them all (one every few thousand responses): 100 to
115 ms at a time on this machine, the process's every stream stalled meanwhile, for nothing it
could free; and while they were imported, four full collections took 0.25 to 0.4 s of the 1.3 to
1.5 s of CPU a start takes. So a process imports with the collector off and puts what the imports
made out of its sight (`frozen_imports`, `gc.freeze`), and once started does the same with what
its start made, after a collection (`freeze_startup_heap`): a full collection walks only what the
process made since.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("respool.heap")


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (idempotent enough:
    a second call freezes what came since)."""
    gc.collect()
    gc.freeze()
    log.debug("heap frozen: %d objects out of the collector's sight", gc.get_freeze_count())


@contextmanager
def frozen_imports() -> Iterator[None]:
    """A block of imports with the collector off, then what they made frozen, uncollected (what an
    import leaves is a module's, for the process's life; Python's own advice for `gc.freeze`) and
    the collector as it was, however the block ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
