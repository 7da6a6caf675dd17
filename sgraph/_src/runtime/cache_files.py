"""Small files sgraph keeps in Inductor's cache directory, written atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["file_stats", "read_json", "write_atomically"]


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


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; None if it is missing, unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def file_stats(paths: Iterable[str]) -> list[str]:
    """One line per existing file: its path, size and modification time (what Python
    checks before it trusts a module's cached bytecode), for a fingerprint."""
    lines = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        lines.append(f"{path}\0{st.st_size}\0{st.st_mtime_ns}")
    return lines
