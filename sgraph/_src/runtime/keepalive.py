"""What a captured CUDA graph reads at replay that none of its tensors holds.

An own kernel that copies a table from pinned host memory into the graph being
captured (:mod:`sgraph._src.kernels.adamw_lists`) needs that host memory and the
device copy for as long as the graph replays. Under ``sg.static`` the capture hands
them to a list its executable keeps beside the graph, so they go with it (and the
graph's memory pool with them); a capture sgraph does not make (a
``torch.cuda.graph`` of the user's around a step) keeps them for the life of the
process.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["kept_with", "keep_for_replays"]

_HOLDER: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("sgraph_replay_holder", default=None)
_PROCESS: list[Any] = []


@contextlib.contextmanager
def kept_with(holder: list[Any]) -> Iterator[None]:
    """Objects kept for replays while this is entered go to ``holder``.

    Example:
        >>> kept: list = []
        >>> with kept_with(kept):
        ...     graph.capture_begin(); body(); graph.capture_end()
    """
    token = _HOLDER.set(holder)
    try:
        yield
    finally:
        _HOLDER.reset(token)


def keep_for_replays(*objects: Any) -> None:
    """Keep ``objects`` alive as long as the graph being captured (see the module)."""
    holder = _HOLDER.get()
    (holder if holder is not None else _PROCESS).extend(objects)
