"""Garbage-collector policy of the coordinator's process (it hosts the gateway).

The coordinator holds ~200k long-lived objects from torch and transformers (and the
tokenizer). CPython's full collections scan them all: measured with 1,000 runs in flight
(tools/bench_gateway.py), a gen-2 pass stalled the event loop ~240 ms, the gateway's
p99 call overhead ~100 ms. `freeze_startup_heap()`, called once everything long-lived
is loaded, moves those objects to the permanent generation (`gc.freeze`), so later
collections scan only what the job itself allocates.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; the number frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: %d startup objects frozen out of the collector's scans", frozen)
    return frozen
