"""Where in the user's code something happens: source lines for graph nodes and messages."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import optree
import torch

__all__ = [
    "GRAD_MODULE_KEY",
    "MODULE_KEY",
    "SOURCE_KEY",
    "Source",
    "module_path",
    "module_scopes",
    "user_source",
    "is_library",
    "where",
]

SOURCE_KEY = "sgraph_source"
MODULE_KEY = "sgraph_module"
"""Node meta key: the path of the submodule whose forward made the node (``blocks.3.fc``)."""
GRAD_MODULE_KEY = "sgraph_grad_module"
"""Node meta key of a backward node: the path of the submodule whose forward op it
differentiates (kept apart from ``MODULE_KEY``, which names forward ops only)."""
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


_scopes = threading.local()


def module_path() -> str | None:
    """The path of the innermost submodule running in this thread under :func:`module_scopes`."""
    stack = getattr(_scopes, "stack", None)
    return stack[-1][1] if stack else None


@contextlib.contextmanager
def module_scopes(root: torch.nn.Module) -> Iterator[None]:
    """Track which of ``root``'s submodules is running, for :func:`module_path`.

    Global forward hooks (removed on exit) push a submodule's path when its forward
    starts and pop it when it ends; modules outside ``root`` are ignored. The root
    itself is the empty path.

    Example:
        >>> with module_scopes(model):
        ...     model(x)  # module_path() is "blocks.0.fc" inside that Linear's forward
    """
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    stack: list[tuple[int, str]] = getattr(_scopes, "stack", None) or []
    _scopes.stack = stack
    depth = len(stack)

    def enter(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            stack.append((id(module), name))

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack and stack[-1][0] == id(module) and len(stack) > depth:
            stack.pop()

    hooks = torch.nn.modules.module
    pre = hooks.register_module_forward_pre_hook(enter)
    post = hooks.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        del stack[depth:]
