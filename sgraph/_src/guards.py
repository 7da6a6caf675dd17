"""What a trace reads besides the tensor leaves, checked again on every call.

A traced step bakes in Python state that is not among its arguments: global modes
(grad mode, autocast, default dtype, backend switches that pick kernels) and the
training flags of the modules it runs (through ``sg.functional`` apply functions or
called directly, however it reaches them). Each is
snapshotted when the step is traced and compared on every call; a difference makes
the call miss the cache (and retrace under the retrace policy), and the retrace
message names what changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

__all__ = [
    "GlobalState",
    "ModuleFlags",
    "autocast_enabled",
    "autocast_off",
    "global_state",
    "describe_global_change",
    "tracing",
    "is_tracing",
    "note_module",
    "modules_in",
]


def _getter(name: str, *args: Any) -> Callable[[], Any] | None:
    """A getter of a torch global, or None where this torch build lacks it."""
    fn = getattr(torch._C, name, None) or getattr(torch, name, None)
    if fn is None:
        return None
    return (lambda: fn(*args)) if args else fn


def _autocast(device: str) -> tuple[str, Callable[[], Any] | None]:
    """Autocast on ``device``: off (False) or its dtype."""
    enabled = _getter("is_autocast_enabled", device)
    dtype = _getter("get_autocast_dtype", device)
    getter = (lambda: bool(enabled()) and dtype()) if enabled and dtype else None
    return f"autocast ({device})", getter


AUTOCAST_DEVICES = ("cpu", "cuda")
"""The devices whose autocast :func:`global_state` snapshots."""


def autocast_enabled() -> bool:
    """Whether autocast is on for any of :data:`AUTOCAST_DEVICES`."""
    return any(torch.is_autocast_enabled(device) for device in AUTOCAST_DEVICES)


@contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off on :data:`AUTOCAST_DEVICES`, for lowering, compiling and running a
    traced step: its graph holds the casts the trace made (and none inside a region
    the step turned autocast off in), so running it under the caller's autocast would
    cast again."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


def _default_device() -> Any:
    """The device ``torch.set_default_device`` or a ``with torch.device(...)`` block sets
    (None: the CPU), as ``torch.get_default_device`` finds it without its index lookup,
    which makes a tensor (2 us a call)."""
    if torch._C._len_torch_function_stack():  # no modes, the usual case: skip the walk
        for mode in reversed(_get_current_function_mode_stack()):
            if isinstance(mode, DeviceContext):
                return mode.device
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if context is None else context.device


# (name for messages, getter): every global whose value changes which ops a trace
# records or which kernels a captured graph runs.
_GLOBALS: list[tuple[str, Callable[[], Any]]] = [
    (name, get)
    for name, get in [
        ("grad mode", torch.is_grad_enabled),
        ("inference mode", torch.is_inference_mode_enabled),
        ("default dtype", torch.get_default_dtype),
        ("default device", _default_device),
        _autocast("cpu"),
        _autocast("cuda"),
        ("deterministic algorithms", _getter("_get_deterministic_algorithms")),
        ("TF32 matmuls (torch.backends.cuda.matmul.allow_tf32)", _getter("_get_cublas_allow_tf32")),
        ("TF32 convolutions (torch.backends.cudnn.allow_tf32)", _getter("_get_cudnn_allow_tf32")),
        ("reduced-precision fp16 matmul reductions", _getter("_get_cublas_allow_fp16_reduced_precision_reduction")),
        ("reduced-precision bf16 matmul reductions", _getter("_get_cublas_allow_bf16_reduced_precision_reduction")),
        ("torch.backends.cudnn.enabled", _getter("_get_cudnn_enabled")),
        ("torch.backends.cudnn.deterministic", _getter("_get_cudnn_deterministic")),
        ("torch.backends.mkldnn.enabled", _getter("_get_mkldnn_enabled")),
        ("flash attention (torch.backends.cuda.flash_sdp_enabled)", _getter("_get_flash_sdp_enabled")),
        ("memory-efficient attention", _getter("_get_mem_efficient_sdp_enabled")),
        ("math attention", _getter("_get_math_sdp_enabled")),
        ("cuDNN attention", _getter("_get_cudnn_sdp_enabled")),
    ]
    if get is not None
]
_GETTERS = [get for _, get in _GLOBALS]

GlobalState = tuple
"""One value per entry of ``_GLOBALS``, in order."""


def global_state() -> GlobalState:
    """The current values of every global a trace depends on (a few microseconds)."""
    return tuple([get() for get in _GETTERS])


def describe_global_change(old: GlobalState, new: GlobalState) -> list[str]:
    """``["autocast (cuda) changed: off -> bfloat16", ...]`` for each global that differs."""
    return [f"{name} changed: {_show(a)} -> {_show(b)}" for (name, _), a, b in zip(_GLOBALS, old, new) if a != b]


def _show(value: Any) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return repr(value)


# --------------------------------------------------------------------------- module flags


@dataclass(frozen=True)
class ModuleFlags:
    """The training flags of every module a trace depended on, to compare on each call.

    Attributes:
        modules: the modules, each once (every submodule of each root).
        names: how messages name each module, e.g. ``module 'encoder.drop' (Dropout)``.
        flags: their ``training`` values when the step was traced.
    """

    modules: tuple[nn.Module, ...] = ()
    names: tuple[str, ...] = ()
    flags: tuple[bool, ...] = ()

    @staticmethod
    def of(roots: Iterable[nn.Module]) -> ModuleFlags:
        """Snapshot the training flags of ``roots`` and all their submodules."""
        seen: dict[int, tuple[nn.Module, str]] = {}
        for root in roots:
            for name, m in root.named_modules(remove_duplicate=True):
                seen.setdefault(id(m), (m, _module_name(name, m)))
        modules = tuple(m for m, _ in seen.values())
        return ModuleFlags(modules, tuple(n for _, n in seen.values()), tuple(m.training for m in modules))

    def now(self) -> ModuleFlags:
        """The same modules with their training flags as they are now."""
        return ModuleFlags(self.modules, self.names, tuple(m.training for m in self.modules))

    def hold(self) -> bool:
        """Whether every module still has the training flag it was traced with."""
        return [m.training for m in self.modules] == list(self.flags)


def _module_name(name: str, module: nn.Module) -> str:
    return f"module {name!r} ({type(module).__name__})" if name else f"the root module ({type(module).__name__})"


def modules_in(fn: Callable[..., Any], statics: Iterable[Any]) -> list[nn.Module]:
    """Modules the step can read without calling an apply: static arguments (a method's
    ``self``) and modules the function closes over or is bound to."""
    found = [v for v in statics if isinstance(v, nn.Module)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            found.append(value)
    bound = getattr(fn, "__self__", None)
    if isinstance(bound, nn.Module):
        found.append(bound)
    return found


# --------------------------------------------------------------------------- trace context

_local = threading.local()


@contextmanager
def tracing() -> Iterator[list[nn.Module]]:
    """Mark this thread as tracing a step; yields the list that collects the modules
    whose training flags the trace reads (see :func:`note_module`): each module called
    while the step is traced, however the step reaches it (a global, a helper's
    closure, a ``functools.partial``, a list, the module as the step itself, a nested
    ``sg.static``), through a forward pre-hook on all modules held for the trace only
    (held, torch's module calls take their slower path with hooks everywhere)."""
    stack: list[list[nn.Module]] = _local.__dict__.setdefault("stack", [])
    collected: list[nn.Module] = []
    stack.append(collected)
    hook = nn.modules.module.register_module_forward_pre_hook(_note_called)
    try:
        yield collected
    finally:
        hook.remove()
        stack.pop()


def _note_called(module: nn.Module, args: Any) -> None:
    note_module(module)


def is_tracing() -> bool:
    """Whether this thread is inside an sgraph trace."""
    return bool(getattr(_local, "stack", None))


def note_module(module: nn.Module) -> None:
    """Record that the step being traced (if any, in this thread) runs ``module``."""
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(module)
