"""Full garbage collections deferred during a step's first call: while its signature is
built, and it is traced, lowered, compiled and captured.

Tracing and compiling a large step make hundreds of thousands of Python objects (FX
nodes and their metadata, fake tensors, sympy expressions, Inductor's IR), most of
them alive until the stage ends. With CPython's default thresholds a full collection
runs whenever ten collections of the middle generation have run, and each one walks
every object the collector tracks: the whole heap, which keeps growing while the
stage runs. So the same traversal is paid over and over (Dynamo defers it the same
way while it compiles, but sgraph's stages do not run under Dynamo).

While a stage runs, the oldest generation's threshold is raised so high that no full
collection starts. The two younger generations keep collecting, and reference
counting still frees acyclic garbage at once: what waits is cyclic garbage that has
lived long enough to reach the oldest generation, which the first full collection
after the stage frees (it comes soon, the count being well past the threshold by
then). The thresholds are the process's: another thread's cyclic garbage waits for
that collection too. ``examples/first_call_cpu.py`` counts the full collections of a
first call (on the CI machine's CPU, with the passes' graph copies also gone: 5
taking 0.88 s before, 1 taking 0.26 s after; with the signature and the capture
inside the deferral too, none, where 2 had taken 0.42 s: the warm first call went
from 6.05 to 5.67 s, median of 3, and the one collection left runs after it, as it
did before).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["full_collections_deferred"]

_DEFERRED = 1_000_000  # middle-generation collections before a full one: none in a stage
_LOCK = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Run the body with full collections deferred (see the module).

    Reentrant and shared between threads: the thresholds are raised when the first
    stage begins and restored when the last one ends, unless they were changed in
    the meantime (then they are left as they were set).

    Example:
        >>> with full_collections_deferred():
        ...     program = trace(step, args, kwargs, api=api, layout=layout)
    """
    global _depth, _saved
    with _LOCK:
        if _depth == 0:
            _saved = gc.get_threshold()
            if len(_saved) >= 3 and _saved[2] < _DEFERRED:
                gc.set_threshold(_saved[0], _saved[1], _DEFERRED)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                now = gc.get_threshold()
                if len(_saved) >= 3 and now == (_saved[0], _saved[1], _DEFERRED):
                    gc.set_threshold(*_saved)
                _saved = None
