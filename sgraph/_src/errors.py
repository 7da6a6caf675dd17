"""The exceptions and warnings sgraph raises.

Every class subclasses the built-in a caller would already catch (``RuntimeError``,
``ValueError``, ``TypeError``, ``UserWarning``) and also :class:`SgraphError`, so
``except sg.SgraphError`` catches everything sgraph raises on purpose.
"""

from __future__ import annotations

__all__ = [
    "SgraphError",
    "ArgumentError",
    "ArgumentTypeError",
    "UnsupportedError",
    "CaptureError",
    "RetraceError",
    "TreeStructureError",
    "StaleBufferError",
    "SgraphWarning",
    "RetraceWarning",
    "DonationWarning",
    "FallbackWarning",
]


class SgraphError(Exception):
    """Base class of every error sgraph raises on purpose."""


class ArgumentError(SgraphError, ValueError):
    """An argument has the right type but a wrong value (a shape, a key, a range)."""


class ArgumentTypeError(SgraphError, TypeError):
    """An argument has the wrong type."""


class UnsupportedError(SgraphError, RuntimeError):
    """A setup sgraph does not support yet (the message says which part and what to do)."""


class CaptureError(SgraphError, RuntimeError):
    """The step does something that cannot be captured into one graph.

    Raised at trace time, naming the op (or the input's path), the user's source
    line, and what to write instead.
    """


class RetraceError(SgraphError, RuntimeError):
    """A call's signature differs from every compiled one under ``retrace="error"``."""


class TreeStructureError(SgraphError, ValueError):
    """Two pytrees that must match do not; the message names the first differing path."""


class StaleBufferError(SgraphError, RuntimeError):
    """A donated tensor was replaced or resized between calls of a static step."""


class SgraphWarning(UserWarning):
    """Base class of every warning sgraph emits."""


class RetraceWarning(SgraphWarning):
    """A call's signature differs from the compiled ones, so the step is traced again."""


class DonationWarning(SgraphWarning):
    """A donated input could not be reused for any output."""


class FallbackWarning(SgraphWarning):
    """A step that could not be captured runs uncaptured because ``fallback`` allows it."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line: the innermost frame outside
    sgraph, torch and the standard library's wrappers (however deep the call came)."""
    import os
    import sys
    import types
    import warnings

    import torch

    skipped = (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
        os.path.dirname(os.path.abspath(os.__file__)) + os.sep + "contextlib.py",
        os.path.dirname(os.path.abspath(os.__file__)) + os.sep + "functools.py",
    )
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
