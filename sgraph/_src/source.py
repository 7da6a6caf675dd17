"""Where in the user's code something happens: source lines for graph nodes and messages."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from dataclasses import dataclass
from types import FrameType

import optree
import torch

__all__ = ["SOURCE_KEY", "Source", "user_source", "is_library", "where"]

SOURCE_KEY = "sgraph_source"
_SKIP_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, optree, sys.modules[__package__]) if m.__file__
) + (os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py",)


@dataclass(frozen=True)
class Source:
    """Where in the user's code a graph node comes from."""

    file: str
    line: int
    function: str
    backward: bool = False

    @property
    def code(self) -> str:
        """The text of the source line, stripped."""
        return linecache.getline(self.file, self.line).strip()

    def short(self) -> str:
        """``file.py:12 in fn``, prefixed with ``backward of`` for gradient ops."""
        where = f"{os.path.basename(self.file)}:{self.line} in {self.function}"
        return f"backward of {where}" if self.backward else where

    def describe(self) -> str:
        """``file.py:12 in fn (`code`)``, for error messages."""
        code = self.code
        return f"{self.short()} (`{code}`)" if code else self.short()

    def as_backward(self) -> Source:
        return Source(self.file, self.line, self.function, backward=True)


def is_library(frame: FrameType) -> bool:
    """Whether ``frame`` runs torch's, optree's or sgraph's code (not the user's)."""
    name = frame.f_code.co_filename
    return name.startswith(_SKIP_DIRS) or name.startswith("<frozen")


def user_source() -> Source | None:
    """The innermost frame of the caller's stack that is not torch's, optree's or sgraph's."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_library(frame):
            return Source(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def where(source: Source | None) -> str:
    """`` at file.py:12 in fn (`code`)`` for messages, or nothing when unknown."""
    return f" at {source.describe()}" if source else ""
