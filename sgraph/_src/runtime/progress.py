"""A one-line progress note for long compiles, shown only on a terminal.

Compiling a large step takes seconds to tens of seconds; a silent pause that long
reads as a hang. After a few seconds a line on stderr says what is compiling and
for how long, updated in place, and is closed with the total. Output that is not
a terminal (logs, CI, notebooks' captured streams) stays silent.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["progress"]

DELAY_SECONDS = 3.0


@contextlib.contextmanager
def progress(what: str, *, delay: float = DELAY_SECONDS) -> Iterator[None]:
    """Show ``what ... 12s`` on stderr while the body runs longer than ``delay``.

    Example:
        >>> with progress("sg.static(step): generating kernels"):
        ...     compile_everything()
    """
    stream = sys.stderr
    if not _is_terminal(stream):
        yield
        return
    done = threading.Event()
    start = time.perf_counter()
    shown = threading.Event()

    def tick() -> None:
        if done.wait(delay):
            return
        while not done.is_set():
            shown.set()
            stream.write(f"\r{what} ... {time.perf_counter() - start:.0f}s")
            stream.flush()
            done.wait(1.0)

    thread = threading.Thread(target=tick, name="sgraph-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if shown.is_set():
            stream.write(f"\r{what}: done in {time.perf_counter() - start:.1f}s\n")
            stream.flush()


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
