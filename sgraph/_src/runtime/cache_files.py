"""Small files sgraph keeps in Inductor's cache directory, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` through a file of this process's own, renamed into
    place, so another process reading it finds the old file or the new one, whole.
    Whether it was written (an unwritable cache is not an error: the file only saves
    the next process work).

    Example:
        >>> write_atomically(Path(cache_dir()) / "sgraph-direct" / key, fx_key)
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        return False
    return True
