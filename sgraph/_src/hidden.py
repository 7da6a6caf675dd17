"""Find tensors hidden inside objects that are not pytree containers.

A tensor inside an unregistered dataclass, a list subclass or a plain object is
not a leaf: a step would see the object as one static value (its tensors frozen
as constants on the way in, leaked as trace-time fake tensors on the way out).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["find_hidden_tensor"]

_MAX_DEPTH = 4


def find_hidden_tensor(value: Any) -> str | None:
    """The path of the first tensor inside ``value`` (e.g. ``.a`` or ``[0]``), or None.

    Looks inside dataclasses, list/tuple/dict subclasses and sets, a few levels deep;
    not inside modules or other objects, which own their tensors on purpose.

    Example:
        >>> find_hidden_tensor(MyDataclass(a=torch.ones(1)))
        '.a'
    """
    return _search(value, 0, set())


def _search(value: Any, depth: int, seen: set[int]) -> str | None:
    if isinstance(value, torch.Tensor):
        return ""
    if depth >= _MAX_DEPTH or id(value) in seen or isinstance(value, (nn.Module, type, str, bytes)):
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
    return []
