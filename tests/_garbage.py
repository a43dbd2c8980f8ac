"""What a piece of work leaves in reference cycles: the one way the leak tests look."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cycles_left() -> Iterator[list[object]]:
    """Run the ``with`` body with the garbage collector off, then collect: the list it yields
    is filled, on exit, with every object the body left in reference cycles (what only a
    collection frees).

    The test process's own heap is collected first and frozen (:func:`gc.freeze`), so the
    collection afterwards walks only what the body made: in a suite's worker process, with
    every test module loaded, two full collections cost about a second a test. (So a cycle
    through an object older than the body is not seen: the leaks these tests look for are
    the body's own frames, tracebacks, errors and buffers.)
    """
    found: list[object] = []
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        gc.enable()
