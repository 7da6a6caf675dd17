"""Traced tensors the step left where the user's code can reach them.

A step's Python runs once, when it is traced, on placeholder tensors. One it stores
outside its outputs (``history.append(loss)``, ``global ema; ema = ...``,
``self.cache = x`` in a module's forward) is left behind as that placeholder: it holds
no values, and a later trace that reads it back mixes two traces. Eager stores a real
tensor on every call, so the difference would be silent. :func:`find_escaped` looks
for such placeholders, after the trace, in what the step can reach by name: its
closure, the globals its code names, the modules and objects reached from those, and
their containers.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["find_escaped"]

_MAX_OBJECTS = 20000
"""Objects visited at most (a step closing over a large dataset is not walked whole)."""
_MAX_DEPTH = 8
_MAX_ITEMS = 1000
"""Items of one container looked at (a long list of numbers is not a place for tensors)."""


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""What ``nn.Module.__init__`` sets (hooks, the training flag): torch's, not the user's."""


def find_escaped(fn: Callable[..., Any], extra: tuple[Any, ...] = ()) -> str | None:
    """Where a traced placeholder tensor is now reachable from ``fn`` (``global ema``,
    ``hist[0]`` in the closure, ``model.cache``), or None. ``extra``: more roots, such
    as the modules the trace ran."""
    seen: set[int] = set()
    pending: list[tuple[Any, str, int]] = [(value, path, 0) for path, value in _roots(fn, seen)]
    pending += [(module, type(module).__name__, 0) for module in extra]
    while pending and len(seen) < _MAX_OBJECTS:
        value, path, depth = pending.pop()
        if isinstance(value, torch.Tensor):
            if _is_placeholder(value):
                return path
            continue
        if id(value) in seen or depth > _MAX_DEPTH or _atomic(value):
            continue
        seen.add(id(value))
        pending += [(child, child_path, depth + 1) for child_path, child in _children(value, path, seen)]
    return None


def _is_placeholder(t: torch.Tensor) -> bool:
    if isinstance(t, FakeTensor):
        return True
    local = getattr(t, "_local_tensor", None)  # a DTensor around one
    return isinstance(local, FakeTensor)


def _atomic(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (str, bytes, int, float, complex, bool, type, types.ModuleType, range))
        or type(value).__module__.startswith("numpy")
    )


def _roots(fn: Any, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """The names ``fn`` reaches: closure cells, the globals its code names, and for
    partials, bound methods and callable objects, what they wrap."""
    if isinstance(fn, functools.partial):
        yield from _roots(fn.func, seen)
        yield from ((f"a partial argument {i}", a) for i, a in enumerate(fn.args))
        yield from ((f"a partial argument {k}", a) for k, a in fn.keywords.items())
        return
    if isinstance(fn, types.MethodType):
        yield type(fn.__self__).__name__, fn.__self__
        yield from _roots(fn.__func__, seen)
        return
    if not isinstance(fn, types.FunctionType):
        yield type(fn).__name__, fn
        return
    if id(fn) in seen:
        return
    seen.add(id(fn))
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # not yet bound
            continue
        if isinstance(value, types.FunctionType):
            yield from _roots(value, seen)
        else:
            yield name, value
    for name in _global_names(code):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                yield from _roots(value, seen)  # a helper of the same file: what it names, too
            else:
                yield f"global {name}", value


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _children(value: Any, path: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for i, (key, item) in enumerate(value.items()):
            if i >= _MAX_ITEMS:
                return
            yield f"{path}[{key!r}]", item
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:_MAX_ITEMS]):
            yield f"{path}[{i}]", item
    elif isinstance(value, (set, frozenset)):
        for i, item in enumerate(value):
            if i >= _MAX_ITEMS:
                return
            yield f"{path} (an item)", item
    elif isinstance(value, torch.nn.Module):
        # torch's own modules keep caches of their parameters (an RNN's ``_flat_weights``)
        # that their forward refreshes, and torch's weight_norm / spectral_norm hooks set
        # the weight they compute as an attribute: neither is the user's store
        own = type(value).__module__.startswith("torch.")
        computed = {getattr(hook, "name", None) for hook in value._forward_pre_hooks.values()}
        for key, item in vars(value).items():
            if key in ("_modules", "_parameters", "_buffers"):
                yield from ((f"{path}.{name}", child) for name, child in item.items())
            elif not own and key not in _MODULE_INTERNALS and key not in computed:
                yield f"{path}.{key}", item
    elif isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
        yield from ((f"{path} -> {name}", item) for name, item in _roots(value, seen))
    elif hasattr(value, "__dict__") and not type(value).__module__.startswith(("torch", "sgraph")):
        # torch's and sgraph's own objects are not walked: a compiled step the step
        # calls holds its trace's placeholders in its graphs, and that is no escape
        for key, item in vars(value).items():
            yield f"{path}.{key}", item
