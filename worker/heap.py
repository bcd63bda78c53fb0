"""The garbage collector in a long-running respool process (README, CPU cost).

A process starts by importing what it needs (FastAPI, pydantic, the `openai` types, SQLAlchemy, RQ):
240,000 objects the collector tracks, living as long as the process does. Its oldest generation
holds them, and each full collection walks them all (one every few thousand responses): 100–115 ms
at a time on this machine, the process's every stream stalled meanwhile, for nothing it could free. Once the process has started,
`freeze_startup_heap` collects what startup left behind and moves the rest out of the collector's
sight (`gc.freeze`), so a full collection walks only what the process made since.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("respool.heap")


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (idempotent enough:
    a second call freezes what came since)."""
    gc.collect()
    gc.freeze()
    log.debug("heap frozen: %d objects out of the collector's sight", gc.get_freeze_count())
