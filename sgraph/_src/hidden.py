"""Find tensors hidden inside objects that are not pytree containers.

A tensor inside an unregistered dataclass, a list subclass or a plain object is
not a leaf: a step would see the object as one static value (its tensors frozen
as constants on the way in, leaked as trace-time fake tensors on the way out).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

__all__ = ["find_hidden_tensor"]

_MAX_DEPTH = 4
_OPAQUE = (nn.Module, type, str, bytes, types.FunctionType, types.ModuleType, torch.device, torch.dtype)


def find_hidden_tensor(value: Any) -> str | None:
    """The path of the first tensor inside ``value`` (e.g. ``.a`` or ``[0]``), or None.

    Looks inside dataclasses, list/tuple/dict subclasses, sets and the attributes of
    plain objects, a few levels deep; not inside modules, which own their tensors on
    purpose, nor classes and functions.

    Example:
        >>> find_hidden_tensor(MyDataclass(a=torch.ones(1)))
        '.a'
    """
    return _search(value, 0, set())


def _search(value: Any, depth: int, seen: set[int]) -> str | None:
    if isinstance(value, torch.Tensor):
        return ""
    if depth >= _MAX_DEPTH or id(value) in seen or isinstance(value, _OPAQUE):
        return None
    seen.add(id(value))
    for where, child in _children(value):
        found = _search(child, depth + 1, seen)
        if found is not None:
            return where + found
    return None


def _children(value: Any) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f".{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [(" (an element)", v) for v in value]
    attributes = dict(getattr(value, "__dict__", None) or {})
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and hasattr(value, name):
                attributes[name] = getattr(value, name)
    return [(f".{k}", v) for k, v in attributes.items() if isinstance(k, str)]
