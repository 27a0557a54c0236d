"""Python's cyclic garbage collector, made quiet while we trace or plan.

Tracing GPT-3 175B builds a 62k-op graph and planning it builds hundreds of strategy graphs
and a profile table of ~70k entries; none of it is garbage until the plan is made. Under the
default thresholds CPython runs a full collection every time the long-lived heap grows by a
quarter, re-scanning all of it: 27 full collections took 7.6 s of a 60 s plan. Inside
``quiet_gc()`` the objects that existed on entry are frozen (``gc.freeze``: not scanned) and
collections are rarer; cycles made meanwhile are still collected. Both are undone on exit.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()
_froze = False

THRESHOLDS = (10_000, 50, 1_000)
"""generation 0 / 1 / 2 thresholds while quiet (CPython's defaults: 700, 10, 10)"""


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Freeze the existing heap and collect less often until the outermost ``quiet_gc`` exits.

    A host that froze objects itself (``gc.freeze`` before forking workers) keeps them frozen:
    then only the thresholds change, as ``gc.unfreeze`` would release the host's objects too.
    """
    global _depth, _saved, _froze
    try:
        with _lock:
            if _depth == 0:
                _saved = gc.get_threshold()
                _froze = gc.get_freeze_count() == 0
                if _froze:
                    gc.freeze()
                gc.set_threshold(*THRESHOLDS)
            _depth += 1
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)
                if _froze:
                    gc.unfreeze()
